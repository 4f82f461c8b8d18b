"""Issue 15's next lever, measured: the default watch with a smaller headroom budget (`headroom_budget`, default
0.02) on the real-code corpus's early-warning and healthy nanoGPT cases, then its overhead on the nanoGPT-style step,
beside the default budget. Every `ampdoctor.watch` the corpus and the benchmark make gets the budget given here.

    python benchmarks/budget_lever.py --budget 0.01 [--cases nanogpt/grow15% ...] [--steps 60]

Prints the corpus table, then the overhead table (plain, the default budget, the one given), last.
"""
from __future__ import annotations

import argparse
import os
import runpy
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import ampdoctor  # noqa: E402
from ampdoctor.config import WatchConfig  # noqa: E402


def _with_budget(watch, budget: float):
    """`ampdoctor.watch` whose config has `headroom_budget=budget` (and the caller's every=, if any)."""
    def wrapped(*args, every=None, config=None, **kwargs):
        if config is None:
            config = WatchConfig(headroom_budget=budget, **({} if every is None else {"every": every}))
            every = None
        return watch(*args, every=every, config=config, **kwargs)
    return wrapped


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--budget", type=float, default=0.01)
    p.add_argument("--cases", nargs="*", default=["nanogpt/grow15%", "nanogpt/lr=0.05,nowarmup", "nanogpt/healthy"])
    p.add_argument("--device", default="cuda")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--what", default="corpus,overhead")
    a = p.parse_args()
    here = os.path.dirname(os.path.abspath(__file__))
    watch = ampdoctor.watch
    if "corpus" in a.what:
        ampdoctor.watch = _with_budget(watch, a.budget)
        sys.argv = ["run.py", "--device", a.device, "--size", "small", "--compiled", "no", "--cases", *a.cases]
        try:
            runpy.run_path(os.path.join(here, "realworld", "run.py"), run_name="__main__")
        except SystemExit:
            pass
    if "overhead" in a.what:
        from benchmarks import overhead
        from benchmarks.overhead import Variant
        install = Variant.install

        def install_with_budget(self):
            if self.name == "headroom":  # (the variant name reused: the default watch at the given budget)
                ampdoctor.watch = _with_budget(watch, a.budget)
                self.name = "default"
                try:
                    return install(self)
                finally:
                    ampdoctor.watch = watch
                    self.name = "headroom"
            ampdoctor.watch = watch
            return install(self)
        Variant.install = install_with_budget
        print(f"(the 'headroom' row below is the default watch with headroom_budget={a.budget})")
        sys.argv = ["overhead.py", "--model", "nanogpt", "--device", a.device, "--variants", "plain,default,headroom",
                    "--steps", str(a.steps)]
        overhead.main()


if __name__ == "__main__":
    main()
