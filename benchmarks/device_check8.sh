#!/usr/bin/env bash
# One device-machine call (nvidia-h200) after the headroom budget's change (the series' cost from neighbouring
# steps): what the budget measures now on the eager and compiled nanoGPT step, their overhead tables (default vs
# headroom off/on), GPT-2 default, and the real-code corpus (eager, and compiled nanoGPT) with the GPU tests of the
# headroom. Logs go to $OUT; a short table prints last. ~7 minutes.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
O=${OUT:-/tmp}
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
timeout 100 python benchmarks/budget_probe.py --model nanogpt --device cuda --steps 160 > $O/budget.txt 2>&1
timeout 150 python benchmarks/overhead.py --model nanogpt --device cuda --compile --variants plain,default,hroff,headroom --steps 100 --warmup 20 --sync-steps 0 > $O/compiled.txt 2>&1
timeout 100 python benchmarks/overhead.py --model nanogpt --device cuda --variants plain,default,hroff --steps 80 --warmup 30 --sync-steps 0 > $O/eager.txt 2>&1
timeout 200 python benchmarks/realworld/run.py --device cuda --size small --compiled no --budget-s 190 > $O/corpus.txt 2>&1
timeout 90 python benchmarks/realworld/run.py --device cuda --size small --compiled yes --cases nanogpt --budget-s 70 > $O/corpus_compiled.txt 2>&1
timeout 60 python -m pytest -q -p no:cacheprovider tests/test_headroom.py tests/test_headroom_budget.py tests/test_fused.py > $O/tests.txt 2>&1
echo "== tests"; tail -1 $O/tests.txt
echo "== corpus"; grep -c "| PAS" $O/corpus.txt; grep -v "| PAS" $O/corpus.txt | grep "^[a-z0-9_]*/" | cut -c1-220; tail -3 $O/corpus.txt | cut -c1-200
echo "== corpus compiled"; tail -3 $O/corpus_compiled.txt | cut -c1-200
echo "== budget"; tail -3 $O/budget.txt
echo "== eager"; tail -4 $O/eager.txt
echo "== compiled"; tail -5 $O/compiled.txt
