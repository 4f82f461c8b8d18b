#!/usr/bin/env bash
# One device-machine call (nvidia-h200): issue 15's compiled small real step (nanoGPT-style, torch.compile, never
# measured before), the eager one beside it, and where the default watch's host time goes on that step (cProfile,
# the GPU host's own breakdown) with the kernels per step. Logs go to $OUT; a short table prints last. ~5 minutes.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
O=${OUT:-/tmp}
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
timeout 240 python benchmarks/overhead.py --model nanogpt --device cuda --compile --variants plain,default,hroff --steps 60 --warmup 20 --sync-steps 2 > $O/nanogpt_compiled.txt 2>&1
timeout 100 python benchmarks/overhead.py --model nanogpt --device cuda --variants plain,default,hroff --steps 60 --warmup 30 --sync-steps 0 > $O/nanogpt.txt 2>&1
timeout 120 python benchmarks/host_profile.py --model nanogpt --device cuda --variants plain,default --steps 60 --prof-steps 40 --top 40 > $O/host_profile.txt 2>&1
timeout 90 python benchmarks/profile_every1.py --model nanogpt --device cuda --every 200 --steps 10 --top 5 > $O/ops.txt 2>&1
echo "== ops";      grep -i "aten\|kernels\|x)" $O/ops.txt
echo "== host";     grep -A3 "^| variant" $O/host_profile.txt | head -5; grep "attributed" $O/host_profile.txt
echo "== nanogpt";  tail -5 $O/nanogpt.txt
echo "== nanogpt compiled"; tail -6 $O/nanogpt_compiled.txt
