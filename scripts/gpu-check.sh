#!/usr/bin/env bash
# gpu-check: the one command that checks kvx's CUDA path on an NVIDIA machine. It builds the
# kvx-cuda tests, kvx-offload's CUDA-engine scenarios, the `kvx` CLI and the criterion bench,
# runs the CPU and GPU tests (GPU trials must run: KVX_CUDA_REQUIRE_GPU=1 turns a skip into a
# failure; only the trials that need the CPU stand-in's knobs skip on a GPU), `kvx bench cuda`
# and the criterion bench, and prints a short results table last. Among the GPU trials: stores
# and loads ordered after a forward still pending on the engine's own stream (EngineOrder,
# WorkerSide::order_after_engine_stream; the forward is a sleeping cuLaunchHostFunc, then its
# write). Without a GPU, the same
# tests run on the stand-in: scripts/cuda-standin.sh (as CI does).
#
#   scripts/gpu-check.sh              build and run here (needs cargo and the crates)
#   scripts/gpu-check.sh --build DIR  build only and copy the binaries into DIR (any x86-64 Linux)
#   scripts/gpu-check.sh --run DIR    run binaries made by --build (a GPU machine without cargo
#                                     or network: carry DIR there)
#
# A GPU machine with no cargo or network (e.g. one lent by a session's device tool): run
# `--build target/gpu-check/bin` here (about 10 MB of stripped binaries), carry that folder
# there and run `scripts/gpu-check.sh --run target/gpu-check/bin` with KVX_GPU_CHECK_OUT=$OUT.
#
# Logs and the bench JSON go to $KVX_GPU_CHECK_OUT (default target/gpu-check/out).
# Exit status: 0 when every step passed, 1 otherwise.
set -uo pipefail
cd "$(dirname "$0")/.."

mode=all
dir=target/gpu-check/bin
case "${1:-}" in
  --build) mode=build; dir=${2:?usage: gpu-check.sh --build DIR} ;;
  --run) mode=run; dir=${2:?usage: gpu-check.sh --run DIR} ;;
  "") ;;
  *) echo "usage: scripts/gpu-check.sh [--build DIR | --run DIR]" >&2; exit 2 ;;
esac
out=${KVX_GPU_CHECK_OUT:-target/gpu-check/out}

# The path of the executable cargo built for a target, from cargo's "Executable" lines.
exe_of() { # $1: log, $2: target source path (e.g. tests/gpu.rs)
  sed -n "s|^ *Executable $2 (\(.*\))$|\1|p" "$1" | tail -n 1
}

build() {
  mkdir -p "$dir" "$out"
  local log="$out/build.log"
  echo "== build (log: $log)"
  {
    cargo test -p kvx-cuda --no-run &&
      cargo test -p kvx-offload --features cuda --test cuda --no-run &&
      cargo build --release -p kvx-cli &&
      cargo bench -p kvx-benches --bench cuda --no-run
  } >"$log" 2>&1 || { tail -n 40 "$log"; echo "gpu-check: build failed"; exit 1; }
  local unit gpu offload crit
  unit=$(exe_of "$log" "unittests src/lib.rs")
  gpu=$(exe_of "$log" "tests/gpu.rs")
  offload=$(exe_of "$log" "tests/cuda.rs")
  crit=$(exe_of "$log" "benches/cuda.rs")
  for f in "$unit" "$gpu" "$offload" "$crit" target/release/kvx; do
    [ -x "$f" ] || { echo "gpu-check: built binary not found: '$f'"; exit 1; }
  done
  cp "$unit" "$dir/kvx-cuda-unit"
  cp "$gpu" "$dir/kvx-cuda-gpu"
  cp "$offload" "$dir/kvx-offload-cuda"
  cp "$crit" "$dir/cuda-bench"
  cp target/release/kvx "$dir/kvx"
  if command -v strip >/dev/null; then strip "$dir"/* 2>/dev/null || true; fi
  echo "   binaries in $dir: $(du -sh "$dir" | cut -f1)"
}

status=0
declare -a summary
step() { # $1: name, $2: log, rest: command
  local name=$1 log=$2
  shift 2
  echo "== $name (log: $log)"
  "$@" 2>&1 | tee "$log"
  local rc=${PIPESTATUS[0]}
  local res
  res=$(grep -E '^test result:' "$log" | tail -n 1 | sed 's/; finished.*//')
  [ -n "$res" ] || res=$(grep -v '^ *$' "$log" | tail -n 1)
  # Trials that need the CPU stand-in's knobs (or its slow copies) skip on a real GPU: expected.
  if grep '^skip:' "$log" | grep -qv "CUDA stand-in"; then
    summary+=("$(printf '%-14s SKIPPED %s' "$name" "$(grep -m1 '^skip:' "$log")")"); status=1
  elif [ "$rc" -eq 0 ]; then summary+=("$(printf '%-14s ok     %s' "$name" "$res")")
  else summary+=("$(printf '%-14s FAILED (exit %s) %s' "$name" "$rc" "$res")"); status=1; fi
}

run() {
  mkdir -p "$out"
  local device="no nvidia-smi"
  if command -v nvidia-smi >/dev/null; then
    device=$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | head -n 1)
  fi
  echo "== device: $device"
  export KVX_CUDA_REQUIRE_GPU=1
  step "unit tests" "$out/unit.log" "$dir/kvx-cuda-unit"
  # One trial at a time: the deadline and wait tests rely on the copy engine not being shared.
  step "GPU tests" "$out/gpu.log" "$dir/kvx-cuda-gpu" --test-threads=1
  # The connector's host-tier scenarios with engine memory on the GPU (files under TMPDIR).
  step "offload cuda" "$out/offload.log" "$dir/kvx-offload-cuda" --test-threads=1
  step "kvx bench" "$out/bench.log" "$dir/kvx" bench cuda
  "$dir/kvx" bench cuda --json >"$out/bench.json" 2>>"$out/bench.log" || true
  step "criterion" "$out/criterion.log" "$dir/cuda-bench" --bench --warm-up-time 1 --measurement-time 2 --noplot

  echo
  echo "================ gpu-check results ================"
  echo "device: $device"
  printf '%s\n' "${summary[@]}"
  grep -E '^test [a-z0-9_]+ +\.\.\. FAILED|panicked' "$out/gpu.log" "$out/offload.log" || true
  echo "--- kvx bench cuda (kvx vs plain cuMemcpy, same bytes, same run)"
  sed -n '/^kvx bench cuda:/,$p' "$out/bench.log" | grep -v '^kvx bench cuda: no' || true
  echo "--- criterion (time per 64 MiB op; kvx vs plain)"
  grep -E '^cuda/|time:|thrpt:' "$out/criterion.log" | paste - - - 2>/dev/null | sed 's/  */ /g' || true
  if [ "$status" -eq 0 ]; then echo "gpu-check: all passed"; else echo "gpu-check: FAILED"; fi
}

case $mode in
  build) build ;;
  run) run ;;
  all) build; run ;;
esac
exit $status
