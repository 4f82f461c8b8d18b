#!/usr/bin/env bash
# Thirty-seventh session. `bash device_check38.sh 1`: the whole eager real-code corpus in one call (healthy bitwise
# and quiet with save_batch + replay, injected failures at module and step, loop misuse by rule), the GAN container.
# `bash device_check38.sh 2`: compiled nanoGPT, and the default's and every=1's overhead on the nanoGPT-style step
# (interleaved with the plain step). Short tables last.
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
  timeout 150 python benchmarks/realworld/run.py --device cuda --size small --compiled yes --cases nanogpt --budget-s 130 > $O/compiled.txt 2>&1
  timeout 200 python benchmarks/overhead.py --model nanogpt --device cuda --variants plain,default,every1 --steps 40 > $O/ovh_nano.txt 2>&1
  echo "== compiled"; grep "^[a-z0-9_]*/" $O/compiled.txt | cut -c1-160; tail -1 $O/compiled.txt | cut -c1-120
  echo "== overhead nanoGPT"; tail -7 $O/ovh_nano.txt
fi
