#!/usr/bin/env bash
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
python -m pytest -q -p no:cacheprovider tests/test_fused.py 2>&1 | tail -3
python benchmarks/overhead.py --model gpt2 --device cuda --steps 16 --warmup 3 --variants plain,default,every1 2>&1 | tail -7
