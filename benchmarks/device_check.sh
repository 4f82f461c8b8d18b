#!/usr/bin/env bash
# One device-machine call: fused-vs-eager equality, CUDA bitwise identity, GPT-2 small overhead table.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
python -m pytest -q -p no:cacheprovider tests/test_fused.py 2>&1 | tail -5 | tee $OUT/fused.log
python benchmarks/overhead.py --bitwise --device cuda 2>&1 | tail -12 | tee $OUT/bitwise.log
python benchmarks/overhead.py --model gpt2 --device cuda --steps 20 --warmup 4 --variants plain,default,every1 2>&1 | tail -12 | tee $OUT/gpt2.log
