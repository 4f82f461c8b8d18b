#!/usr/bin/env bash
# One device-machine call (nvidia-h200) for what the nineteenth session could not run: the compiled corpus after the
# flush-cap changes, the table kernel's stripped-down variants (what bounds its device time), its launch sweep, and
# GPT-2 every=1 / nanoGPT default side by side. Logs go to $OUT; a short table prints last. ~5 minutes.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
O=${OUT:-/tmp}
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
timeout 120 python benchmarks/realworld/run.py --device cuda --size small --compiled yes --cases nanogpt --budget-s 70 > $O/compiled.txt 2>&1
timeout 90 python benchmarks/table_kernel_variants.py > $O/variants.txt 2>&1
timeout 60 python -m pytest -q -p no:cacheprovider tests/test_fused.py > $O/fused.txt 2>&1
timeout 150 python benchmarks/overhead.py --model gpt2 --device cuda --steps 24 --warmup 6 --sync-steps 2 --variants plain,default,every1 > $O/gpt2.txt 2>&1
timeout 100 python benchmarks/overhead.py --model nanogpt --device cuda --variants plain,default,hroff --steps 60 --warmup 30 --sync-steps 0 > $O/nanogpt.txt 2>&1
echo "== compiled"; tail -5 $O/compiled.txt | cut -c1-200
echo "== fused";    tail -1 $O/fused.txt
echo "== variants"; tail -6 $O/variants.txt
echo "== gpt2";     tail -5 $O/gpt2.txt
echo "== nanogpt";  tail -5 $O/nanogpt.txt
