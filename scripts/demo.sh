#!/usr/bin/env bash
# The main job on the embedded fixture: replay fixtures/captures/t5_ffn_overflow and write reports/example/.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ampdoctor replay fixtures/captures/t5_ffn_overflow --model fixtures.models:t5_block \
    --out reports/example --json reports/example/report.json || [ $? -eq 1 ]   # 1 = errors found (expected)
echo "open reports/example/index.html"
