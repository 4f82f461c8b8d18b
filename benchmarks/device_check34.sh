#!/usr/bin/env bash
# Thirty-second session, two calls on one warm GPU (whatever its kind: H100 or H200): `bash device_check34.sh 1`
# then `bash device_check34.sh 2`. Call 1: the eager real-code corpus (every case but the loop-misuse ones; the
# default watch; healthy cases bitwise with and without it) and the GAN container. Call 2: the compiled nanoGPT
# cases, the loop-misuse cases on every model, the overhead of the nanoGPT-style step (plain, default, every=1) and of
# GPT-2 small (plain, default). Logs go to $OUT; the short tables print last. ~9 minutes each.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
O=${OUT:-/tmp}
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
if [ "${1:-1}" = 1 ]; then
  NOTMIS=$(python -c "
from benchmarks.realworld.cases import all_cases
print(' '.join(c.name for c in all_cases() if c.name.split('/')[1] not in ('clip-scaled','no-update','update-first','half')))" | tr ' ' '\n' | sort -u | tr '\n' ' ')
  timeout 500 python benchmarks/realworld/run.py --device cuda --size small --compiled no --cases $NOTMIS --budget-s 480 --json $O/corpus.json > $O/corpus.txt 2>&1
  timeout 60 python benchmarks/cuda_gan.py > $O/gan.txt 2>&1
  echo "== corpus (not PASS)"; grep "^[a-z0-9_]*/" $O/corpus.txt | grep -v "| PASS" | cut -c1-250
  echo "== corpus PASS"; grep -c "| PASS" $O/corpus.txt; grep -c "    PASS in" $O/corpus.txt
  echo "== GAN container"; tail -4 $O/gan.txt | cut -c1-300
else
  MIS=$(for m in nanogpt gpt2 llama t5 bert resnet vit unet lstm vae moe clip convnext wav2vec gcn; do for mu in clip-scaled no-update update-first half; do echo -n "$m/$mu "; done; done)
  timeout 150 python benchmarks/realworld/run.py --device cuda --size small --compiled yes --cases nanogpt --budget-s 130 > $O/compiled.txt 2>&1
  timeout 200 python benchmarks/realworld/run.py --device cuda --size small --compiled no --cases $MIS --budget-s 180 > $O/misuse.txt 2>&1
  timeout 130 python benchmarks/overhead.py --model nanogpt --device cuda --variants plain,default,every1 --steps 20 --warmup 4 > $O/nanogpt.txt 2>&1
  timeout 100 python benchmarks/overhead.py --model gpt2 --device cuda --variants plain,default --steps 14 --warmup 3 > $O/gpt2.txt 2>&1
  for f in compiled misuse; do
    echo "== $f (not PASS)"; grep "^[a-z0-9_]*/" $O/$f.txt | grep -v "| PASS" | cut -c1-250; grep -c "    PASS in" $O/$f.txt
  done
  echo "== overhead"; tail -5 $O/nanogpt.txt; tail -4 $O/gpt2.txt
fi
