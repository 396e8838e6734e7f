"""kvx's native connector sides driven directly, over a ctypes buffer: no vLLM, no torch."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import time

import pytest

from kvx import KvxError, SchedulerSide, WorkerSide, step_requests

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
    sched = SchedulerSide(SMALL, BLOCK, namespaces=[b"unit"])
    worker = WorkerSide(SMALL, BLOCK, [desc], [buf], 8)
    try:
        hashes = [b"block0", b"block1"]
        assert sched.admit("w") == 1
        assert sched.save_blocks("w", hashes, 0, [0, 1])
        # Engine steps: the store is planned, submitted, and its outcome reported back.
        end = time.monotonic() + 10
        while sched.tier_sizes()[0] < 2 or sched.job_count() > 0:
            assert time.monotonic() < end, "the store never reached the host tier"
            step = sched.build_meta()
            assert step_requests(step)[0] == []
            worker.start_step(step)
            worker.get_finished()
            jobs = worker.take_jobs()
            if jobs:
                sched.update_from_worker(jobs)
            time.sleep(0.001)
        found = sched.get_num_new_matched_tokens("r", hashes, 0, 2 * BLOCK + 1)
        assert found == (2 * BLOCK, True)
        assert sched.hit("r") == (2, 0)
        assert sched.tier_sizes() == (2, 0)
        assert not sched.request_finished("w")
    finally:
        worker.close()


def test_a_load_in_step_has_ended_when_its_step_starts() -> None:
    config = json.dumps({"host_blocks": 4, "host_loads_in_step": True,
                         "timeouts": {"load_ms": 1000, "store_ms": 1000}})
    desc, buf = kv_tensor(8)
    per_block = BLOCK * KV_HEADS * HEAD
    sched = SchedulerSide(config, BLOCK, namespaces=[b"unit"])
    worker = WorkerSide(config, BLOCK, [desc], [buf], 8)
    assert sched.host_loads_in_step and not SchedulerSide(SMALL, BLOCK, namespaces=[b"unit"]).host_loads_in_step
    try:
        for i in range(2 * 8 * per_block):
            buf[i] = i % 30011
        want = [buf[b * per_block + i] for b in (0, 1) for i in range(per_block)]
        hashes = [b"in-step0", b"in-step1"]
        assert sched.admit("w") == 1
        assert sched.save_blocks("w", hashes, 0, [0, 1])
        end = time.monotonic() + 10
        while sched.tier_sizes()[0] < 2 or sched.job_count() > 0:
            assert time.monotonic() < end, "the store never reached the host tier"
            worker.start_step(sched.build_meta())
            worker.get_finished()
            jobs = worker.take_jobs()
            if jobs:
                sched.update_from_worker(jobs)
            time.sleep(0.001)
        # A host-tier hit that leaves a token to compute loads in the step (not asynchronously).
        assert sched.get_num_new_matched_tokens("r", hashes, 0, 2 * BLOCK + 1) == (2 * BLOCK, False)
        assert sched.update_state_after_alloc("r", [[4, 5]], 2 * BLOCK) == [4, 5]
        step = sched.build_meta()
        loads, _, _, in_step, _ = step_requests(step)
        assert (loads, in_step) == ([], [2])
        assert worker.start_step(step) == [], "the load the forward reads ended"
        # Ended: the bytes are in blocks 4 and 5 (first half of the K/V axis), before any
        # get_finished, which then does not report it (vLLM never waits for it).
        got = [buf[b * per_block + i] for b in (4, 5) for i in range(per_block)]
        assert got == want
        assert worker.get_finished() == ([], [], [])
        assert worker.take_invalid() == []
        sched.update_from_worker(worker.take_jobs())
        assert sched.job_count() == 0
        # The same step handed over again is not started again.
        t = time.monotonic()
        assert worker.start_step(step) == []
        assert time.monotonic() - t < 0.5
    finally:
        worker.close()


def test_a_failed_load_in_step_is_reported_once_its_step_started() -> None:
    # The scheduler's index says the host tier holds two blocks; this worker's host tier is
    # empty (another worker stored them): the load fails at once, and its invalid blocks are
    # there for the same step's get_finished.
    config = json.dumps({"host_blocks": 4, "host_loads_in_step": True,
                         "timeouts": {"load_ms": 1000, "store_ms": 1000}})
    desc_a, buf_a = kv_tensor(8)
    desc_b, buf_b = kv_tensor(8)
    sched = SchedulerSide(config, BLOCK, namespaces=[b"unit"])
    storer = WorkerSide(config, BLOCK, [desc_a], [buf_a], 8)
    loader = WorkerSide(config, BLOCK, [desc_b], [buf_b], 8)
    try:
        hashes = [b"other0", b"other1"]
        assert sched.admit("w") == 1
        assert sched.save_blocks("w", hashes, 0, [0, 1])
        end = time.monotonic() + 10
        while sched.tier_sizes()[0] < 2 or sched.job_count() > 0:
            assert time.monotonic() < end, "the store never reached the host tier"
            storer.start_step(sched.build_meta())
            storer.get_finished()
            jobs = storer.take_jobs()
            if jobs:
                sched.update_from_worker(jobs)
            time.sleep(0.001)
        assert sched.get_num_new_matched_tokens("r", hashes, 0, 2 * BLOCK + 1) == (2 * BLOCK, False)
        assert sched.update_state_after_alloc("r", [[4, 5]], 2 * BLOCK)
        assert loader.start_step(sched.build_meta()) == []
        # Not in finished_recving (vLLM never waits for a load in step): its blocks are.
        assert loader.get_finished() == ([], [], [])
        assert loader.take_invalid() == [4, 5]
        assert sched.update_from_worker(loader.take_jobs()) == 1, "one load failed"
        assert sched.job_count() == 0
        # Its blocks are never offered to the request again (vLLM recomputes them).
        assert sched.get_num_new_matched_tokens("r", hashes, 0, 2 * BLOCK + 1) == (0, False)
    finally:
        storer.close()
        loader.close()
