"""KvxConnector through vLLM 0.32's real v1 Scheduler and its worker-side connector driver, on
CPU: every block kvx loads is checked byte for byte against the tokens it stands for."""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from vllm.v1.request import RequestStatus

from frozen import stored_behind_frozen_mount
from harness import BLOCK, Engine, prompt

DONE = RequestStatus.FINISHED_LENGTH_CAPPED


def file_dir(tmp_path, name="files"):
    d = tmp_path / name
    d.mkdir(exist_ok=True)
    return d


def test_host_tier_hit(tmp_path):
    e = Engine(tmp_path, {"host_blocks": 32})
    try:
        p = prompt(1, 4 * BLOCK + 6)
        e.add("a", p)
        e.run()
        e.add("b", p)
        e.run()
        st = e.conn.stats()
        assert (st["host_hit_blocks"], st["file_hit_blocks"], st["hit_tokens"]) == (4, 0, 4 * BLOCK)
        assert e.tracked["b"].finished_status == DONE
        assert e.recv_reported == {"b"}
        assert e.verified_blocks == 4
        assert e.invalid_reported == []
        # Pickled step metadata stays compact: a 4-block load or store step is under 200
        # bytes (16-byte keys, varint ids), an idle step under a hundred.
        assert max(e.meta_sizes) <= 200, e.meta_sizes
        assert min(e.meta_sizes) <= 100, e.meta_sizes
    finally:
        e.close()


def test_host_tier_hit_loads_in_the_step_that_schedules_it(tmp_path):
    e = Engine(tmp_path, {"host_blocks": 32, "host_loads_in_step": True})
    try:
        p = prompt(1, 4 * BLOCK + 6)
        e.add("a", p)
        e.run()
        e.add("b", p)
        e.run()
        st = e.conn.stats()
        assert (st["host_hit_blocks"], st["file_hit_blocks"], st["hit_tokens"]) == (4, 0, 4 * BLOCK)
        b = e.tracked["b"]
        # Scheduled at once: never waiting for the load, never in finished_recving; its blocks
        # were exact before its first forward (the harness checks them there).
        assert b.wait_started == [] and "b" not in e.recv_reported
        assert b.verified == 4 and b.finished_status == DONE
        assert e.invalid_reported == []
        # A hit of a whole prompt loads asynchronously: vLLM computes at least one token in the
        # step that schedules a request.
        q = prompt(2, 4 * BLOCK)
        e.add("c", q)
        e.run()
        e.add("d", q)
        e.run()
        d = e.tracked["d"]
        assert len(d.wait_started) == 1 and "d" in e.recv_reported
        # (Checked below the token vLLM recomputes: the first 3 blocks.)
        assert d.verified == 3 and d.finished_status == DONE
        assert e.idle(), e.state()
    finally:
        e.close()


@pytest.mark.parametrize("io_engine", ["uring", "psync"])
def test_file_tier_hit_after_restart(tmp_path, io_engine):
    d = file_dir(tmp_path)
    p = prompt(2, 5 * BLOCK + 3)
    extra = {"host_blocks": 32, "file": {"roots": [str(d)], "blocks": 16384, "io_engine": io_engine}}
    e = Engine(tmp_path, extra)
    try:
        e.add("a", p)
        e.run()
        assert e.worker._worker.native.file_blocks() == 5
    finally:
        e.close()
    # A new engine: empty host tier, the file tier's blocks adopted from disk.
    e = Engine(tmp_path, extra)
    try:
        e.add("b", p)
        e.run()
        st = e.conn.stats()
        assert (st["host_hit_blocks"], st["file_hit_blocks"]) == (0, 5)
        ws = e.worker.stats()
        assert (ws["file_loaded"], ws["file_corrupt"], ws["live_tasks"], ws["zombie_ops"]) == (5, 0, 0, 0)
        assert ws["host_blocks"] == 5  # promoted from the file tier
        assert e.tracked["b"].finished_status == DONE
        assert e.verified_blocks == 5
        assert e.invalid_reported == []
    finally:
        e.close()


