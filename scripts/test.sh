#!/usr/bin/env bash
# The test command (README.md): lint, unit and drift tests, then the end-to-end matrix on real vLLM CPU builds.
#   bash scripts/test.sh            # everything
#   E2E=0 bash scripts/test.sh      # skip the end-to-end matrix (minutes per vLLM release)
#   E2E_PRESET=full bash scripts/test.sh   # the full speculators x vLLM matrix instead of CI's subset
set -uo pipefail
cd "$(dirname "$0")/.."
status=0
python3 -m ruff check . || status=1
python3 -m pytest tests/unit tests/drift -q -p no:cacheprovider || status=1
if [ "${E2E:-1}" != "0" ]; then
  python3 scripts/e2e_matrix.py --preset "${E2E_PRESET:-ci}" --report "${E2E_REPORT:-/tmp/vllm-compat-e2e-matrix.json}" || status=1
fi
exit $status
