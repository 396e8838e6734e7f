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


def test_hybrid_host_hit_loads_each_group_byte_exact(tmp_path):
    e = HybridEngine(tmp_path, {"host_blocks": 64})
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
