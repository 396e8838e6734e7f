"""KvxConnector on a hybrid model (full-attention and sliding-window KV cache groups) through
vLLM's real scheduler with its hybrid KV cache manager: every block of every group that kvx
loads is checked byte for byte against the tokens and layer it stands for."""

from __future__ import annotations

import pytest
from vllm.v1.request import RequestStatus

from harness import BLOCK, prompt
from hybrid_harness import WINDOW, HybridEngine, unavailable

DONE = RequestStatus.FINISHED_LENGTH_CAPPED


@pytest.fixture(autouse=True)
def _hybrid_available():
    reason = unavailable()
    if reason is not None:
        print(f"skip: test_hybrid: {reason}")
        pytest.skip(reason)


@pytest.mark.parametrize("layout", [None, "BLHNC"])
def test_hybrid_host_hit_loads_each_group_byte_exact(tmp_path, layout):
    # None: the layout vLLM resolves with no preference; BLHNC: block-outermost (the groups'
    # layers share each block's bytes).
    e = HybridEngine(tmp_path, {"host_blocks": 64}, layout=layout)
    try:
        sw = e.sliding.index(True)
        full = e.sliding.index(False)
        p = prompt(1, 5 * BLOCK + 3)
        e.add("a", p)
        e.run()
        host, _ = e.conn._sched.native.tier_sizes()
        # Full attention: the 5 full blocks; sliding window: only the window of the computed
        # prefix (blocks 3 and 4 of 83 tokens with a 32-token window).
        assert host == 5 + 2, host
        e.add("b", p)
        e.run()
        st = e.conn.stats()
        assert st["hit_tokens"] == 5 * BLOCK, st
        assert st["host_hit_blocks"] == 7, st
        t = e.tracked["b"]
        assert t.finished_status == DONE
        (loaded,) = t.load_blocks
        # vLLM's table for the load: the sliding-window group's out-of-window blocks are null.
        assert [b == 0 for b in loaded[sw][:5]] == [True, True, True, False, False], loaded
        assert all(b != 0 for b in loaded[full][:5])
        assert e.verified[full] == 5 and e.verified[sw] == 2, e.verified
        assert e.recv_reported == {"b"}
        assert e.invalid_reported == [] and e.failed_reported == set()
        assert e.idle(), e.state()
    finally:
        e.close()


def test_hybrid_preempted_request_reloads_every_group(tmp_path):
    # 20 usable blocks shared by both groups; two requests that each grow to 9 full-attention
    # blocks (plus their sliding windows): one is preempted.
    e = HybridEngine(tmp_path, {"host_blocks": 128}, num_blocks=21, max_batched_tokens=256)
    try:
        for i in range(2):
            e.add(f"r{i}", prompt(20 + i, 4 * BLOCK), max_tokens=5 * BLOCK)
        e.run(timeout=60)
        assert e.conn.stats()["preemptions"] >= 1
        # Sliding-window blocks left the window and were handed out again while stores of
        # theirs may have been queued: each was fenced before the forward could write it.
        assert e.conn._sched.fenced_blocks > 0
        preempted = [t for t in e.tracked.values() if t.request.num_preemptions > 0]
        assert preempted
        for t in preempted:
            assert t.waits, "the preempted request did not reload from kvx"
            assert t.finished_status == DONE
        sw, full = e.sliding.index(True), e.sliding.index(False)
        assert e.verified[full] >= 4 and e.verified[sw] >= WINDOW // BLOCK, e.verified
        assert all(t.finished_status == DONE for t in e.tracked.values())
        assert e.invalid_reported == [] and e.failed_reported == set()
        assert e.idle(), e.state()
    finally:
        e.close()


def _corrupt(tmp_path, d, p, group_sliding: bool, index: int) -> None:
    """Store ``p`` in the file tier, then flip a payload byte of one group's block ``index``."""
    e = HybridEngine(tmp_path, {"host_blocks": 64, "file": {"roots": [str(d)], "blocks": 16384}})
    try:
        e.add("writer", p)
        e.run()
        keys = e.keys_of("writer", e.sliding.index(group_sliding))
        path = e.worker._worker.native.file_block_path(keys[index * 16 : (index + 1) * 16])
    finally:
        e.close()
    raw = bytearray(path.read_bytes())
    raw[4096 + 100] ^= 0xFF
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize(
    ("group", "policy"), [("sliding", "recompute"), ("full", "recompute"), ("sliding", "fail")]
)
def test_hybrid_load_failure_in_one_group(tmp_path, group, policy):
    d = tmp_path / "files"
    d.mkdir()
    p = prompt(3, 5 * BLOCK + 1)
    # Block 3 of 5: inside the sliding window of the 80-token hit, in either group.
    _corrupt(tmp_path, d, p, group == "sliding", index=3)
    e = HybridEngine(tmp_path, {"host_blocks": 64, "file": {"roots": [str(d)], "blocks": 16384}}, policy=policy)
    try:
        t = e.add("r", p)
        e.run()
        assert len(t.load_blocks) == 1
        # Reported per request (vLLM refuses block ids with several groups), in finished_recving.
        assert e.failed_reported == {"r"} and "r" in e.recv_reported
        assert e.invalid_reported == []
        assert e.worker.stats()["file_corrupt"] == 1
        if policy == "recompute":
            assert t.finished_status == DONE
            assert e.conn.stats()["failed_loads"] == 1
            # Restarted from 0 and looked up again: offered nothing from the failed block on.
            assert e.conn.stats()["loads"] == 1
            e.add("again", p)
            e.run()
            assert e.tracked["again"].finished_status == DONE
            sw, full = e.sliding.index(True), e.sliding.index(False)
            assert e.verified[full] == 5 and e.verified[sw] == 2, e.verified
        else:
            assert t.finished_status == RequestStatus.FINISHED_ERROR
        assert e.idle(), e.state()
    finally:
        e.close()
