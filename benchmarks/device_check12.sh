#!/usr/bin/env bash
# Twenty-second session (nvidia-h200): the corpus after the session's changes (fp16_master_weights an error where
# an Adam eps vanishes on the fp16 weights; the replay of a step whose loss went bad beside finite outputs; the
# tensors of a torch.distributions output) -- the eager corpus, then the new loop-misuse cases (clip-scaled,
# no-update, update-first, half) on every model. Logs go to $OUT; the short table prints last. ~9.5 minutes.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
O=${OUT:-/tmp}
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
MIS=$(for m in nanogpt gpt2 llama t5 bert resnet vit unet lstm vae moe clip convnext wav2vec gcn; do for mu in clip-scaled no-update update-first half; do echo -n "$m/$mu "; done; done)
NOTMIS=$(python -c "
from benchmarks.realworld.cases import all_cases
print(' '.join(c.name for c in all_cases() if c.name.split('/')[1] not in ('clip-scaled','no-update','update-first','half')))" | tr ' ' '\n' | sort -u | tr '\n' ' ')
timeout 345 python benchmarks/realworld/run.py --device cuda --size small --compiled no --cases $NOTMIS --budget-s 320 --json $O/corpus.json > $O/corpus.txt 2>&1
timeout 200 python benchmarks/realworld/run.py --device cuda --size small --compiled no --cases $MIS --budget-s 180 --json $O/misuse.json > $O/misuse.txt 2>&1
echo "== corpus (not PASS)"; grep "^[a-z0-9_]*/" $O/corpus.txt | grep -v "| PASS" | cut -c1-250
echo "== corpus"; grep "PASS " $O/corpus.txt | tail -1 | cut -c1-60
echo "== misuse (not PASS)"; grep "^[a-z0-9_]*/" $O/misuse.txt | grep -v "| PASS" | cut -c1-250
echo "== misuse"; grep "PASS " $O/misuse.txt | tail -1 | cut -c1-60