def test_reset_prefix_cache_with_the_connector_serves_nothing_held_before(tmp_path):
    # vLLM's reset_prefix_cache(reset_connector=True) (LLM.reset_prefix_cache, or the engine's
    # pause with clear_cache): kvx forgets its host tier and its file tier, and removes the
    # files, so a restart adopts none of them either.
    d = file_dir(tmp_path)
    p = prompt(3, 4 * BLOCK + 7)
    extra = {"host_blocks": 32, "file": {"roots": [str(d)], "blocks": 16384}}
    e = Engine(tmp_path, extra)
    try:
        e.add("a", p)
        e.run()
        assert len(list(d.rglob("*.kvb"))) == 4
        assert e.scheduler.reset_prefix_cache(reset_connector=True)
        e.add("b", p)
        e.run()
        st = e.conn.stats()
        assert st["hit_tokens"] == 0, st
        assert e.recv_reported == set()
    finally:
        e.close()
    # A restart adopts what is on disk (b's blocks, stored after the reset, where their store
    # did not meet the old blocks' removes still in flight); a reset then empties the tier.
    e = Engine(tmp_path, extra)
    try:
        assert e.scheduler.reset_prefix_cache(reset_connector=True)
        e.run(timeout=10, until=lambda: not any(d.rglob("*.kvb")))
        assert not any(d.rglob("*.kvb")), sorted(d.rglob("*"))
    finally:
        e.close()
    e = Engine(tmp_path, extra)
    try:
        e.add("c", p)
        e.run()
        assert e.conn.stats()["hit_tokens"] == 0
    finally:
        e.close()


def corrupt_one_block(tmp_path, d, p, index):
    """Store ``p`` in the file tier, then flip a payload byte of block ``index``'s file."""
    e = Engine(tmp_path, {"host_blocks": 32, "file": {"roots": [str(d)], "blocks": 16384}})
    try:
        e.add("writer", p)
        e.run()
        keys = e.keys_of("writer")
        path = e.worker._worker.native.file_block_path(keys[index * 16 : (index + 1) * 16])
    finally:
        e.close()
    raw = bytearray(path.read_bytes())
    raw[4096 + 100] ^= 0xFF
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_corrupt_block_file(tmp_path, policy):
    d = file_dir(tmp_path)
    p = prompt(3, 5 * BLOCK + 1)
    corrupt_one_block(tmp_path, d, p, index=2)
    e = Engine(tmp_path, {"host_blocks": 32, "file": {"roots": [str(d)], "blocks": 16384}}, policy=policy)
    try:
        t = e.add("r", p)
        e.run()
        assert len(t.load_blocks) == 1
        # Exactly the corrupted block, by its engine block id, in the step of finished_recving.
        assert e.invalid_reported == [{t.load_blocks[0][2]}]
        assert "r" in e.recv_reported
        if policy == "recompute":
            assert t.finished_status == DONE
            # Blocks 0 and 1 loaded and verified; 2.. recomputed and stored again.
            assert e.verified_blocks == 2
            e.add("again", p)
            e.run()
            assert e.tracked["again"].finished_status == DONE
            assert e.verified_blocks == 2 + 5
        else:
            assert t.finished_status == RequestStatus.FINISHED_ERROR
    finally:
        e.close()


@contextlib.contextmanager
def frozen_loads(tmp_path: Path, test: str, deadline_ms: int, prompts: list[list[int]]) -> Iterator[tuple[Any, Engine]]:
    """An engine whose file tier holds ``prompts``, its mount frozen and each prompt added as
    ``r0``, ``r1``...; at the end the mount thaws, the engine runs until nothing is left (the
    operations stuck in the mount stay kvx's, quarantined, until then), and all is closed."""
    with stored_behind_frozen_mount(
        tmp_path, test, {"host_blocks": 64, "timeouts": {"load_ms": deadline_ms, "store_ms": 400}}, prompts
    ) as (mount, extra):
        e = Engine(tmp_path, extra)
        try:
            mount.freeze()
            for i, p in enumerate(prompts):
                e.add(f"r{i}", p)
            yield mount, e
            mount.thaw()
            e.run(timeout=10)
        finally:
            mount.close()  # releases the stuck file operations before the engine stops
            e.close()


