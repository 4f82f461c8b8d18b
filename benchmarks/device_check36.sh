#!/usr/bin/env bash
# Thirty-fifth session: one call. The eager real-code corpus, every case (healthy bitwise and quiet, injected
# failures, the loop-misuse cases) within a 360 s budget, then the GAN container; short tables last.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
O=${OUT:-/tmp}
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
timeout 400 python benchmarks/realworld/run.py --device cuda --size small --compiled no --budget-s 360 --json $O/corpus.json > $O/corpus.txt 2>&1
timeout 60 python benchmarks/cuda_gan.py > $O/gan.txt 2>&1
echo "== corpus (not PASS)"; grep "^[a-z0-9_]*/" $O/corpus.txt | grep -v "| PASS" | cut -c1-250
echo "== corpus PASS rows"; grep -c "| PASS" $O/corpus.txt; tail -3 $O/corpus.txt | cut -c1-200
echo "== GAN container"; tail -4 $O/gan.txt | cut -c1-300
