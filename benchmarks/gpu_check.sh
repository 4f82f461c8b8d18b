#!/usr/bin/env bash
# The real-code check on the device machine (run from the repository root; $OUT collects the logs):
#   bash benchmarks/gpu_check.sh 1   the eager real-code corpus in one call (healthy runs bitwise and quiet with
#                                    save_batch + replay, injected failures named at module and step, loop misuse by
#                                    rule; benchmarks/realworld/run.py) and the GAN container (benchmarks/cuda_gan.py)
#                                    ~380-460 s on an H100
#   bash benchmarks/gpu_check.sh 2   the CUDA-only tests (tests/test_fused.py, test_graph_lifetime.py), compiled
#                                    nanoGPT, the overhead of the default and every=1 on the nanoGPT-style step
#                                    (interleaved with the plain step),
#                                    the host-work windows of that step (window_probe.py) and what holds a step's
#                                    autograd graph after the loop let go of it (graph_holders.py); ~140-170 s
# Short tables last. (It replaces the per-session device_check*.sh scripts that RESULTS.md's older entries name; they
# are in the git history.)
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
O=${OUT:-/tmp}
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
if [ "${1:-1}" = 1 ]; then
  timeout 540 python benchmarks/realworld/run.py --device cuda --size small --compiled no --budget-s 500 --json $O/corpus.json > $O/corpus.txt 2>&1
  timeout 40 python benchmarks/cuda_gan.py > $O/gan.txt 2>&1
  echo "== corpus (not PASS)"; grep "^[a-z0-9_]*/" $O/corpus.txt | grep -v "| PASS" | cut -c1-250
  echo "== corpus PASS rows"; grep -c "| PASS" $O/corpus.txt; tail -3 $O/corpus.txt | cut -c1-200
  echo "== GAN container"; tail -4 $O/gan.txt | cut -c1-300
else
  timeout 120 python -m pytest -q -p no:cacheprovider tests/test_fused.py tests/test_graph_lifetime.py > $O/tests.txt 2>&1
  timeout 60 python benchmarks/graph_holders.py --device cuda --steps 8 > $O/holders.txt 2>&1
  timeout 150 python benchmarks/window_probe.py --model nanogpt --device cuda --spin 300 --steps 80 > $O/window.txt 2>&1
  timeout 150 python benchmarks/realworld/run.py --device cuda --size small --compiled yes --cases nanogpt --budget-s 130 > $O/compiled.txt 2>&1
  timeout 200 python benchmarks/overhead.py --model nanogpt --device cuda --variants plain,default,every1 --steps 40 > $O/ovh_nano.txt 2>&1
  echo "== compiled"; grep "^[a-z0-9_]*/" $O/compiled.txt | cut -c1-160; tail -1 $O/compiled.txt | cut -c1-120
  echo "== overhead nanoGPT"; tail -7 $O/ovh_nano.txt
  echo "== CUDA tests"; tail -4 $O/tests.txt | cut -c1-300
  echo "== what holds a step's graph after the loop let go (benchmarks/graph_holders.py)"; tail -8 $O/holders.txt | cut -c1-200
  echo "== windows (spin 300 us)"; tail -7 $O/window.txt
fi
