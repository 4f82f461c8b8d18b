#!/usr/bin/env bash
# One device-machine call (nvidia-h200): the compiled nanoGPT-style step again, with headroom=True beside the default
# and headroom=False (does the root-only series of a compiled model cost more than its 2% budget, or was the first
# measurement noise?), two rounds; the eager step beside it. A short table prints last. ~4 minutes.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
O=${OUT:-/tmp}
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
for r in 1 2; do
  timeout 200 python benchmarks/overhead.py --model nanogpt --device cuda --compile --variants plain,default,hroff,headroom --steps 80 --warmup 20 --sync-steps 0 > $O/compiled$r.txt 2>&1
done
timeout 120 python benchmarks/overhead.py --model nanogpt --device cuda --variants plain,default,hroff,headroom --steps 80 --warmup 30 --sync-steps 0 > $O/eager.txt 2>&1
for f in compiled1 compiled2 eager; do echo "== $f"; tail -5 $O/$f.txt; done
