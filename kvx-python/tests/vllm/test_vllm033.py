"""What vLLM 0.33 changed for connectors: sleep mode (``unregister_kv_caches`` /
``restore_kv_caches``), the V2 model runner (a preempted request comes back among the new ones),
``update_state_after_alloc`` arriving in a later ``update_from_output``, and ``request_finished``
for a load the connector never saw. The sleep tests run on 0.32 too (its engine never calls the
hooks); the others need 0.33's scheduler and skip, saying so, on 0.32."""

from __future__ import annotations

import pytest
import torch
import vllm
from vllm.v1.request import RequestStatus

from kvx import KvxError
from kvx.vllm import KvxConnectorMetadata

from harness import BLOCK, Engine, prompt

DONE = RequestStatus.FINISHED_LENGTH_CAPPED


def skip(test: str, reason: str) -> None:
    print(f"skip: {test}: {reason}")
    pytest.skip(reason)


def finish_with_store_queued(e: Engine, req_id: str, p: list[int]) -> None:
    """Run ``req_id`` (one output token) until it finished with its store still in flight."""
    delays: list[bool] = []
    inner = e.conn.request_finished
    e.conn.request_finished = lambda r, b: delays.append(inner(r, b)[0]) or (delays[-1], None)
    e.add(req_id, p, max_tokens=1)
    e.run(timeout=5, until=lambda: bool(delays))
    e.conn.request_finished = inner
    assert delays == [True]  # its blocks wait for the store
    assert req_id not in e.send_reported


def sleep(e: Engine) -> None:
    """What vLLM's worker does around sleep: unregister, the KV memory discarded (level 1)."""
    e.worker.unregister_kv_caches()
    e.worker.unregister_kv_caches()  # idempotent
    for t in e.kv.values():
        t.zero_()


def test_sleep_and_wake_serve_blocks_stored_before(tmp_path):
    e = Engine(tmp_path, {"host_blocks": 32}, layouts=["LBNHC"])
    try:
        p = prompt(90, 4 * BLOCK + 5)
        # The store of "a" is still queued when the engine goes to sleep: the fence copies it
        # while the memory still holds it.
        finish_with_store_queued(e, "a", p)
        sleep(e)
        with pytest.raises(KvxError) as err:
            e.worker._worker.start(KvxConnectorMetadata(b""))
        assert "unregister_kv_caches" in str(err.value)
        e.worker.restore_kv_caches()
        e.worker.restore_kv_caches()  # idempotent
        e.run()
        assert e.send_reported == ["a"]
        assert e.worker.stats()["host_blocks"] == 4
        t = e.add("b", p)
        e.run()
        assert e.conn.stats()["host_hit_blocks"] == 4
        assert e.verified_blocks == 4 and t.finished_status == DONE
        assert e.invalid_reported == []
        assert e.idle(), e.state()
    finally:
        e.close()


def test_wake_at_other_addresses_is_an_error_naming_the_tensor(tmp_path):
    e = Engine(tmp_path, {"host_blocks": 32})
    try:
        p = prompt(91, 3 * BLOCK + 2)
        e.add("a", p)
        e.run()
        e.worker.unregister_kv_caches()
        for t in e.kv.values():
            t.set_(torch.zeros_like(t))  # the cache comes back elsewhere
        with pytest.raises(KvxError) as err:
            e.worker.restore_kv_caches()
        assert "'layer0' moved during sleep" in str(err.value), str(err.value)
        # Still unregistered: no step touches memory kvx no longer describes.
        with pytest.raises(KvxError):
            e.worker._worker.start(KvxConnectorMetadata(b""))
    finally:
        e.close()


def test_v2_model_runner_resumes_a_preempted_request_as_new(tmp_path):
    e = Engine(tmp_path, {"host_blocks": 64}, num_blocks=17, max_batched_tokens=256)
    try:
        if not getattr(e.vllm_config, "use_v2_model_runner", False):
            reason = f"vLLM {vllm.__version__} runs the V1 model runner here"
            skip("test_v2_model_runner_resumes_a_preempted_request_as_new", reason)
        for i in range(2):
            e.add(f"r{i}", prompt(92 + i, 4 * BLOCK), max_tokens=5 * BLOCK)
        e.run(timeout=60)
        assert e.conn.stats()["preemptions"] >= 1
        assert e.resumed_as_new >= 1  # it came back among the new requests, full block table
        preempted = [t for t in e.tracked.values() if t.request.num_preemptions > 0]
        assert preempted and all(t.waits and t.finished_status == DONE for t in preempted)
        assert e.verified_blocks >= 4
        assert e.invalid_reported == []
    finally:
        e.close()


def deferred_load(e: Engine, p: list[int]):
    """Schedule "b" (a kvx hit) while another step is still in flight, with vLLM's deferred
    block frees and async loads on (as for a consumer with overlapping batches and HiSparse):
    its ``update_state_after_alloc`` waits for that step's ``update_from_output``."""
    s = e.scheduler
    if not hasattr(s, "defer_async_loads"):
        skip("deferred loads", f"vLLM {vllm.__version__} has no deferred async loads")
    s.defer_block_free = True
    s.defer_async_loads = True
    e.add("x", prompt(95, 2 * BLOCK), max_tokens=1)
    so1 = e.schedule()
    assert so1.total_num_scheduled_tokens > 0  # a step in flight
    e.add("b", p)
    so2 = e.schedule()
    assert "b" in s.deferred_loads
    return so1, so2


def test_update_state_after_alloc_in_a_later_update_from_output(tmp_path):
    e = Engine(tmp_path, {"host_blocks": 32})
    try:
        p = prompt(96, 4 * BLOCK + 3)
        e.add("a", p)
        e.run()
        seen: list[tuple[str, int, bool]] = []
        inner = e.conn.update_state_after_alloc

        def spy(request, blocks, n):
            seen.append((request.request_id, n, updating))
            return inner(request, blocks, n)

        e.conn.update_state_after_alloc = spy
        updating = False
        so1, so2 = deferred_load(e, p)
        assert [r for r, _, _ in seen] == ["x"]
        updating = True
        e.execute(so1)  # its update_from_output starts b's load
        updating = False
        assert ("b", 4 * BLOCK, True) in seen
        e.execute(so2)
        e.run()
        t = e.tracked["b"]
        assert t.finished_status == DONE
        assert e.conn.stats()["host_hit_blocks"] == 4
        assert e.verified_blocks == 4
        assert e.idle(), e.state()
    finally:
        e.close()


def test_abort_before_a_deferred_load_started(tmp_path):
    e = Engine(tmp_path, {"host_blocks": 32})
    try:
        p = prompt(97, 4 * BLOCK + 3)
        e.add("a", p)
        e.run()
        so1, so2 = deferred_load(e, p)
        # request_finished for a load the connector never saw (no update_state_after_alloc).
        e.scheduler.finish_requests("b", RequestStatus.FINISHED_ABORTED)
        assert "b" not in e.scheduler.deferred_loads
        e.execute(so1)
        e.execute(so2)
        e.run()
        assert e.conn.stats()["loads"] == 0
        assert "b" not in e.recv_reported
        assert e.tracked["x"].finished_status == DONE
        assert e.idle(), e.state()  # no state left on either side, every block free
        # The blocks are still served to the next request.
        e.add("c", p)
        e.run()
        assert e.verified_blocks == 4
    finally:
        e.close()
