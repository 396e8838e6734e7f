#!/usr/bin/env bash
# cuda-standin: run a command with kvx-cuda-standin (the CPU stand-in for the CUDA driver) as
# the process's libcuda, so kvx-cuda's GPU tests run on a machine without a GPU.
#
#   scripts/cuda-standin.sh cargo test -p kvx-cuda --test gpu
#
# Builds the stand-in (cargo build -p kvx-cuda-standin), links it as libcuda.so under
# target/cuda-standin/ and puts that folder first on LD_LIBRARY_PATH: the dynamic loader then
# hands cudarc the stand-in when it asks for libcuda. KVX_CUDA_REQUIRE_GPU=1 makes a GPU test
# fail instead of skip, so a stand-in that did not load cannot pass silently.
# Never use it on a machine whose real GPU you want to test: it hides the real driver.
set -euo pipefail
cd "$(dirname "$0")/.."
[ "$#" -gt 0 ] || { echo "usage: scripts/cuda-standin.sh COMMAND [ARGS...]" >&2; exit 2; }
cargo build -q -p kvx-cuda-standin
target=${CARGO_TARGET_DIR:-target}
mkdir -p "$target/cuda-standin"
ln -sf "$(realpath "$target/debug/libkvx_cuda_standin.so")" "$target/cuda-standin/libcuda.so"
export LD_LIBRARY_PATH="$(realpath "$target/cuda-standin")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export KVX_CUDA_REQUIRE_GPU=1
exec "$@"
