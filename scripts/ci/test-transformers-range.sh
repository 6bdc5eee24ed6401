#!/usr/bin/env bash
# The core suite under the transformers floor that pyproject.toml declares ("transformers>=X,<6"):
# X is read from pyproject.toml and installed exactly, so the declared range stays a tested one.
# (The newest release is covered by scripts/ci/test-install.sh; transformers APIs that changed inside
# the range go through src/grpo_parts/compat.py.)
# Usage: bash scripts/ci/test-transformers-range.sh [extra pytest args]. VENV overrides the venv path
# (.venvs/floor). Creates the venv on first use or when the floor changed (~2 min of installs),
# reuses it afterwards.
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV="${VENV:-.venvs/floor}"
FLOOR=$(python3 - <<'EOF'
import re, sys
m = re.search(r'"transformers>=([0-9][0-9.]*),<[0-9][^"]*"', open("pyproject.toml").read())
if not m:
    sys.exit('pyproject.toml: no "transformers>=X,<Y" dependency')
print(m.group(1))
EOF
)
# good = the floor exactly, this checkout's grpo_parts (editable) and the test tools importable
good() {
    [ -x "$VENV/bin/python" ] && "$VENV/bin/python" - "$FLOOR" "$PWD/src" 2>/dev/null <<'EOF'
import sys
import transformers, grpo_parts, pytest, pytest_timeout, hypothesis, scipy, matplotlib  # noqa: F401
floor, src = sys.argv[1], sys.argv[2]
sys.exit(transformers.__version__ != floor or not grpo_parts.__file__.startswith(src))
EOF
}
if ! good; then
    echo "== creating $VENV with transformers==$FLOOR"
    rm -rf "$VENV"
    python3 -m venv "$VENV"
    PIP="$VENV/bin/python -m pip"
    $PIP install -q --upgrade pip
    $PIP install -q torch==2.13.0  # the CPU wheel first, so nothing pulls a CUDA build
    $PIP install -q -e . "transformers==$FLOOR" pytest pytest-timeout hypothesis scipy matplotlib
    good || { echo "test-transformers-range: $VENV is not usable after install" >&2; exit 1; }
fi
echo "== core suite under transformers $FLOOR ($VENV)"
# -p no:cacheprovider: the repo's .pytest_cache belongs to the main venv's runs.
exec "$VENV/bin/python" -m pytest tests -q -p no:cacheprovider -m "not slow and not gpu and not frameworks" \
    --ignore=tests/adapters "$@"
