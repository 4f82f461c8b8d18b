#!/usr/bin/env bash
# Twenty-third session (nvidia-h200), after the review's last hook change (the input-writes check back in its
# place) and the capture-format split: the eager corpus (every case but the loop-misuse ones). Logs go to $OUT; the
# short table prints last. ~5.5 minutes.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
O=${OUT:-/tmp}
NOTMIS=$(python -c "
from benchmarks.realworld.cases import all_cases
print(' '.join(c.name for c in all_cases() if c.name.split('/')[1] not in ('clip-scaled','no-update','update-first','half')))" | tr ' ' '\n' | sort -u | tr '\n' ' ')
timeout 320 python benchmarks/realworld/run.py --device cuda --size small --compiled no --cases $NOTMIS --budget-s 300 --json $O/corpus.json > $O/corpus.txt 2>&1
echo "== corpus (not PASS)"; grep "^[a-z0-9_]*/" $O/corpus.txt | grep -v "| PASS" | cut -c1-250
echo "== corpus"; grep "PASS " $O/corpus.txt | tail -1 | cut -c1-60
