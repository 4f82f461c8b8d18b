#!/usr/bin/env bash
# The test command (README): set up .venv if needed, then run the whole suite on two worker processes
# (pytest-xdist; CI's machine has 2 cores, and each test pins torch to one intra-op thread, tests/conftest.py).
# Extra arguments go to pytest (`-n 0` runs it in one process).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q -p no:cacheprovider -n "${AMPDOCTOR_TEST_WORKERS:-2}" tests "$@"
