#!/usr/bin/env bash
# Twenty-fifth session (nvidia-h200), second call: device_check23.sh's measurements again with the two benchmarks
# mended (ablate_default.py's rng patch had switched every watch off; idle_gaps.py named transfer.finalize, now
# assemble.finalize), and overhead.py's nanoGPT ratio. Logs go to $OUT; short tables print last. ~4 minutes.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
O=${OUT:-/tmp}
timeout 120 python benchmarks/ablate_default.py --model nanogpt --device cuda --watch default --pieces all,pending,fwd,clip,event+loc,store,rng,sums,spin400 --steps 100 --copies 2 > $O/ablate.txt 2>&1
timeout 60 python benchmarks/idle_gaps.py --model nanogpt --every 0 --steps 4 > $O/gaps.txt 2>&1
timeout 90 python benchmarks/overhead.py --model nanogpt --device cuda --variants plain,default,hroff --steps 150 > $O/nano.txt 2>&1
echo "== gaps"; tail -22 $O/gaps.txt | cut -c1-200
echo "== ablate"; tail -15 $O/ablate.txt | cut -c1-200
echo "== nanogpt"; tail -6 $O/nano.txt | cut -c1-200
