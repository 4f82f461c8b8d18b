#!/usr/bin/env bash
# The test command (README): set up .venv if needed, then run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q -p no:cacheprovider tests "$@"
