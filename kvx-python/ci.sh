#!/usr/bin/env bash
# Build the `kvx` wheel, install it with vllm 0.32.0 into a venv, and run the Python tests
# (vLLM's real scheduler on CPU; no GPU needed). Run from the repository root:
#
#   bash kvx-python/ci.sh
#
# KVX_VENV: the venv to create or reuse (default kvx-python/.venv, ignored by git).
# PYTHON:   the interpreter that creates it (default python3; CPython >= 3.10).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
venv="${KVX_VENV:-$root/kvx-python/.venv}"
python="${PYTHON:-python3}"
start=$(date +%s)
stamp() { echo "ci.sh: $1 at +$(($(date +%s) - start))s"; }

"$python" - <<'EOF'
import sys
if sys.implementation.name != "cpython" or sys.version_info < (3, 10):
    sys.exit(f"ci.sh: kvx needs CPython >= 3.10, found {sys.implementation.name} {sys.version.split()[0]}")
EOF

if [ ! -x "$venv/bin/python" ]; then
    "$python" -m venv "$venv"
fi
"$venv/bin/python" -m pip install --quiet --upgrade pip
"$venv/bin/python" -m pip install --quiet "vllm==0.32.0" "maturin>=1.5,<2" pytest ruff mypy
stamp "vllm 0.32.0, maturin, pytest, ruff and mypy installed"

# Lint and type-check the package and the unit tests (settings in kvx-python/pyproject.toml).
(cd "$root/kvx-python" && "$venv/bin/ruff" check . && "$venv/bin/mypy")
stamp "ruff and mypy clean"

rm -rf "$root/target/wheels/kvx-"*.whl
# The test wheel: with the FUSE fixture kvx.testing.FrozenMount (cargo feature `testing`).
VIRTUAL_ENV="$venv" "$venv/bin/maturin" build --release --quiet --features testing \
    --manifest-path "$root/kvx-python/Cargo.toml" --interpreter "$venv/bin/python" \
    --out "$root/target/wheels"
"$venv/bin/python" -m pip install --quiet --force-reinstall --no-deps "$root/target/wheels/"kvx-*.whl
stamp "kvx wheel built and installed"

# Import from the installed wheel, not from the source tree.
empty="$(mktemp -d)"
(cd "$empty" && "$venv/bin/python" -c "from kvx.vllm import KvxConnector; print('ci.sh: imported', KvxConnector.__module__)")
rmdir "$empty"

cd "$root/kvx-python"
# tests/unit needs no vLLM; tests/vllm drives vLLM's real scheduler.
"$venv/bin/python" -m pytest tests/unit tests/vllm -q -rs -p no:cacheprovider
stamp "python tests done"
