#!/usr/bin/env bash
# One device-machine call (nvidia-h200): the real-code corpus eager and compiled, the GPU test subset, and the
# nanoGPT / GPT-2 overhead of the default (headroom="auto") and headroom=True. Logs go to $OUT; a table prints last.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
O=${OUT:-/tmp}
python -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
python benchmarks/realworld/run.py --device cuda --size small --compiled no --budget-s 230 > $O/corpus.txt 2>&1
python benchmarks/realworld/run.py --device cuda --size small --compiled yes --cases nanogpt --budget-s 70 > $O/compiled.txt 2>&1
timeout 90 python -m pytest -q -p no:cacheprovider tests/test_fused.py tests/test_headroom.py tests/test_headroom_prune.py \
  tests/test_headroom_budget.py tests/test_identity.py tests/test_step_phase.py tests/test_gradexits.py tests/test_bad_data.py tests/test_model_changes.py tests/test_unfinished_iteration.py tests/test_grad_check_by_norm.py > $O/tests.txt 2>&1
python benchmarks/overhead.py --model nanogpt --device cuda --variants plain,default,hroff,headroom --steps 50 --warmup 30 --sync-steps 0 > $O/nanogpt.txt 2>&1
timeout 80 python benchmarks/overhead.py --model gpt2 --device cuda --variants plain,default,headroom --steps 24 --warmup 14 > $O/gpt2.txt 2>&1
timeout 60 python benchmarks/overhead.py --model convnet --device cuda --variants plain,default,hroff --steps 30 --warmup 10 --sync-steps 0 > $O/convnet.txt 2>&1
echo "== corpus";   tail -8 $O/corpus.txt
echo "== compiled"; tail -5 $O/compiled.txt
echo "== tests";    tail -2 $O/tests.txt
echo "== nanogpt";  tail -6 $O/nanogpt.txt
echo "== gpt2";     tail -5 $O/gpt2.txt
echo "== convnet";  tail -4 $O/convnet.txt
