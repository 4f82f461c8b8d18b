export PYTHONPATH=$PWD
python benchmarks/memory_peak.py --model gpt2 --variants plain,every1,every1-noviews,every1-nogradhooks,every1-gc --steps 5 --top 8 2>&1 | tail -60
