"""kvx's native worker side over CUDA engine memory: stores from device blocks to the host tier,
loads back into other device blocks, byte-exact, with blocks outside the load untouched.

Two sources of device memory run the same scenario:

- the CPU stand-in for the CUDA driver (`cargo build -p kvx-cuda-standin`, or the path in
  KVX_CUDA_STANDIN), loaded by path; its soname is libcuda.so, so kvx's own dlopen("libcuda.so")
  gets it. No GPU, no torch. The KV "tensor" is stand-in device memory described as a `cuda:N`
  tensor, exactly as kvx.vllm describes a torch tensor.
- a real GPU through torch: the KV cache is a torch CUDA tensor (torch's allocator, the device's
  primary context, as vLLM allocates it), written by torch kernels on torch's stream.

Each skips with its reason where its memory is missing; KVX_CUDA_REQUIRE_GPU=1 turns the real-GPU
skip into a failure (scripts/gpu-check.sh sets it). Never run both in one process on a GPU
machine: the stand-in, once loaded, is the process's libcuda.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import threading
import time
from pathlib import Path
from types import ModuleType

import pytest

from kvx import FenceNotHeldError, SchedulerSide, WorkerSide, block_keys, step_requests

from ports import free_port

ROOT = Path(__file__).resolve().parents[3]
STANDIN = Path(os.environ.get("KVX_CUDA_STANDIN", ROOT / "target/debug/libkvx_cuda_standin.so"))
STANDIN_DEVICE = 3  # a stand-in device of its own
BLOCK, KV_HEADS, HEAD, NUM_BLOCKS = 16, 2, 32, 8
SHAPE = [2, NUM_BLOCKS, BLOCK, KV_HEADS, HEAD]
STRIDES = [NUM_BLOCKS * BLOCK * KV_HEADS * HEAD, BLOCK * KV_HEADS * HEAD, KV_HEADS * HEAD, HEAD, 1]
PER_BLOCK = BLOCK * KV_HEADS * HEAD
ELEMS = 2 * NUM_BLOCKS * PER_BLOCK
SMALL = json.dumps({"host_blocks": 4, "timeouts": {"load_ms": 2000, "store_ms": 2000}})
# Blocks 0 and 1 are stored, then loaded into blocks 5 and 6.
MOVES = ((0, 5), (1, 6))


def pattern(i: int) -> int:
    """The int16 written at element i: no two blocks alike."""
    return (i * 7) % 30011


def step_until_stored(sched: SchedulerSide, worker: WorkerSide, blocks: int, end: float) -> None:
    """Step both sides until the host tier holds `blocks` and no job is out (by `end`)."""
    while sched.tier_sizes()[0] < blocks or sched.job_count() > 0:
        assert time.monotonic() < end, "the device blocks never reached the host tier"
        worker.start_step(sched.build_meta())
        worker.get_finished()
        jobs = worker.take_jobs()
        if jobs:
            sched.update_from_worker(jobs)
        time.sleep(0.001)


def step_until_loaded(sched: SchedulerSide, worker: WorkerSide, req: str, end: float) -> None:
    """Step both sides until `req` is reported loaded, with no invalid block (by `end`)."""
    done: list[str] = []
    while req not in done:
        assert time.monotonic() < end, "the load into device blocks never finished"
        worker.start_step(sched.build_meta())
        _, recving, failed = worker.get_finished()
        assert (failed, worker.take_invalid()) == ([], [])
        jobs = worker.take_jobs()
        done += recving
        if jobs:
            sched.update_from_worker(jobs)
        time.sleep(0.001)


def store_then_load(desc: tuple) -> None:
    """Store blocks 0 and 1 of the described KV tensor to the host tier, then load them into
    blocks 5 and 6; every step is driven as vLLM drives the two sides."""
    sched = SchedulerSide(SMALL, BLOCK, namespaces=[b"unit"])
    worker = WorkerSide(SMALL, BLOCK, [desc], [], NUM_BLOCKS)
    try:
        hashes = [b"block0", b"block1"]
        assert sched.admit("w") == 1
        assert sched.save_blocks("w", hashes, 0, [src for src, _ in MOVES])
        end = time.monotonic() + 10
        step_until_stored(sched, worker, 2, end)
        assert sched.get_num_new_matched_tokens("r", hashes, 0, 2 * BLOCK + 1) == (2 * BLOCK, True)
        sched.update_state_after_alloc("r", [[dst for _, dst in MOVES]], 2 * BLOCK)
        step_until_loaded(sched, worker, "r", end)
    finally:
        worker.close()


def check_moved(before: list[int], back: list[int]) -> None:
    """Blocks 5 and 6 of `back` hold blocks 0 and 1 of `before`, K and V; every other block of
    `back` is as in `before`."""
    loaded = dict((dst, src) for src, dst in MOVES)
    for kv in range(2):
        for block in range(NUM_BLOCKS):
            d = (kv * NUM_BLOCKS + block) * PER_BLOCK
            s = (kv * NUM_BLOCKS + loaded.get(block, block)) * PER_BLOCK
            what = "loaded" if block in loaded else "untouched"
            assert back[d : d + PER_BLOCK] == before[s : s + PER_BLOCK], f"{what} block {block} (kv {kv})"


@pytest.fixture(scope="module")
def standin() -> ctypes.CDLL:
    if not STANDIN.exists():
        pytest.skip(f"the CUDA stand-in is not built ({STANDIN}): cargo build -p kvx-cuda-standin")
    if torch_with_a_gpu() is not None:
        pytest.skip("a real GPU is here: the stand-in, once loaded, would hide its driver from this process")
    lib = ctypes.CDLL(str(STANDIN), mode=ctypes.RTLD_GLOBAL)
    lib.cuMemcpyHtoD_v2.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t]
    lib.cuMemcpyDtoH_v2.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t]
    ctx = ctypes.c_void_p()
    assert lib.cuInit(0) == 0
    assert lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), STANDIN_DEVICE) == 0
    assert lib.cuCtxSetCurrent(ctx) == 0
    return lib


def test_a_cuda_kv_cache_on_the_standin_stores_and_loads_back_byte_exact(standin: ctypes.CDLL) -> None:
    ptr = ctypes.c_uint64()
    assert standin.cuMemAlloc_v2(ctypes.byref(ptr), ELEMS * 2) == 0
    data = (ctypes.c_int16 * ELEMS)(*[pattern(i) for i in range(ELEMS)])
    assert standin.cuMemcpyHtoD_v2(ptr.value, ctypes.addressof(data), ELEMS * 2) == 0
    store_then_load(("layer0", ptr.value, SHAPE, STRIDES, 2, f"cuda:{STANDIN_DEVICE}"))
    back = (ctypes.c_int16 * ELEMS)()
    assert standin.cuMemcpyDtoH_v2(ctypes.addressof(back), ptr.value, ELEMS * 2) == 0
    check_moved(list(data), list(back))


HOST_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
FORWARD_S = 0.3  # how long the engine's "forward" keeps its stream busy
BOUND_S = 0.001 + 0.050  # one tick + the project's allowance: calls that never wait


def test_a_store_copies_after_the_forward_queued_on_the_engine_stream(standin: ctypes.CDLL) -> None:
    """vLLM's asynchronous scheduling on a GPU: the next step starts on the CPU while the
    forward that wrote the stored blocks still runs on the engine's stream. With the step
    ordered after that stream, the store copies the forward's bytes, not what the blocks held
    before, and neither call waits for the forward."""
    standin.cuMemcpyHtoDAsync_v2.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    standin.cuLaunchHostFunc.argtypes = [ctypes.c_void_p, HOST_FN, ctypes.c_void_p]
    ptr = ctypes.c_uint64()
    assert standin.cuMemAlloc_v2(ctypes.byref(ptr), ELEMS * 2) == 0
    stale = (ctypes.c_int16 * ELEMS)(*([-1] * ELEMS))
    assert standin.cuMemcpyHtoD_v2(ptr.value, ctypes.addressof(stale), ELEMS * 2) == 0
    # The forward's bytes, from page-aligned registered host memory (an async copy's source).
    page = mmap.mmap(-1, ELEMS * 2)
    fresh = (ctypes.c_int16 * ELEMS).from_buffer(page)
    fresh[:] = [pattern(i) for i in range(ELEMS)]
    assert standin.cuMemHostRegister_v2(ctypes.c_void_p(ctypes.addressof(fresh)), ctypes.c_size_t(ELEMS * 2), 0) == 0
    stream = ctypes.c_void_p()
    assert standin.cuStreamCreate(ctypes.byref(stream), 0) == 0
    forward = HOST_FN(lambda _: time.sleep(FORWARD_S))
    sched = SchedulerSide(SMALL, BLOCK, namespaces=[b"unit"])
    desc = ("layer0", ptr.value, SHAPE, STRIDES, 2, f"cuda:{STANDIN_DEVICE}")
    worker = WorkerSide(SMALL, BLOCK, [desc], [], NUM_BLOCKS)
    try:
        hashes = [b"block0", b"block1"]
        # Step N: the store of blocks 0 and 1 is queued; then its forward is queued on the
        # engine's stream (busy for FORWARD_S, then it writes the blocks' final bytes).
        assert sched.admit("w") == 1
        assert sched.save_blocks("w", hashes, 0, [0, 1])
        worker.order_after_engine_stream(stream.value or 0)
        worker.start_step(sched.build_meta())
        assert standin.cuLaunchHostFunc(stream, forward, None) == 0
        assert standin.cuMemcpyHtoDAsync_v2(ptr.value, ctypes.addressof(fresh), ELEMS * 2, stream) == 0
        # Step N+1 starts at once (the CPU does not wait for the forward): the store goes out.
        t0 = time.monotonic()
        worker.order_after_engine_stream(stream.value or 0)
        worker.start_step(sched.build_meta())
        took = time.monotonic() - t0
        assert took <= BOUND_S, f"ordering and starting the step took {took * 1000:.1f} ms"
        end = time.monotonic() + 10
        step_until_stored(sched, worker, 2, end)
        assert time.monotonic() - t0 >= FORWARD_S * 0.9, "the store ended before the forward did"
        # Load the stored blocks back into blocks 5 and 6: they hold the forward's bytes.
        assert sched.get_num_new_matched_tokens("r", hashes, 0, 2 * BLOCK + 1) == (2 * BLOCK, True)
        sched.update_state_after_alloc("r", [[5, 6]], 2 * BLOCK)
        step_until_loaded(sched, worker, "r", end)
        back = (ctypes.c_int16 * ELEMS)()
        assert standin.cuMemcpyDtoH_v2(ctypes.addressof(back), ptr.value, ELEMS * 2) == 0
        check_moved(list(fresh), list(back))
    finally:
        worker.close()
        standin.cuStreamSynchronize(stream)
        standin.cuStreamDestroy_v2(stream)
        standin.cuMemHostUnregister(ctypes.c_void_p(ctypes.addressof(fresh)))
        del fresh
        page.close()


def standin_sides(standin: ctypes.CDLL, cfg: str) -> tuple[SchedulerSide, WorkerSide]:
    """A scheduler side, and a worker side over a fresh KV "tensor" in stand-in device memory."""
    ptr = ctypes.c_uint64()
    assert standin.cuMemAlloc_v2(ctypes.byref(ptr), ELEMS * 2) == 0
    desc = ("layer0", ptr.value, SHAPE, STRIDES, 2, f"cuda:{STANDIN_DEVICE}")
    return SchedulerSide(cfg, BLOCK, namespaces=[b"unit"]), WorkerSide(cfg, BLOCK, [desc], [], NUM_BLOCKS)


def test_the_worker_answers_while_a_step_waits_for_a_preemption_fence(standin: ctypes.CDLL) -> None:
    """A preempted request whose store is stuck in a hung device copy: the step that fences it
    waits (its blocks may still be read), and meanwhile the worker's other methods, called from
    another thread as a metrics thread would, answer within a tick + 50 ms instead of waiting
    for that fence."""
    sched, worker = standin_sides(standin, SMALL)
    step: threading.Thread | None = None
    try:
        hashes = [b"block0", b"block1"]
        assert sched.admit("w") == 1
        assert sched.save_blocks("w", hashes, 0, [0, 1])
        # Every device copy hangs from now on: the store of request 1 is out, and stuck.
        assert standin.kvx_standin_set_stalled(STANDIN_DEVICE, 1) == 0
        worker.start_step(sched.build_meta())
        sched.request_preempted("w")
        fenced = sched.build_meta()
        outcome: list[BaseException | None] = []

        def fence_step() -> None:
            try:
                worker.start_step(fenced)
                outcome.append(None)
            except BaseException as e:  # handed to the test thread
                outcome.append(e)

        step = threading.Thread(target=fence_step)
        step.start()
        waiting_until = time.monotonic() + 0.5
        slowest = 0.0
        while time.monotonic() < waiting_until:
            t0 = time.monotonic()
            worker.in_flight()
            worker.get_finished()
            worker.stats()
            slowest = max(slowest, time.monotonic() - t0)
            time.sleep(0.01)
        assert step.is_alive(), "the step did not wait for the fence of the stuck store"
        assert slowest <= BOUND_S, f"a call waited {slowest * 1000:.1f} ms for the step's fence"
        assert standin.kvx_standin_set_stalled(STANDIN_DEVICE, 0) == 0
        step.join(10)
        assert outcome == [None], f"the step failed once the copy ended: {outcome}"
    finally:
        standin.kvx_standin_set_stalled(STANDIN_DEVICE, 0)
        if step is not None:
            step.join(10)
        worker.close()


def test_a_preemption_fence_over_a_copy_stuck_past_its_deadline_raises_out_of_the_step(
    standin: ctypes.CDLL,
) -> None:
    """A preempted request whose store hangs in a device copy: the step waits for the fence
    only until the store's deadline (plus a tick), not a whole store deadline from the
    preemption, and then raises FenceNotHeldError (the forward must not overwrite blocks the
    copy may still read); it is never only logged."""
    store_s = 1.5
    cfg = json.dumps({"host_blocks": 4, "timeouts": {"load_ms": 2000, "store_ms": int(store_s * 1000)}})
    sched, worker = standin_sides(standin, cfg)
    try:
        hashes = [b"block0", b"block1"]
        assert sched.admit("w") == 1
        assert sched.save_blocks("w", hashes, 0, [0, 1])
        assert standin.kvx_standin_set_stalled(STANDIN_DEVICE, 1) == 0
        stored_from = time.monotonic()
        worker.start_step(sched.build_meta())  # the store is out, and stuck
        # Most of the store's deadline passes before the engine preempts the request.
        time.sleep(store_s - 0.3)
        sched.request_preempted("w")
        preempted = time.monotonic()
        with pytest.raises(FenceNotHeldError, match="past its deadline"):
            worker.start_step(sched.build_meta())
        raised = time.monotonic()
        assert raised >= stored_from + store_s, "the step gave up before the copy was due"
        # The old bound (a store deadline from the preemption) would be 1.5 s here.
        assert raised - preempted < store_s - 0.5, f"the step waited {raised - preempted:.3f} s after the preemption"
    finally:
        standin.kvx_standin_set_stalled(STANDIN_DEVICE, 0)
        worker.close()


def test_a_remote_load_cut_short_is_not_reported_until_no_copy_can_write_its_blocks(
    standin: ctypes.CDLL,
) -> None:
    """A decode engine's remote load into stand-in device memory whose copy hangs past the load
    deadline: the load's verdict is in, but the request is held back from finished_recving (vLLM
    would free or reuse its blocks at once) until the stalled copy has really ended; then it
    comes out once, with both blocks invalid."""
    # The producer: CPU engine memory, two blocks exported under a lease.
    p_cfg = json.dumps({"host_blocks": 4, "remote": {"listen": f"127.0.0.1:{free_port()}", "lease_ttl_ms": 60000}})
    p_mem = (ctypes.c_int16 * ELEMS)(*[pattern(i) for i in range(ELEMS)])
    p_desc = ("layer0", ctypes.addressof(p_mem), SHAPE, STRIDES, 2, "cpu")
    p_sched = SchedulerSide(p_cfg, BLOCK, namespaces=[b"unit"])
    producer = WorkerSide(p_cfg, BLOCK, [p_desc], [p_mem], NUM_BLOCKS)
    # The consumer: stand-in device memory, a short remote-load deadline.
    d_cfg = json.dumps({"host_blocks": 4, "remote": {"load_ms": 300}})
    d_sched, consumer = standin_sides(standin, d_cfg)
    try:
        keys = block_keys(b"hold-back", [b"block0", b"block1"])
        source = p_sched.export_finished(1, 1, "hold-back", keys, [0, 1])
        producer.start_step(p_sched.build_meta())
        assert d_sched.admit("x") == 1 and d_sched.admit("d") == 2
        d_sched.remote_load(2, source, 0, [5, 6])
        step = d_sched.build_meta()
        assert step_requests(step)[0] == [(2, "d")]
        # Every copy into the device hangs from now on.
        assert standin.kvx_standin_set_stalled(STANDIN_DEVICE, 1) == 0
        consumer.start_step(step)
        # Well past the deadline (300 ms) plus its verdict: the load ended, yet its blocks may
        # still be written by the stalled copy, so vLLM must not hear of it.
        held_until = time.monotonic() + 1.5
        while time.monotonic() < held_until:
            _, recving, _ = consumer.get_finished()
            assert "d" not in recving, "reported while a copy may still write its blocks"
            assert consumer.take_invalid() == [], "its invalid blocks are reported with it, not before"
            time.sleep(0.01)
        assert consumer.in_flight() > 0
        assert standin.kvx_standin_set_stalled(STANDIN_DEVICE, 0) == 0
        end = time.monotonic() + 10
        seen: list[str] = []
        failed: list[str] = []
        bad: list[int] = []
        while "d" not in seen:
            assert time.monotonic() < end, "the load was never reported after the copy ended"
            _, recving, fails = consumer.get_finished()
            seen += recving
            failed += fails
            bad += consumer.take_invalid()
            time.sleep(0.01)
        assert seen == ["d"] and failed == ["d"], "reported exactly once, as failed"
        assert sorted(bad) == [5, 6], "the cut-short load's blocks are invalid"
    finally:
        standin.kvx_standin_set_stalled(STANDIN_DEVICE, 0)
        consumer.close()
        producer.close()


def torch_with_a_gpu() -> ModuleType | None:
    """torch, when it is installed and sees a CUDA device."""
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


def test_a_torch_kv_cache_on_a_real_gpu_stores_and_loads_back_byte_exact() -> None:
    torch = torch_with_a_gpu()
    if torch is None:
        reason = "no GPU: torch is not installed or sees no CUDA device"
        if os.environ.get("KVX_CUDA_REQUIRE_GPU") == "1":
            pytest.fail(f"KVX_CUDA_REQUIRE_GPU=1 but {reason}")
        pytest.skip(reason)
        return
    # Written by a torch kernel on torch's stream, then the step boundary: vLLM's stream is
    # synchronized when the step's sampled tokens reach the host, before the next start_step.
    index = torch.arange(ELEMS, dtype=torch.int64, device="cuda:0")
    kv = ((index * 7) % 30011).to(torch.int16).reshape(SHAPE)
    kv[:, 5:7] = -1  # poisoned destinations: a load that copies nothing cannot pass
    before = kv.flatten().tolist()
    torch.cuda.synchronize()
    assert list(kv.stride()) == STRIDES
    store_then_load(("layer0", kv.data_ptr(), list(kv.shape), list(kv.stride()), kv.element_size(), str(kv.device)))
    check_moved(before, kv.flatten().tolist())
