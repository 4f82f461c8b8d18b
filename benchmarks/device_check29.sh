#!/usr/bin/env bash
# Twenty-seventh session (nvidia-h200), the last call: the eager corpus within ~3 minutes (the cases its budget
# reaches, healthy ones included; losses bitwise with and without the watch) and the entry modules on CUDA, after the
# update checks on unfrozen layers and moved learning rates (record/params.py), the sampled-step weight norms when
# the scaler skips (record/monitorsink.py), the entry re-probe and the replay's shape/weight-cast changes. Logs go to
# $OUT; the short table prints last.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
O=${OUT:-/tmp}
ALL=$(python -c "
from benchmarks.realworld.cases import all_cases
print(' '.join(c.name for c in all_cases() if c.name.split('/')[1] not in ('clip-scaled','no-update','update-first','half')))" | tr ' ' '\n' | sort -u | tr '\n' ' ')
timeout 60 python benchmarks/cuda_entries.py > $O/entries.txt 2>&1
timeout 195 python benchmarks/realworld/run.py --device cuda --size small --compiled no --cases $ALL --budget-s 170 --json $O/corpus.json > $O/corpus.txt 2>&1
echo "== corpus (not PASS)"; grep "^[a-z0-9_]*/" $O/corpus.txt | grep -v "| PASS" | cut -c1-250
echo "== corpus"; grep -c "| PASS" $O/corpus.txt; grep "PASS " $O/corpus.txt | tail -1 | cut -c1-60
echo "== entry modules"; tail -3 $O/entries.txt
