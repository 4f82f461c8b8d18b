#!/usr/bin/env bash
# Thirty-third session. `bash device_check35.sh 1`: where every=1's host time goes on the nanoGPT-style step (cProfile
# dump to $OUT/e1.prof), the default's entry costs there, and GPT-2 small's default overhead in bf16.
# `bash device_check35.sh 2` / `3`: as device_check34.sh 1 / 2 (eager corpus + GAN; compiled, misuse, overhead).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
O=${OUT:-/tmp}
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
case "${1:-1}" in
1)
  timeout 150 python benchmarks/profile_every1.py --model nanogpt --device cuda --every 1 --steps 12 --top 45 --dump $O/e1.prof > $O/e1.txt 2>&1
  timeout 120 python benchmarks/entry_cost.py --model nanogpt --device cuda --steps 120 > $O/entry.txt 2>&1
  timeout 150 python benchmarks/overhead.py --model gpt2 --device cuda --amp bf16 --variants plain,default --steps 14 --warmup 3 > $O/gpt2bf16.txt 2>&1
  echo "== e1"; head -3 $O/e1.txt; echo "== entry"; tail -30 $O/entry.txt | cut -c1-160; echo "== gpt2 bf16"; tail -4 $O/gpt2bf16.txt ;;
2) bash benchmarks/device_check34.sh 1 ;;
3) bash benchmarks/device_check34.sh 2 ;;
esac
