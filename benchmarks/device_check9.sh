#!/usr/bin/env bash
# The next session's first device call (nvidia-h200), for what the twentieth session could not run: the real-code
# corpus at the headroom budget's floor (change 2: the series' own host work under its measured cost), eager and
# compiled; what the budget now chooses on the compiled nanoGPT step; its overhead tables beside the eager step and
# GPT-2's default. Logs go to $OUT; a short table prints last. ~7 minutes.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
O=${OUT:-/tmp}
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
timeout 200 python benchmarks/realworld/run.py --device cuda --size small --compiled no --budget-s 190 > $O/corpus.txt 2>&1
timeout 90 python benchmarks/realworld/run.py --device cuda --size small --compiled yes --cases nanogpt --budget-s 70 > $O/corpus_compiled.txt 2>&1
timeout 40 python -m pytest -q -p no:cacheprovider tests/test_headroom.py tests/test_headroom_budget.py > $O/tests.txt 2>&1
timeout 80 python benchmarks/budget_probe.py --model nanogpt --device cuda --compile yes --steps 300 > $O/budget.txt 2>&1
timeout 150 python benchmarks/overhead.py --model nanogpt --device cuda --compile --variants plain,default,hroff,headroom --steps 100 --warmup 20 --sync-steps 0 > $O/compiled.txt 2>&1
timeout 100 python benchmarks/overhead.py --model nanogpt --device cuda --variants plain,default,hroff --steps 80 --warmup 30 --sync-steps 0 > $O/eager.txt 2>&1
timeout 120 python benchmarks/overhead.py --model gpt2 --device cuda --steps 24 --warmup 6 --sync-steps 2 --variants plain,default,headroom > $O/gpt2.txt 2>&1
echo "== tests"; tail -1 $O/tests.txt
echo "== corpus"; grep "^[a-z0-9_]*/" $O/corpus.txt | grep -v "| PAS" | cut -c1-220; grep "PASS " $O/corpus.txt | cut -c1-40
echo "== corpus compiled"; grep "PASS " $O/corpus_compiled.txt | cut -c1-40
echo "== budget"; grep -o "'stride'.*'series_steps': [0-9]*" $O/budget.txt; tail -1 $O/budget.txt
echo "== gpt2"; tail -4 $O/gpt2.txt
echo "== eager"; tail -4 $O/eager.txt
echo "== compiled"; tail -5 $O/compiled.txt
