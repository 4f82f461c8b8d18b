#!/usr/bin/env bash
# Twenty-fourth session (nvidia-h200), the same tree as device_check20.sh: the loop-misuse cases on every model, the
# compiled nanoGPT cases, and the default's overhead on the nanoGPT-style step (interleaved, ratios of medians).
# First the six eager corpus cases that device_check20.sh's budget left out on a cold machine. Logs go to $OUT;
# the short table prints last. ~8.5 minutes.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
O=${OUT:-/tmp}
MIS=$(for m in nanogpt gpt2 llama t5 bert resnet vit unet lstm vae moe clip convnext wav2vec gcn; do for mu in clip-scaled no-update update-first half; do echo -n "$m/$mu "; done; done)
timeout 100 python benchmarks/realworld/run.py --device cuda --size small --compiled no --cases nanogpt/attn-noscale nanogpt/neg-inf@3 gpt2/backoff+spike gpt2/backoff+spike,no-ckpt nanogpt/grow15% lstm/bf16-rnn --budget-s 90 --json $O/rest.json > $O/rest.txt 2>&1
timeout 120 python benchmarks/realworld/run.py --device cuda --size small --compiled no --cases $MIS --budget-s 110 --json $O/misuse.json > $O/misuse.txt 2>&1
timeout 230 python benchmarks/realworld/run.py --device cuda --size small --compiled yes --cases nanogpt --budget-s 200 > $O/corpus_compiled.txt 2>&1
timeout 110 python benchmarks/overhead.py --model nanogpt --device cuda --variants plain,default,hroff --steps 80 --warmup 30 --sync-steps 0 > $O/eager.txt 2>&1
echo "== corpus rest (not PASS)"; grep "^[a-z0-9_]*/" $O/rest.txt | grep -v "| PASS" | cut -c1-250
echo "== corpus rest"; grep "PASS " $O/rest.txt | tail -1 | cut -c1-60
echo "== misuse (not PASS)"; grep "^[a-z0-9_]*/" $O/misuse.txt | grep -v "| PASS" | cut -c1-250
echo "== misuse"; grep "PASS " $O/misuse.txt | tail -1 | cut -c1-60
echo "== corpus compiled"; grep "PASS " $O/corpus_compiled.txt | tail -1 | cut -c1-40
echo "== nanoGPT overhead"; tail -6 $O/eager.txt
