#!/usr/bin/env bash
# The test command (README.md): lint, unit and drift tests, then the end-to-end matrix on real vLLM CPU builds.
#   bash scripts/test.sh            # everything
#   E2E=0 bash scripts/test.sh      # skip the end-to-end matrix (minutes per vLLM release)
#   E2E_PRESET=full bash scripts/test.sh   # the full speculators x vLLM matrix instead of CI's subset
#   INSTALL=0 bash scripts/test.sh  # only say what is missing instead of installing it
# It first makes sure that this checkout is installed (editable) with its test requirements, the `test` extra of
# pyproject.toml: if not, it runs `python3 -m pip install -e ".[test]"` into the environment of `python3`.
# The drift tests read real vLLM wheels: the first run downloads about 5.7 GB of them into $VLLM_COMPAT_CACHE
# (default ~/.cache/vllm-compat/wheels), later runs reuse them.
set -uo pipefail
cd "$(dirname "$0")/.."

# Exit 0 when the environment is ready, else 1, printing what is missing. Run from / so that the checkout's own
# folders do not shadow the installed copy.
check_requirements() {
  local root=$PWD
  (cd / && python3 - "$root" <<'EOF'
import sys
from importlib import metadata
from pathlib import Path

root = Path(sys.argv[1]).resolve()
try:
    from packaging.requirements import Requirement
    import vllm_compat.adapters
except ImportError as exc:
    sys.exit(f"vllm-compat is not installed ({exc})")
if root / "adapters" != Path(vllm_compat.adapters.__file__).resolve().parent:
    sys.exit(f"the vllm-compat installed is not this checkout's editable install ({vllm_compat.adapters.__file__})")
try:
    import tomllib
    wanted = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]["test"]
except ImportError:  # Python 3.10: the installed metadata's copy of the extra
    wanted = [r for r in metadata.requires("vllm-compat") or [] if Requirement(r).marker
              and Requirement(r).marker.evaluate({"extra": "test"})]
problems = []
for text in wanted:
    req = Requirement(text)
    try:
        have = metadata.version(req.name)
    except metadata.PackageNotFoundError:
        problems.append(f"{req.name} is not installed")
        continue
    if not req.specifier.contains(have, prereleases=True):
        problems.append(f"{req.name} {have} does not satisfy {req}")
sys.exit("; ".join(problems) or None)
EOF
  )
}

if ! missing=$(check_requirements 2>&1); then
  echo "scripts/test.sh: ${missing##*$'\n'}" >&2
  if [ "${INSTALL:-1}" = "0" ]; then
    echo "scripts/test.sh: run: python3 -m pip install -e \".[test]\"" >&2
    exit 2
  fi
  echo "scripts/test.sh: installing this checkout with its test requirements: python3 -m pip install -e \".[test]\"" >&2
  python3 -m pip install --quiet --disable-pip-version-check -e ".[test]" || {
    echo "scripts/test.sh: the install failed; run the command above in the environment you test in" >&2
    exit 2
  }
fi

status=0
python3 -m ruff check . || status=1
python3 -m pytest tests/unit tests/drift -q -p no:cacheprovider || status=1
if [ "${E2E:-1}" != "0" ]; then
  python3 scripts/e2e_matrix.py --preset "${E2E_PRESET:-ci}" --report "${E2E_REPORT:-/tmp/vllm-compat-e2e-matrix.json}" || status=1
fi
exit $status
