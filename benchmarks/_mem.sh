export PYTHONPATH=$PWD
python benchmarks/memory_peak.py --model gpt2 --variants plain,every1,every1-noviews --steps 4 --top 5 2>&1 | grep -v "^ *[+-]0.0" | tail -20
python benchmarks/overhead.py --model gpt2 --device cuda --steps 16 --warmup 3 --variants plain,default,every1 2>&1 | tail -5
