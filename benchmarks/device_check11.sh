#!/usr/bin/env bash
# Twenty-first session, last call (nvidia-h200): the real-code corpus after the session's rule and replay changes
# (Selections / chose_differently, float16-in-bf16 underflow, the first unlocated bad step, overflow with NaN beside
# it) with all fifteen architectures and lstm/bf16-rnn, eager at size small; then the compiled nanoGPT cases.
# Logs go to $OUT; the short table prints last. ~9 minutes.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
O=${OUT:-/tmp}
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
timeout 420 python benchmarks/realworld/run.py --device cuda --size small --compiled no --budget-s 390 --json $O/corpus.json > $O/corpus.txt 2>&1
timeout 95 python benchmarks/realworld/run.py --device cuda --size small --compiled yes --cases nanogpt --budget-s 85 > $O/corpus_compiled.txt 2>&1
echo "== corpus (not PASS)"; grep "^[a-z0-9_]*/" $O/corpus.txt | grep -v "| PASS" | cut -c1-250
echo "== corpus"; grep "PASS " $O/corpus.txt | tail -2 | cut -c1-60
echo "== corpus compiled"; grep "^[a-z0-9_]*/" $O/corpus_compiled.txt | cut -c1-120; grep "PASS " $O/corpus_compiled.txt | tail -1 | cut -c1-40
