#!/usr/bin/env bash
# Twenty-fourth session (nvidia-h200), second round: after the loop-side rules (zero_grad between unscale_ and step,
# a wrapper unscaled twice, growth_factor, skip share, update_spike lr) and modstate round 2 (lists/deques, probes on
# steps 1-8, values from before a probed forward): the eager corpus (every case but the loop-misuse ones: losses
# bitwise with and without the watch). Logs go to $OUT; the short table prints last. ~5.5 minutes.
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