def test_frozen_file_tier_waits_at_most_one_deadline(tmp_path):
    deadline_ms = 300
    prompts = [prompt(10 + i, 3 * BLOCK + 5) for i in range(4)]
    with frozen_loads(tmp_path, "test_frozen_file_tier_waits_at_most_one_deadline", deadline_ms, prompts) as (mount, e):

        def finished() -> bool:
            return all(e.tracked[f"r{i}"].finished_status for i in range(4))

        e.run(timeout=20, until=finished)
        assert mount.blocked_requests() > 0
        waits = [w for i in range(4) for w in e.tracked[f"r{i}"].waits]
        assert len(waits) == 4
        assert max(waits) <= deadline_ms / 1000 + 0.050, waits
        assert all(e.tracked[f"r{i}"].finished_status == DONE for i in range(4))
        # Every file block timed out: reported invalid, recomputed.
        assert sum(len(s) for s in e.invalid_reported) == 4 * 3


def test_a_frozen_load_is_reported_by_the_first_step_past_its_deadline(tmp_path):
    """The engine's thread pauses across the deadline of loads stuck in a frozen mount (a
    garbage-collector pause, a long forward): the first step after the pause reports them. Their
    file reads are still out, but fill kvx's staging buffers only, so no fence on the engine's
    blocks has to be asked for first (which took one more step)."""
    deadline_ms = 200
    prompts = [prompt(70 + i, 3 * BLOCK + 5) for i in range(2)]
    test = "test_a_frozen_load_is_reported_by_the_first_step_past_its_deadline"
    with frozen_loads(tmp_path, test, deadline_ms, prompts) as (_, e):
        e.step()  # the loads start in this step
        waiting = [r for r in ("r0", "r1") if e.tracked[r].entered_wait is not None]
        assert waiting == ["r0", "r1"], "both requests wait for their file-tier loads"
        assert not e.recv_reported
        time.sleep(deadline_ms / 1000 + 0.1)
        e.step()
        assert e.recv_reported == {"r0", "r1"}, "the first step past the deadline reports both loads"
        assert sum(len(s) for s in e.invalid_reported) == 2 * 3
        e.run(timeout=20, until=lambda: all(e.tracked[r].finished_status for r in ("r0", "r1")))
        assert all(e.tracked[r].finished_status == DONE for r in ("r0", "r1"))


def test_abort_while_loading_frees_blocks_once_the_load_ends(tmp_path):
    p = prompt(50, 3 * BLOCK + 2)
    with stored_behind_frozen_mount(
        tmp_path,
        "test_abort_while_loading_frees_blocks_once_the_load_ends",
        {"host_blocks": 16, "timeouts": {"load_ms": 200, "store_ms": 200}},
        [p],
    ) as (mount, extra):
        e = Engine(tmp_path, extra)
        try:
            delays = []
            inner = e.conn.request_finished
            e.conn.request_finished = lambda r, b: delays.append(inner(r, b)[0]) or (delays[-1], None)
            mount.freeze()
            t = e.add("r", p)
            e.run(timeout=5, until=lambda: t.request.status == RequestStatus.WAITING_FOR_REMOTE_KVS)
            held = t.load_blocks[0][:3]
            assert len(held) == 3
            e.scheduler.finish_requests("r", RequestStatus.FINISHED_ABORTED)
            # The connector does not delay the free of a loading request (vLLM itself holds
            # its blocks until the load is reported) ...
            assert delays == [False]
            pool = e.scheduler.kv_cache_manager.block_pool
            def load_reported():
                if "r" in e.recv_reported:
                    return True
                assert "r" in e.scheduler.requests
                assert all(pool.blocks[b].ref_cnt > 0 for b in held)
                return False

            e.run(timeout=5, until=load_reported)
            # ... and reports it in finished_recving once the load ended (here: timed out), once.
            assert "r" not in e.scheduler.requests
            mount.thaw()
            e.run(timeout=10)
            assert e.invalid_reported == []  # an abandoned load's blocks belong to nobody now
        finally:
            mount.close()
            e.close()


