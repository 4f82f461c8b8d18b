#!/usr/bin/env bash
# Thirty-sixth session, second call: compiled nanoGPT (fp16/bf16 healthy, spiked), the default's overhead on the
# nanoGPT-style step and GPT-2 small (interleaved with the plain step), and the minimal recorder's floor beside it.
# (The first call is device_check36.sh: the eager corpus and the GAN.) Short tables last.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
O=${OUT:-/tmp}
timeout 150 python benchmarks/realworld/run.py --device cuda --size small --compiled yes --cases nanogpt --budget-s 130 > $O/compiled.txt 2>&1
timeout 150 python benchmarks/overhead.py --model nanogpt --device cuda --variants plain,default --steps 60 > $O/ovh_nano.txt 2>&1
timeout 120 python benchmarks/overhead.py --model gpt2 --device cuda --variants plain,default --steps 14 > $O/ovh_gpt2.txt 2>&1
timeout 120 python benchmarks/minimal_step.py --model nanogpt --device cuda --steps 120 > $O/min.txt 2>&1
echo "== compiled"; grep "^[a-z0-9_]*/" $O/compiled.txt | cut -c1-160; tail -1 $O/compiled.txt | cut -c1-120
echo "== overhead nanoGPT"; tail -6 $O/ovh_nano.txt
echo "== overhead GPT-2"; tail -6 $O/ovh_gpt2.txt
echo "== minimal"; tail -6 $O/min.txt
