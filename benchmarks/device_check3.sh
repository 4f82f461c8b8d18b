#!/usr/bin/env bash
# Device run (nvidia-h200-x2): DDP and FSDP2 tests over NCCL on 2 GPUs, fused-stats equality, where every=1's
# extra peak memory is allocated, and the GPT-2 overhead table. Results go to benchmarks/RESULTS.md by hand.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'gpus', torch.cuda.device_count())"
AMPDOCTOR_TEST_BACKEND=nccl python -m pytest -q -p no:cacheprovider tests/test_distributed.py tests/test_fsdp.py 2>&1 | tail -15
python -m pytest -q -p no:cacheprovider tests/test_fused.py 2>&1 | tail -2
python benchmarks/memory_peak.py --model gpt2 --variants plain,every1 --steps 6 2>&1 | tail -40
python benchmarks/overhead.py --model gpt2 --device cuda --steps 16 --warmup 3 --variants plain,default,every1 2>&1 | tail -7
