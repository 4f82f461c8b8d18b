#!/usr/bin/env bash
# Thirty-ninth session. `bash device_check39.sh 1`: the eager real-code corpus and the GAN container (as
# device_check38.sh 1). `bash device_check39.sh 2`: the CUDA-only tests (the fused statistics), the
# host-work windows of the nanoGPT-style step (window_probe.py), compiled nanoGPT and the
# overhead (as device_check38.sh 2). Short tables last.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
O=${OUT:-/tmp}
if [ "${1:-1}" = 1 ]; then
  bash benchmarks/device_check38.sh 1
else
  timeout 120 python -m pytest -q -p no:cacheprovider tests/test_fused.py > $O/tests.txt 2>&1
  timeout 150 python benchmarks/window_probe.py --model nanogpt --device cuda --spin 300 --steps 80 > $O/window.txt 2>&1
  bash benchmarks/device_check38.sh 2
  echo "== CUDA tests"; tail -4 $O/tests.txt | cut -c1-300
  echo "== windows (spin 300 us)"; tail -7 $O/window.txt
fi
