"""How fast the command answers before any work: `ampdoctor --help`, a usage error, `report --help`; and what
`import ampdoctor` costs (torch must not be imported until `watch` is used). Target: `--help` under 1 s.

    python benchmarks/cli_startup.py [--repeat 7]
"""
import argparse
import statistics
import subprocess
import sys
import time


def timed(args: list[str], repeat: int) -> tuple[float, int]:
    ts, rc = [], 0
    for _ in range(repeat):
        t = time.perf_counter()
        rc = subprocess.run([sys.executable, *args], capture_output=True).returncode
        ts.append(time.perf_counter() - t)
    return statistics.median(ts), rc


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--repeat", type=int, default=7)
    a = p.parse_args()
    base, _ = timed(["-c", "pass"], a.repeat)
    print(f"python -c pass                        {base:6.3f} s (interpreter start)")
    for label, args in [("ampdoctor --help", ["-m", "ampdoctor", "--help"]),
                        ("ampdoctor report --help", ["-m", "ampdoctor", "report", "--help"]),
                        ("ampdoctor (no command, exit 2)", ["-m", "ampdoctor"]),
                        ("python -c 'import ampdoctor'", ["-c", "import ampdoctor, sys; "
                                                          "assert 'torch' not in sys.modules"]),
                        ("python -c 'import torch'", ["-c", "import torch"])]:
        t, rc = timed(args, a.repeat)
        print(f"{label:<37} {t:6.3f} s (exit {rc})")


if __name__ == "__main__":
    main()
