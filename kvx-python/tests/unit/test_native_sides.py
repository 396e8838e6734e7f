"""kvx's native connector sides driven directly, over a ctypes buffer: no vLLM, no torch."""

from __future__ import annotations

import ctypes
import json
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


def test_cuda_tensor_without_a_driver_is_a_clear_error():
    try:
        ctypes.CDLL("libcuda.so")
        pytest.skip("a CUDA driver (or the stand-in) is loadable here")
    except OSError:
        pass
    (_, _, shape, strides, _, _), _ = kv_tensor(8)
    with pytest.raises(ValueError) as e:
        WorkerSide(SMALL, BLOCK, [("layer0", 0x7F0000000000, shape, strides, 2, "cuda:0")], [], 8)
    assert "CUDA KV cache on device 0: no CUDA" in str(e.value)


def test_malformed_step_metadata_is_an_error_not_a_crash():
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


def test_a_stored_block_is_found_in_the_host_tier():
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
