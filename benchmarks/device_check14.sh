#!/usr/bin/env bash
# Twenty-third session (nvidia-h200): the corpus after the session's changes (meta-device parameters left out of the
# update checks and captures; a capture keeps the model's structure for a replay after the script changed the model,
# and stores namedtuples; the replay orders ops whose values got out of their module before absorbed ones) -- the
# eager corpus (every case but the loop-misuse ones), then the compiled nanoGPT cases. Logs go to $OUT; the short
# table prints last. ~8 minutes.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
O=${OUT:-/tmp}
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
NOTMIS=$(python -c "
from benchmarks.realworld.cases import all_cases
print(' '.join(c.name for c in all_cases() if c.name.split('/')[1] not in ('clip-scaled','no-update','update-first','half')))" | tr ' ' '\n' | sort -u | tr '\n' ' ')
timeout 360 python benchmarks/realworld/run.py --device cuda --size small --compiled no --cases $NOTMIS --budget-s 335 --json $O/corpus.json > $O/corpus.txt 2>&1
timeout 100 python benchmarks/realworld/run.py --device cuda --size small --compiled yes --cases nanogpt --budget-s 90 > $O/corpus_compiled.txt 2>&1
echo "== corpus (not PASS)"; grep "^[a-z0-9_]*/" $O/corpus.txt | grep -v "| PASS" | cut -c1-250
echo "== corpus"; grep "PASS " $O/corpus.txt | tail -1 | cut -c1-60
echo "== corpus compiled"; grep "^[a-z0-9_]*/" $O/corpus_compiled.txt | cut -c1-120; grep "PASS " $O/corpus_compiled.txt | tail -1 | cut -c1-40
