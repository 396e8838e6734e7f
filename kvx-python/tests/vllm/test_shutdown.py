"""The connector's ``shutdown`` on a stuck file tier: with loads and stores stuck in a frozen
mount (kvx.testing.FrozenMount), the worker side's ``shutdown()`` (what vLLM calls when the
engine stops) returns within the bound the README states, one tick + 50 ms, without waiting
for the stuck I/O: the deadlines are minutes away, so nothing in flight has ended by itself.
"""

from __future__ import annotations

import time

from frozen import loads_and_stores_stuck, stored_behind_frozen_mount
from harness import BLOCK, Engine, prompt

TICK_S = 0.001  # kvx_core::TICK
ALLOWANCE_S = 0.050
BOUND_S = TICK_S + ALLOWANCE_S
# Far beyond the test: an op that ends did so because shutdown let go of it, not by timing out.
DEADLINE_MS = 120_000


def test_shutdown_returns_within_the_bound_with_loads_and_stores_stuck(tmp_path):
    stored = [prompt(70 + i, 3 * BLOCK + 5) for i in range(4)]
    with stored_behind_frozen_mount(
        tmp_path,
        "test_shutdown_returns_within_the_bound_with_loads_and_stores_stuck",
        {"host_blocks": 64, "timeouts": {"load_ms": DEADLINE_MS, "store_ms": DEADLINE_MS}},
        stored,
    ) as (mount, extra):
        # A second engine, the mount frozen: its prompts hit the file tier (loads stuck) and new
        # prompts are stored (file stores stuck).
        e = Engine(tmp_path, extra)
        try:
            mount.freeze()
            for i, p in enumerate(stored):
                e.add(f"r{i}", p)
            for i in range(4):
                e.add(f"n{i}", prompt(170 + i, 3 * BLOCK + 5))

            e.run(timeout=10, until=lambda: loads_and_stores_stuck(e))
            before = e.state()
            blocked = mount.blocked_requests()
            t0 = time.monotonic()
            e.worker.shutdown()
            took = time.monotonic() - t0
            print(
                f"connector shutdown with {before['worker_kvx_in_flight']} kvx ops in flight "
                f"({before['sched_loading']} loading requests, "
                f"{before['sched_kvx_jobs'] - before['sched_loading']} store jobs, {blocked} "
                f"requests blocked in the mount): {took * 1000:.2f} ms (bound {BOUND_S * 1000:.0f} ms)"
            )
            assert blocked > 0, "I/O is stuck in the mount"
            assert before["worker_kvx_in_flight"] > before["worker_loading"] > 0, before
            assert took <= BOUND_S, f"shutdown took {took * 1000:.1f} ms"
        finally:
            # Thaw first, so that nothing the test leaves holds the process at exit.
            mount.thaw()
            e.close()
