#!/usr/bin/env bash
# Twenty-fifth session (nvidia-h200): after the integer watch (record/intwatch.py: a pre-hook on modules whose
# integer inputs a sampled step found), headroom_trend's after-the-fact filter and the recurring-skip captures: the eager
# corpus (every case but the
# loop-misuse ones; losses bitwise with and without the watch). Logs go to $OUT; the short table prints last.
# ~5.5 minutes.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
O=${OUT:-/tmp}
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
NOTMIS=$(python -c "
from benchmarks.realworld.cases import all_cases
print(' '.join(c.name for c in all_cases() if c.name.split('/')[1] not in ('clip-scaled','no-update','update-first','half')))" | tr ' ' '\n' | sort -u | tr '\n' ' ')
timeout 420 python benchmarks/realworld/run.py --device cuda --size small --compiled no --cases $NOTMIS --budget-s 390 --json $O/corpus.json > $O/corpus.txt 2>&1
echo "== corpus (not PASS)"; grep "^[a-z0-9_]*/" $O/corpus.txt | grep -v "| PASS" | cut -c1-250
echo "== corpus"; grep "PASS " $O/corpus.txt | tail -1 | cut -c1-60
