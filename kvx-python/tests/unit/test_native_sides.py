"""kvx's native connector sides driven directly, over a ctypes buffer: no vLLM, no torch."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import time

import pytest

from kvx import KvxError, SchedulerSide, WorkerSide, block_keys

BLOCK = 16
KV_HEADS = 2
HEAD = 32
SMALL = json.dumps({"host_blocks": 4, "timeouts": {"load_ms": 1000, "store_ms": 1000}})


def kv_tensor(num_blocks: int) -> tuple[tuple, ctypes.Array]:
    """A (2, num_blocks, BLOCK, KV_HEADS, HEAD) int16 CPU tensor's description, and its memory."""
    shape = [2, num_blocks, BLOCK, KV_HEADS, HEAD]
    strides = [num_blocks * BLOCK * KV_HEADS * HEAD, BLOCK * KV_HEADS * HEAD, KV_HEADS * HEAD, HEAD, 1]
    buf = (ctypes.c_int16 * (2 * num_blocks * BLOCK * KV_HEADS * HEAD))()
    return ("layer0", ctypes.addressof(buf), shape, strides, 2, "cpu"), buf


def test_cuda_tensor_without_a_driver_is_a_clear_error() -> None:
    # In a process of its own: once another test loaded the CUDA stand-in (its soname is
    # libcuda.so), every later dlopen of libcuda in this process finds it.
    (_, _, shape, strides, _, _), _ = kv_tensor(8)
    code = f"""
import ctypes, sys
try:
    ctypes.CDLL("libcuda.so")
    print("skip: a CUDA driver is loadable here"); sys.exit(3)
except OSError:
    pass
from kvx import WorkerSide
try:
    WorkerSide({SMALL!r}, {BLOCK}, [("layer0", 0x7F0000000000, {shape!r}, {strides!r}, 2, "cuda:0")], [], 8)
except ValueError as e:
    print(e); sys.exit(0 if "CUDA KV cache on device 0: no CUDA" in str(e) else 1)
sys.exit(2)
"""
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    r = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, env=env, timeout=60)
    if r.returncode == 3:
        pytest.skip("a CUDA driver is loadable here (the no-driver error cannot be shown)")
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr)


def test_malformed_step_metadata_is_an_error_not_a_crash() -> None:
    desc, buf = kv_tensor(8)
    w = WorkerSide(SMALL, BLOCK, [desc], [buf], 8)
    try:
        for bad in (b"", b"\x07", b"\x01\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff", b"\x01" + bytes(40)):
            with pytest.raises(KvxError):
                w.start_step(bad)
        assert w.in_flight() == 0
    finally:
        w.close()
    with pytest.raises(KvxError):
        w.start_step(b"\x01")


def test_a_stored_block_is_found_in_the_host_tier() -> None:
    desc, buf = kv_tensor(8)
    sched = SchedulerSide(SMALL, BLOCK)
    worker = WorkerSide(SMALL, BLOCK, [desc], [buf], 8)
    try:
        keys = block_keys(b"unit", [b"block0", b"block1"])
        assert sched.save_blocks(1, keys, [0, 1])
        # Engine steps: the store is planned, submitted, and its outcome reported back.
        end = time.monotonic() + 10
        while sched.tier_sizes()[0] < 2 or sched.job_count() > 0:
            assert time.monotonic() < end, "the store never reached the host tier"
            step, loads, _ = sched.build_meta([])
            assert loads == []
            worker.start_step(step)
            jobs = worker.get_finished()[3]
            if jobs:
                sched.update_from_worker(jobs)
            time.sleep(0.001)
        found = sched.get_num_new_matched_tokens(2, keys, 0)
        assert found == (2 * BLOCK, 2, 0)
        assert sched.tier_sizes() == (2, 0)
        assert not sched.request_finished(1)
    finally:
        worker.close()
