#!/usr/bin/env bash
# Twenty-third session (nvidia-h200), after the capture/replay changes that touch the every-step path (the batch's
# containers copied before the forward, the RNG states a forward draws from): the eager corpus (every case but the
# loop-misuse ones: losses bitwise with and without the watch), the compiled nanoGPT cases, and the default's
# overhead on the nanoGPT-style step (interleaved, ratios of medians). Logs go to $OUT; the short table prints last.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
O=${OUT:-/tmp}
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
NOTMIS=$(python -c "
from benchmarks.realworld.cases import all_cases
print(' '.join(c.name for c in all_cases() if c.name.split('/')[1] not in ('clip-scaled','no-update','update-first','half')))" | tr ' ' '\n' | sort -u | tr '\n' ' ')
timeout 340 python benchmarks/realworld/run.py --device cuda --size small --compiled no --cases $NOTMIS --budget-s 320 --json $O/corpus.json > $O/corpus.txt 2>&1
timeout 90 python benchmarks/realworld/run.py --device cuda --size small --compiled yes --cases nanogpt --budget-s 80 > $O/corpus_compiled.txt 2>&1
timeout 100 python benchmarks/overhead.py --model nanogpt --device cuda --variants plain,default,hroff --steps 80 --warmup 30 --sync-steps 0 > $O/eager.txt 2>&1
echo "== corpus (not PASS)"; grep "^[a-z0-9_]*/" $O/corpus.txt | grep -v "| PASS" | cut -c1-250
echo "== corpus"; grep "PASS " $O/corpus.txt | tail -1 | cut -c1-60
echo "== corpus compiled"; grep "PASS " $O/corpus_compiled.txt | tail -1 | cut -c1-40
echo "== nanoGPT overhead"; tail -6 $O/eager.txt
