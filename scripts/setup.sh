#!/usr/bin/env bash
# Create .venv with the CPU build of torch 2.13.0 and ampdoctor (editable) plus its test extras.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
# Pin torch to the CPU wheel first: a bare `torch` requirement could pull a multi-GB CUDA build.
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[test]" "torch==2.13.0"