def test_preempted_request_is_flushed_and_reloads(tmp_path):
    # 16 usable blocks; two requests that each grow to 9 blocks: one is preempted.
    e = Engine(tmp_path, {"host_blocks": 64}, num_blocks=17, max_batched_tokens=256)
    try:
        for i in range(2):
            e.add(f"r{i}", prompt(20 + i, 4 * BLOCK), max_tokens=5 * BLOCK)
        e.run(timeout=60)
        assert e.conn.stats()["preemptions"] >= 1
        preempted = [t for t in e.tracked.values() if t.request.num_preemptions > 0]
        assert preempted
        for t in preempted:
            # On resume its flushed stores came back from kvx (at least the prompt's 4 blocks),
            # byte-exact, before it ran again.
            assert t.waits, "the preempted request did not reload from kvx"
            assert t.finished_status == DONE
        assert e.verified_blocks >= 4
        assert e.invalid_reported == []
    finally:
        e.close()


def test_finish_with_stores_in_flight_keeps_blocks_until_finished_sending(tmp_path):
    e = Engine(tmp_path, {"host_blocks": 32})
    try:
        delays = []
        inner = e.conn.request_finished

        def spy(request, block_ids):
            out = inner(request, block_ids)
            delays.append((request.request_id, out[0], list(block_ids)))
            return out

        e.conn.request_finished = spy
        p = prompt(30, 4 * BLOCK + 2)
        e.add("a", p, max_tokens=1)  # finishes in the step that computed (and saved) it
        e.run(timeout=5, until=lambda: bool(delays))
        (req_id, delayed, blocks), = delays
        assert (req_id, delayed) == ("a", True)
        assert len(blocks) >= 4
        pool = e.scheduler.kv_cache_manager.block_pool
        def sent():
            if "a" in e.send_reported:
                return True
            assert "a" in e.scheduler.requests
            assert all(pool.blocks[b].ref_cnt > 0 for b in blocks)
            return False

        e.run(timeout=5, until=sent)
        assert e.send_reported.count("a") == 1
        assert "a" not in e.scheduler.requests
        e.run()
        e.add("b", p)
        e.run()
        assert e.conn.stats()["host_hit_blocks"] == 4
        assert e.verified_blocks == 4
    finally:
        e.close()


def test_200_requests_over_shared_prefixes_leave_no_state(tmp_path):
    d = file_dir(tmp_path)
    e = Engine(
        tmp_path,
        {"host_blocks": 32, "file": {"roots": [str(d)], "blocks": 400}, "eviction": "arc"},
        num_blocks=40,
        prefix_caching=True,
        max_num_seqs=8,
    )
    rng = random.Random(7)
    # 16 shared prefixes of 3 blocks: more than vLLM's own prefix cache keeps (40 blocks).
    prefixes = [prompt(100 + i, 3 * BLOCK) for i in range(16)]
    try:
        aborted = set()
        for n in range(200):
            p = prefixes[n % 16] + prompt(1000 + n, rng.randint(4, 40))
            e.add(f"q{n}", p, max_tokens=rng.randint(1, 4))
            if n % 10 == 9:
                for _ in range(3):
                    e.step()
            if n % 25 == 24:
                # Abort a request wherever it is (waiting, loading, running).
                victim = f"q{n - 3}"
                if e.tracked[victim].request.status not in (DONE, RequestStatus.FINISHED_ABORTED):
                    e.scheduler.finish_requests(victim, RequestStatus.FINISHED_ABORTED)
                    aborted.add(victim)
        e.run(timeout=120)
        assert e.idle(), e.state()
        for rid, t in e.tracked.items():
            assert t.request.status == (RequestStatus.FINISHED_ABORTED if rid in aborted else DONE), rid
        st = e.conn.stats()
        assert st["loads"] >= 20 and st["host_hit_blocks"] > 0 and st["file_hit_blocks"] > 0, st
        assert e.verified_blocks > 0
        assert e.invalid_reported == []
    finally:
        e.close()
