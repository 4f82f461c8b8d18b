export PYTHONPATH=$PWD
python -m pytest -q -p no:cacheprovider tests/test_fused.py 2>&1 | tail -2
python benchmarks/memory_peak.py --model gpt2 --variants plain,every1,every1-nokernel --steps 8 --no-history 2>&1 | grep median
python benchmarks/overhead.py --model gpt2 --device cuda --steps 16 --warmup 3 --variants plain,default,every1,anomaly,hf 2>&1 | tail -7
