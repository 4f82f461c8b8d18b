import os
import sys
import warnings

# Every model in this suite is tiny: a second intra-op thread buys nothing, and on a busy 2-core machine (CI, or
# pytest beside its own subprocesses) OpenMP's spinning threads make a small op tens of times slower at random
# (measured: 0.4 s -> 11.7 s for the same 1000 steps). One thread for the whole session, and for the `python -m
# ampdoctor` subprocesses the tests launch (setdefault: a caller's own setting wins). Files that already pin one
# thread with scenarios.one_thread keep doing so; nothing a test checks depends on the thread count.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(1)

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
warnings.filterwarnings("ignore", message=".*lr_scheduler.step.*")
