#!/usr/bin/env bash
# Twenty-fourth session (nvidia-h200), the last code change (a DDP rank takes no producer from gradients the
# all-reduce made non-finite: a no-op in one process) with little device time left: a slice of the eager corpus,
# healthy and injected. Logs go to $OUT; the short table prints last. ~2.5 minutes.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
O=${OUT:-/tmp}
timeout 140 python benchmarks/realworld/run.py --device cuda --size small --compiled no --cases nanogpt/healthy gpt2/spike@3 resnet/spike@3 nanogpt/grow15% --budget-s 110 --json $O/slice.json > $O/slice.txt 2>&1
echo "== slice (not PASS)"; grep "^[a-z0-9_]*/" $O/slice.txt | grep -v "| PASS" | cut -c1-250
echo "== slice"; grep "PASS " $O/slice.txt | tail -1 | cut -c1-60
