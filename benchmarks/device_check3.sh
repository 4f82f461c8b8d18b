#!/usr/bin/env bash
# One device-machine call (nvidia-h200-x2): DDP and FSDP2 tests over NCCL on 2 GPUs, fused-vs-eager equality,
# CUDA sanity cases (real fp16 numerics), CUDA bitwise identity, where every=1's extra peak memory goes, and the
# GPT-2 / conv-net overhead tables.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'gpus', torch.cuda.device_count())"
AMPDOCTOR_TEST_BACKEND=nccl python -m pytest -q -p no:cacheprovider tests/test_distributed.py tests/test_fsdp.py 2>&1 | tail -2
python -m pytest -q -p no:cacheprovider tests/test_fused.py 2>&1 | tail -1
python benchmarks/cuda_sanity.py 2>&1 | tail -6
python benchmarks/overhead.py --bitwise --device cuda 2>&1 | tail -4
python benchmarks/memory_peak.py --model gpt2 --variants plain,every1 --steps 4 2>&1 | grep -A3 "^variant"
python benchmarks/overhead.py --model convnet --device cuda --steps 20 --warmup 4 --variants plain,default,every1,anomaly 2>&1 | tail -6
python benchmarks/overhead.py --model gpt2 --device cuda --steps 16 --warmup 3 --variants plain,default,every1 2>&1 | tail -5
