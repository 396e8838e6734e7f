"""kvx's native worker side over CUDA engine memory, on the CPU stand-in for the CUDA driver: no
GPU, no torch, no vLLM.

The stand-in (`cargo build -p kvx-cuda-standin`, or the path in KVX_CUDA_STANDIN) is loaded by
path; its soname is libcuda.so, so kvx's own dlopen("libcuda.so") gets it. The KV "tensor" is
device memory allocated through the stand-in and described as a `cuda:N` tensor, exactly as
kvx.vllm describes a torch tensor. Skipped (with the reason) where the stand-in is not built.
"""

from __future__ import annotations

import ctypes
import json
import os
import time
from pathlib import Path

import pytest

from kvx import SchedulerSide, WorkerSide, block_keys

ROOT = Path(__file__).resolve().parents[3]
STANDIN = Path(os.environ.get("KVX_CUDA_STANDIN", ROOT / "target/debug/libkvx_cuda_standin.so"))
DEVICE = 3  # a stand-in device of its own
BLOCK, KV_HEADS, HEAD, NUM_BLOCKS = 16, 2, 32, 8
SMALL = json.dumps({"host_blocks": 4, "timeouts": {"load_ms": 2000, "store_ms": 2000}})


@pytest.fixture(scope="module")
def cuda() -> ctypes.CDLL:
    if not STANDIN.exists():
        pytest.skip(f"the CUDA stand-in is not built ({STANDIN}): cargo build -p kvx-cuda-standin")
    lib = ctypes.CDLL(str(STANDIN), mode=ctypes.RTLD_GLOBAL)
    lib.cuMemcpyHtoD_v2.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t]
    lib.cuMemcpyDtoH_v2.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t]
    ctx = ctypes.c_void_p()
    assert lib.cuInit(0) == 0
    assert lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), DEVICE) == 0
    assert lib.cuCtxSetCurrent(ctx) == 0
    return lib


def test_a_cuda_kv_cache_stores_and_loads_back_byte_exact(cuda: ctypes.CDLL) -> None:
    elems = 2 * NUM_BLOCKS * BLOCK * KV_HEADS * HEAD
    shape = [2, NUM_BLOCKS, BLOCK, KV_HEADS, HEAD]
    strides = [NUM_BLOCKS * BLOCK * KV_HEADS * HEAD, BLOCK * KV_HEADS * HEAD, KV_HEADS * HEAD, HEAD, 1]
    ptr = ctypes.c_uint64()
    assert cuda.cuMemAlloc_v2(ctypes.byref(ptr), elems * 2) == 0
    data = (ctypes.c_int16 * elems)(*[(i * 7) % 30011 for i in range(elems)])
    assert cuda.cuMemcpyHtoD_v2(ptr.value, ctypes.addressof(data), elems * 2) == 0
    desc = ("layer0", ptr.value, shape, strides, 2, f"cuda:{DEVICE}")
    sched = SchedulerSide(SMALL, BLOCK)
    worker = WorkerSide(SMALL, BLOCK, [desc], [], NUM_BLOCKS)
    try:
        keys = block_keys(b"cuda", [b"block0", b"block1"])
        assert sched.save_blocks(1, keys, [0, 1])
        end = time.monotonic() + 10
        while sched.tier_sizes()[0] < 2 or sched.job_count() > 0:
            assert time.monotonic() < end, "the device blocks never reached the host tier"
            worker.start_step(sched.build_meta([])[0])
            jobs = worker.get_finished()[3]
            if jobs:
                sched.update_from_worker(jobs)
            time.sleep(0.001)
        assert sched.get_num_new_matched_tokens(2, keys, 0) == (2 * BLOCK, 2, 0)
        sched.update_state_after_alloc(2, [5, 6])
        done: list[int] = []
        while 2 not in done:
            assert time.monotonic() < end, "the load into device blocks never finished"
            worker.start_step(sched.build_meta([])[0])
            _, recving, invalid, jobs, _ = worker.get_finished()
            assert invalid == []
            done += recving
            if jobs:
                sched.update_from_worker(jobs)
            time.sleep(0.001)
    finally:
        worker.close()
    back = (ctypes.c_int16 * elems)()
    assert cuda.cuMemcpyDtoH_v2(ctypes.addressof(back), ptr.value, elems * 2) == 0
    per_block = BLOCK * KV_HEADS * HEAD
    for kv in range(2):
        for src, dst in ((0, 5), (1, 6)):
            s = (kv * NUM_BLOCKS + src) * per_block
            d = (kv * NUM_BLOCKS + dst) * per_block
            assert back[d : d + per_block] == data[s : s + per_block], f"block {dst} (kv {kv})"
    assert back[: per_block * 5] == data[: per_block * 5], "blocks outside the load changed"
