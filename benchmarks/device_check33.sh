#!/usr/bin/env bash
# Thirty-first session (one NVIDIA H100: the H200s could not be had), the calls after device_check32.sh on the same
# warm machine: the rest of the eager corpus (the cases device_check32.sh's 150 s did not reach), the compiled nanoGPT
# cases, the loop-misuse cases on every model, the entry-module container, then the overhead of the nanoGPT-style step
# and of GPT-2 small. Logs go to $OUT; the short tables print last. ~7 minutes.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
O=${OUT:-/tmp}
C="bert/spike@3 clip/healthy clip/spike@3 convnext/healthy convnext/spike@3 gcn/healthy gcn/spike@3 gpt2/backoff+spike
gpt2/spike@3 llama/spike@3 lstm/bf16-rnn lstm/spike@3 moe/healthy moe/spike@3 nanogpt/attn-noscale nanogpt/grow15%
nanogpt/lr=0.05,nowarmup nanogpt/lr=10 nanogpt/neg-inf@3 nanogpt/spike@3 resnet/spike@3 t5/spike@3 unet/spike@3
vae/spike@3 vit/spike@3 wav2vec/healthy wav2vec/spike@3"
MIS=$(for m in nanogpt gpt2 llama t5 bert resnet vit unet lstm vae moe clip convnext wav2vec gcn; do for mu in clip-scaled no-update update-first half; do echo -n "$m/$mu "; done; done)
timeout 330 python benchmarks/realworld/run.py --device cuda --size small --compiled no --cases $C --budget-s 300 --json $O/corpus2.json > $O/corpus2.txt 2>&1
timeout 150 python benchmarks/realworld/run.py --device cuda --size small --compiled yes --cases nanogpt --budget-s 130 > $O/compiled.txt 2>&1
timeout 60 python benchmarks/cuda_entries.py > $O/entries.txt 2>&1
timeout 200 python benchmarks/realworld/run.py --device cuda --size small --compiled no --cases $MIS --budget-s 180 > $O/misuse.txt 2>&1
timeout 200 python benchmarks/overhead.py --model nanogpt --device cuda --variants plain,default,every1 --steps 30 --warmup 5 > $O/nanogpt.txt 2>&1
timeout 150 python benchmarks/overhead.py --model gpt2 --device cuda --variants plain,default --steps 20 --warmup 4 > $O/gpt2.txt 2>&1
for f in corpus2 compiled misuse; do
  echo "== $f (not PASS)"; grep "^[a-z0-9_]*/" $O/$f.txt | grep -v "| PASS" | cut -c1-250; grep "PASS " $O/$f.txt | tail -1 | cut -c1-40
done
echo "== entry modules"; tail -3 $O/entries.txt | cut -c1-250
echo "== overhead"; tail -4 $O/nanogpt.txt; tail -3 $O/gpt2.txt
