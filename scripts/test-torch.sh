#!/usr/bin/env bash
# The suite against another torch release (users bring their own): `bash scripts/test-torch.sh 2.11.0 [pytest args]`
# builds .venv-torch<VERSION> with that torch and ampdoctor's test extras, then runs the tests there. Behaviour
# differs between releases where it matters to the hooks (torch 2.11: an autograd node's Python object lives
# only while referenced, so node ids are not stable), which a 2.13-only suite cannot see.
set -euo pipefail
cd "$(dirname "$0")/.."
V=${1:?usage: scripts/test-torch.sh TORCH_VERSION [pytest args]}
shift
PY=${PYTHON:-python3}
ENV=".venv-torch$V"
[ -x "$ENV/bin/python" ] || "$PY" -m venv "$ENV"
"$ENV/bin/python" -m pip install -q "torch==$V"
"$ENV/bin/python" -m pip install -q -e ".[test]" "torch==$V"
exec "$ENV/bin/python" -m pytest -q -p no:cacheprovider tests "$@"
