#!/usr/bin/env bash
# Twenty-first session (nvidia-h200): the real-code corpus with zoo.py's six new architectures (ViT, diffusion UNet,
# LSTM LM, VAE, top-2 MoE, CLIP-style: healthy fp16/bf16 + a spike each) and the replay changes (overflow with NaN
# beside it; an unreached eps on a healthy batch is info), eager at size small, then the compiled nanoGPT cases.
# Logs go to $OUT; the short table prints last. ~8.5 minutes.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
O=${OUT:-/tmp}
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
timeout 430 python benchmarks/realworld/run.py --device cuda --size small --compiled no --budget-s 400 --json $O/corpus.json > $O/corpus.txt 2>&1
timeout 80 python benchmarks/realworld/run.py --device cuda --size small --compiled yes --cases nanogpt --budget-s 60 > $O/corpus_compiled.txt 2>&1
echo "== corpus (not PASS)"; grep "^[a-z0-9_]*/" $O/corpus.txt | grep -v "| PASS" | cut -c1-250
echo "== corpus"; grep "PASS " $O/corpus.txt | tail -2 | cut -c1-60
echo "== corpus compiled"; grep "PASS " $O/corpus_compiled.txt | tail -1 | cut -c1-40
