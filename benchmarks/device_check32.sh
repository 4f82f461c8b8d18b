#!/usr/bin/env bash
# Thirtieth session, one call on a GPU (little device time left): the GAN container on one GradScaler
# (benchmarks/cuda_gan.py), optimizer steps fused into the backward (cuda_opt_in_bwd.py) and as much of the eager
# corpus as fits in 150 s (every case but the loop-misuse ones; losses bitwise with and without the watch). Logs go
# to $OUT; the short table prints last. ~5 minutes.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
O=${OUT:-/tmp}
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
timeout 60 python benchmarks/cuda_gan.py > $O/gan.txt 2>&1
timeout 60 python benchmarks/cuda_opt_in_bwd.py > $O/oib.txt 2>&1
NOTMIS=$(python -c "
from benchmarks.realworld.cases import all_cases
print(' '.join(c.name for c in all_cases() if c.name.split('/')[1] not in ('clip-scaled','no-update','update-first','half')))" | tr ' ' '\n' | sort -u | tr '\n' ' ')
timeout 170 python benchmarks/realworld/run.py --device cuda --size small --compiled no --cases $NOTMIS --budget-s 150 --json $O/corpus.json > $O/corpus.txt 2>&1
echo "== corpus (not PASS)"; grep "^[a-z0-9_]*/" $O/corpus.txt | grep -v "| PASS" | cut -c1-250
echo "== corpus"; grep -c "| PASS" $O/corpus.txt; grep "PASS " $O/corpus.txt | tail -1 | cut -c1-60
echo "== optimizer in backward"; tail -4 $O/oib.txt | cut -c1-300
echo "== GAN container"; tail -4 $O/gan.txt | cut -c1-300
