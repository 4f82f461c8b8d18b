#!/usr/bin/env bash
# Twenty-third session (nvidia-h200): the loop-misuse cases on every model (clip-scaled, no-update, update-first,
# half) at the session's last code change, after the capture/replay changes. Logs go to $OUT; the table prints last.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
O=${OUT:-/tmp}
MIS=$(for m in nanogpt gpt2 llama t5 bert resnet vit unet lstm vae moe clip convnext wav2vec gcn; do for mu in clip-scaled no-update update-first half; do echo -n "$m/$mu "; done; done)
timeout 300 python benchmarks/realworld/run.py --device cuda --size small --compiled no --cases $MIS --budget-s 280 --json $O/misuse.json > $O/misuse.txt 2>&1
echo "== misuse (not PASS)"; grep "^[a-z0-9_]*/" $O/misuse.txt | grep -v "| PASS" | cut -c1-250
echo "== misuse"; grep "PASS " $O/misuse.txt | tail -1 | cut -c1-60
