#!/usr/bin/env bash
# Twenty-fifth session (nvidia-h200), first call: the previous session's last code (a corpus slice, as
# device_check22.sh), then where the default's per-step cost on the nanoGPT-style step goes now (ablation with
# 2 copies per variant, idle gaps by host range). Logs go to $OUT; short tables print last. ~5 minutes.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
O=${OUT:-/tmp}
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > $O/gpu.txt 2>&1
timeout 150 python benchmarks/realworld/run.py --device cuda --size small --compiled no --cases nanogpt/healthy gpt2/spike@3 resnet/spike@3 nanogpt/grow15% --budget-s 110 --json $O/slice.json > $O/slice.txt 2>&1
timeout 120 python benchmarks/ablate_default.py --model nanogpt --device cuda --watch default --pieces all,pending,fwd,clip,event+loc,store,spin400 --steps 100 --copies 2 > $O/ablate.txt 2>&1
timeout 60 python benchmarks/idle_gaps.py --model nanogpt --every 0 --steps 4 > $O/gaps.txt 2>&1
echo "== gaps"; tail -25 $O/gaps.txt | cut -c1-200
echo "== ablate"; tail -14 $O/ablate.txt | cut -c1-200
echo "== slice (not PASS)"; grep "^[a-z0-9_]*/" $O/slice.txt | grep -v "| PASS" | cut -c1-250
echo "== slice"; grep "PASS " $O/slice.txt | tail -1 | cut -c1-60
