#!/usr/bin/env bash
# Twenty-fifth session (nvidia-h200), the same tree as device_check26.sh: the six eager corpus cases its budget leaves
# out on a cold machine, the loop-misuse cases on every model, and the compiled nanoGPT cases. Logs go to $OUT; the
# short table prints last. ~6.5 minutes.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
O=${OUT:-/tmp}
MIS=$(for m in nanogpt gpt2 llama t5 bert resnet vit unet lstm vae moe clip convnext wav2vec gcn; do for mu in clip-scaled no-update update-first half; do echo -n "$m/$mu "; done; done)
timeout 90 python benchmarks/realworld/run.py --device cuda --size small --compiled no --cases nanogpt/attn-noscale nanogpt/neg-inf@3 gpt2/backoff+spike gpt2/backoff+spike,no-ckpt nanogpt/grow15% lstm/bf16-rnn --budget-s 80 --json $O/rest.json > $O/rest.txt 2>&1
timeout 115 python benchmarks/realworld/run.py --device cuda --size small --compiled no --cases $MIS --budget-s 105 --json $O/misuse.json > $O/misuse.txt 2>&1
timeout 185 python benchmarks/realworld/run.py --device cuda --size small --compiled yes --cases nanogpt --budget-s 170 > $O/corpus_compiled.txt 2>&1
echo "== corpus rest (not PASS)"; grep "^[a-z0-9_]*/" $O/rest.txt | grep -v "| PASS" | cut -c1-250
echo "== corpus rest"; grep "PASS " $O/rest.txt | tail -1 | cut -c1-60
echo "== misuse (not PASS)"; grep "^[a-z0-9_]*/" $O/misuse.txt | grep -v "| PASS" | cut -c1-250
echo "== misuse"; grep "PASS " $O/misuse.txt | tail -1 | cut -c1-60
echo "== corpus compiled (not PASS)"; grep "^[a-z0-9_]*/" $O/corpus_compiled.txt | grep -v "| PASS" | cut -c1-250
echo "== corpus compiled"; grep "PASS " $O/corpus_compiled.txt | tail -1 | cut -c1-40
