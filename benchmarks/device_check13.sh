#!/usr/bin/env bash
# Twenty-second session, call 3 (nvidia-h200): the final commit's rank of fp16_master_weights after the vanished eps,
# on every model's pure-fp16 case, with the spike cases beside them (the replay change). ~3 minutes.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
O=${OUT:-/tmp}
python -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
CASES=$(for m in gpt2 llama t5 bert resnet vit unet lstm vae moe clip convnext wav2vec gcn; do echo -n "$m/half $m/spike@3 "; done)
timeout 300 python benchmarks/realworld/run.py --device cuda --size small --compiled no --cases $CASES --budget-s 280 --json $O/final.json > $O/final.txt 2>&1
echo "== not PASS"; grep "^[a-z0-9_]*/" $O/final.txt | grep -v "| PASS" | cut -c1-250
echo "== half top3"; grep "^[a-z0-9_]*/half" $O/final.txt | cut -c1-22,60-150
grep "PASS " $O/final.txt | tail -1 | cut -c1-40
