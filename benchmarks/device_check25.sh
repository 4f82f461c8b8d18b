#!/usr/bin/env bash
# Twenty-fifth session (nvidia-h200), third call: the default watch's host time by entry point on the nanoGPT-style
# step (benchmarks/entry_cost.py, new: perf_counter self times, no profiler), fp16 and bf16, and GPT-2 small fp16.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
O=${OUT:-/tmp}
timeout 100 python benchmarks/entry_cost.py --model nanogpt --device cuda --steps 300 > $O/entry_nano.txt 2>&1
timeout 100 python benchmarks/entry_cost.py --model nanogpt --device cuda --amp bf16 --steps 300 > $O/entry_nano_bf16.txt 2>&1
timeout 120 python benchmarks/entry_cost.py --model gpt2 --device cuda --steps 60 > $O/entry_gpt2.txt 2>&1
for f in entry_nano entry_nano_bf16 entry_gpt2; do echo "== $f"; tail -28 $O/$f.txt | cut -c1-160; done
