#!/usr/bin/env bash
# Twenty-seventh session (nvidia-h200), the second call after device_check26.sh (eager corpus) on the same tree: entry
# modules (a container whose forward the loop never calls: benchmarks/cuda_entries.py), the loop-misuse cases on every
# model (the optimizer-step nesting and stand-in optimizer changes in record/monitorsink.py) and the compiled nanoGPT
# cases. Logs go to $OUT; the short table prints last. ~5.5 minutes.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
O=${OUT:-/tmp}
MIS=$(for m in nanogpt gpt2 llama t5 bert resnet vit unet lstm vae moe clip convnext wav2vec gcn; do for mu in clip-scaled no-update update-first half; do echo -n "$m/$mu "; done; done)
timeout 60 python benchmarks/cuda_entries.py > $O/entries.txt 2>&1
timeout 115 python benchmarks/realworld/run.py --device cuda --size small --compiled no --cases $MIS --budget-s 105 --json $O/misuse.json > $O/misuse.txt 2>&1
timeout 185 python benchmarks/realworld/run.py --device cuda --size small --compiled yes --cases nanogpt --budget-s 170 > $O/corpus_compiled.txt 2>&1
echo "== misuse (not PASS)"; grep "^[a-z0-9_]*/" $O/misuse.txt | grep -v "| PASS" | cut -c1-250
echo "== misuse"; grep "PASS " $O/misuse.txt | tail -1 | cut -c1-60
echo "== corpus compiled (not PASS)"; grep "^[a-z0-9_]*/" $O/corpus_compiled.txt | grep -v "| PASS" | cut -c1-250
echo "== corpus compiled"; grep "PASS " $O/corpus_compiled.txt | tail -1 | cut -c1-40
echo "== entry modules"; tail -5 $O/entries.txt
