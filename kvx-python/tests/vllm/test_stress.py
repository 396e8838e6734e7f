"""The frozen-mount scenarios (test_connector.py, test_shutdown.py) on a busy machine: two
spinning processes per core run throughout. Every connector hook vLLM's scheduler and its worker
driver call is timed (hook_clock.py):

- each returns within one tick + 50 ms, excusing only the time its thread waited on a run queue
  (and for the worker's shutdown, which joins kvx's threads, theirs); the hooks that wait by
  design (a step that fences preempted requests, up to the store deadline) are held to that
  bound instead, and reported apart;
- once a load's deadline passed, every ``get_finished`` starting more than one tick + 50 ms
  later reports it, excusing the driver thread's run-queue wait meanwhile (it decides the
  time-out); and each wait in WAITING_FOR_REMOTE_KVS is at most the deadline + one tick + 50 ms,
  excusing the engine thread's run-queue wait over it and the harness's stepping (the engine
  thread is the test's: it steps without pause while a request waits, and a report comes in the
  first step after kvx has it);
- the verdicts are the unloaded tests' own: every request finishes, its blocks loaded byte-exact
  or recomputed, nothing left over once the mount thaws.

The garbage collector's heap is frozen first, as vLLM's engine core does after start-up. Each
test prints one ``stress:`` JSON line (per hook its worst call and that call's parts: run queue,
CPU, sleep, garbage collector, page faults; the worst wait; the longest and the sleepiest step)
for loops that look for the rare slow case; a failure names the steal time around a slow call
too (a CPU the hypervisor ran something else on: no thread of this machine ran there).

Last, a frozen file tier at start-up: building the scheduler side (and reading the config, as
the worker side does) must leave the GIL free while it waits for the mount."""

from __future__ import annotations

import bisect
import contextlib
import faulthandler
import gc
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from vllm.v1.request import RequestStatus

from kvx import _native

import frozen
from busy import spinners
from frozen import stored_behind_frozen_mount
from harness import BLOCK, Engine, prompt
from hook_clock import BOUND_NS, SOURCE, Call, HookClock, Times, steal_ns, thread_sched_ns, threads_named

DONE = RequestStatus.FINISHED_LENGTH_CAPPED
LOAD_MS = 500
STORE_MS = 400
# The worker hooks that start a step: with preempted requests in it, the step waits for their
# fence, at most the store deadline (README: preempt_wait_ms, then the fence up to store_ms).
STEP_STARTS = {"handle_preemptions", "start_load_kv", "wait_for_save"}
# For loops that look for a stall: a step longer than this many seconds dumps every thread's
# Python stack to stderr (faulthandler), showing the call it is stuck in. It perturbs what it
# watches: disarming waits for faulthandler's thread, holding the GIL. Off (0) in CI.
WATCH_S = float(os.environ.get("KVX_STRESS_WATCH_S", "0"))
# The worker's shutdown stops the driver thread and joins the copy threads: it waits for them
# to be scheduled, so their run-queue wait meanwhile is excused too (hook_clock.ThreadWaits).
JOINS = frozenset({"shutdown"})
# Hooks each scenario must have timed at least once (else the wrapping no longer sees them).
CALLED = {
    "scheduler.get_num_new_matched_tokens",
    "scheduler.update_state_after_alloc",
    "scheduler.build_connector_meta",
    "scheduler.update_connector_output",
    "scheduler.request_finished_all_groups",
    "worker.handle_preemptions",
    "worker.start_load_kv",
    "worker.wait_for_save",
    "worker.get_finished",
    "worker.get_block_ids_with_load_errors",
    "worker.build_connector_worker_meta",
    "worker.shutdown",
}


@pytest.fixture(scope="module")
def busy(tmp_path_factory):
    """Spinners on every core, and the heap frozen as vLLM's engine core freezes it (a full
    collection of this process's start-up objects takes hundreds of ms). An engine is built
    first, before the spinners: vLLM inspects the model class in a subprocess that imports vLLM
    (seconds; minutes on a busy machine), once a process."""
    Engine(tmp_path_factory.mktemp("warm"), {"host_blocks": 16}).close()
    gc.collect()
    gc.freeze()
    try:
        with spinners(per_core=2, lifetime_s=150) as n:
            print(f"stress: {n} spinners on {os.cpu_count()} cores; excused: {SOURCE}")
            yield n
    finally:
        gc.unfreeze()


@dataclass(frozen=True)
class Sample:
    """The clocks at one moment of the engine loop."""

    at: float  # monotonic
    engine: Times  # the engine thread's
    driver_cpu: int  # kvx's driver thread: on a CPU, on a run queue (ns)
    driver_runq: int
    steal: list[int]  # each CPU's steal time (ns)


@dataclass(frozen=True)
class Spent:
    """Over an interval (ns): the engine thread's and the driver's run-queue wait, the driver's
    time on a CPU, and the most steal time any CPU had."""

    engine_runq: int
    driver_runq: int
    driver_cpu: int
    steal: int


class TimedEngine(Engine):
    """``Engine`` whose connectors' hooks are timed by ``clock``, sampling the clocks (the
    engine thread's, kvx's driver thread's, the CPUs' steal time) around each step, and
    recording each wait in WAITING_FOR_REMOTE_KVS as (request, start, end)."""

    def __init__(self, tmp: Path, extra: dict, *, clock: HookClock, **kw: Any):
        before = threads_named("kvx-driver")
        super().__init__(tmp, extra, **kw)
        self.drivers = threads_named("kvx-driver") - before
        self.clock = clock
        self.preempting = False
        self.samples: list[Sample] = []
        self.spans: list[tuple[str, float, float]] = []
        self.steps_took: list[tuple[float, Times]] = []  # (monotonic start, the step's clocks)
        # kvx's defaults filled in (offload_config: no look at the file-tier roots, which may be
        # a mount on a starved FUSE server).
        timeouts = json.loads(_native.offload_config(json.dumps({**extra, "block_tokens": BLOCK})))["timeouts"]
        fence_ns = int(timeouts["store_ms"] * 1e6) + BOUND_NS
        clock.wrap(self.conn, "scheduler")
        clock.wrap(self.worker, "worker", lambda h: fence_ns if self.preempting and h in STEP_STARTS else BOUND_NS,
                   joins=JOINS)

    def _sample(self) -> Sample:
        drivers = [thread_sched_ns(t) for t in self.drivers]
        s = Sample(time.monotonic(), Times.now(), sum(d[0] for d in drivers), sum(d[1] for d in drivers), steal_ns())
        self.samples.append(s)
        return s

    def step(self) -> None:
        first = self._sample()
        if WATCH_S > 0:
            faulthandler.dump_traceback_later(WATCH_S)
        try:
            super().step()
        finally:
            if WATCH_S > 0:
                faulthandler.cancel_dump_traceback_later()
        self.steps_took.append((first.at, self._sample().engine - first.engine))

    def schedule(self):
        so = super().schedule()
        self.preempting = bool(so.preempted_req_ids)
        return so

    def execute(self, so) -> None:
        pending = {r: (t.entered_wait, len(t.waits)) for r, t in self.tracked.items() if t.entered_wait is not None}
        super().execute(so)
        for r, (start, n) in pending.items():
            t = self.tracked[r]
            if len(t.waits) > n:
                self.spans.append((r, start, start + t.waits[-1]))

    def close(self) -> None:
        try:
            super().close()
        finally:
            self._sample()

    def over(self, start: float, end: float) -> Spent:
        """What the engine and driver threads and the CPUs spent from the last sample at or
        before ``start`` to the first at or after ``end`` (a sample taken now if none is)."""
        if end <= start:
            return Spent(0, 0, 0, 0)
        times = [s.at for s in self.samples]
        i = max(bisect.bisect_right(times, start) - 1, 0)
        j = bisect.bisect_left(times, end)
        a = self.samples[i]
        b = self.samples[j] if j < len(self.samples) else self._sample()
        steal = max((y - x for x, y in zip(a.steal, b.steal, strict=True)), default=0)
        return Spent(b.engine.runq - a.engine.runq, b.driver_runq - a.driver_runq, b.driver_cpu - a.driver_cpu, steal)

    def waits_checked(self, load_s: float) -> tuple[list[dict], list[str]]:
        """Each wait in WAITING_FOR_REMOTE_KVS, in ms, and what is wrong with it.

        kvx's promise: once the deadline passed (``load_s`` after the step that started the
        load), every ``get_finished`` starting more than tick + 50 ms later, excusing the
        driver thread's run-queue wait meanwhile (it decides the time-out), reports the load.
        And the wait itself (the harness's measure): at most the deadline + tick + 50 ms,
        excusing the engine thread's run-queue wait over it and the harness's stepping (the
        time from the last poll that could not report it to the one that did)."""
        calls = self.clock.calls
        starts = [c for c in calls if c.hook.startswith("worker.handle_preemptions")]
        polls = [c.at for c in calls if c.hook == "worker.get_finished"]
        rows, wrong = [], []
        for req, start, end in self.spans:
            # The load's deadline is set in the first step start after the request began waiting.
            began = next(c.at + c.took.wall / 1e9 for c in starts if c.at >= start)
            due = began + load_s
            during = [p for p in polls if start <= p <= end]
            reporting, earlier = during[-1], during[:-1]
            whole, late = self.over(start, end), self.over(due, reporting)
            stepping = reporting - max([p for p in earlier if p <= due], default=start)
            row = {
                "req": req, "wait_ms": (end - start) * 1e3, "excused_ms": whole.engine_runq / 1e6,
                "late_ms": (reporting - due) * 1e3, "driver_late_runq_ms": late.driver_runq / 1e6,
                "driver_late_cpu_ms": late.driver_cpu / 1e6, "late_steal_ms": late.steal / 1e6,
                "stepping_ms": stepping * 1e3,
            }
            rows.append(row)
            for p in earlier:
                by = self.over(due, p)
                if (p - due) * 1e9 > BOUND_NS + by.driver_runq:
                    wrong.append(f"{req}: a get_finished {(p - due) * 1e3:.1f} ms after its deadline did not report "
                                 f"it (the driver meanwhile: {by.driver_runq / 1e6:.1f} ms on a run queue, "
                                 f"{by.driver_cpu / 1e6:.1f} ms on a CPU; steal {by.steal / 1e6:.0f} ms): {row}")
                    break
            if (end - start - load_s) * 1e9 > BOUND_NS + whole.engine_runq + stepping * 1e9:
                wrong.append(f"{req}: waited past the deadline + {BOUND_NS / 1e6:.0f} ms + its excuses: {row}")
        return rows, wrong


class Stress:
    """One test's clock, the engines it times (the frozen-mount fixture's first engine too) and
    the waits checked."""

    def __init__(self, test: str):
        self.test = test
        self.clock = HookClock()
        self.engines: list[TimedEngine] = []
        self.waits: list[dict] = []

    def engine(self, tmp: Path, extra: dict, **kw: Any) -> TimedEngine:
        e = TimedEngine(tmp, extra, clock=self.clock, **kw)
        self.engines.append(e)
        return e

    def check_waits(self, e: TimedEngine, load_s: float) -> None:
        """``TimedEngine.waits_checked``: nothing wrong with any wait."""
        rows, wrong = e.waits_checked(load_s)
        self.waits += rows
        assert not wrong, "\n".join(wrong)

    def report(self) -> None:
        """The ``stress:`` line (printed even when the test failed): per hook its worst calls,
        the worst wait, the longest step and the step that slept longest (neither running
        nor runnable: on a lock, the GIL, the disk)."""
        steps = [s for e in self.engines for s in e.steps_took]
        longest = max(steps, key=lambda s: s[1].wall, default=None)
        sleepiest = max(steps, key=lambda s: s[1].wall - s[1].runq - s[1].cpu, default=None)
        line = {
            "test": self.test,
            "loadavg": os.getloadavg()[0],
            "calls": len(self.clock.calls),
            "hooks": self.clock.worst(),
            "worst_wait": max(self.waits, key=lambda w: w["wait_ms"] - w["excused_ms"], default=None),
            "longest_step": longest[1].describe() if longest else None,
            "sleepiest_step": sleepiest[1].describe() if sleepiest else None,
            "over_bound": [str(c) for c in self.clock.over_bound()],
        }
        print("stress: " + json.dumps(line, sort_keys=True))

    def steal_around(self, c: Call) -> int:
        """The most steal time a CPU had from the engine-loop sample before call ``c`` to the
        one after it (ns): time no thread of this machine's CPU ran, which the run-queue wait
        does not show."""
        owners = [e for e in self.engines if e.samples and e.samples[0].at <= c.at]
        return owners[-1].over(c.at, c.at + c.took.wall / 1e9).steal if owners else 0

    def check_calls(self) -> None:
        """Every expected hook was timed, and no call went past its bound."""
        missing = CALLED - {c.hook for c in self.clock.calls}
        assert not missing, f"hooks never timed: {sorted(missing)}"
        over = self.clock.over_bound()
        assert not over, "hook calls past their bound:\n" + "\n".join(
            f"{c}; steal around it {self.steal_around(c) / 1e6:.0f} ms" for c in over
        )


@pytest.fixture
def stress(request, monkeypatch):
    s = Stress(request.node.name)
    monkeypatch.setattr(frozen, "Engine", s.engine)
    yield s
    s.report()


@contextlib.contextmanager
def stored(tmp_path: Path, test: str, host_blocks: int, prompts: list[list[int]]) -> Iterator[tuple[Any, dict]]:
    """``stored_behind_frozen_mount`` whose first engine has deadlines to spare (its stores must
    land on a busy machine, where a step can wait a second on a run queue); yields the config
    with this module's deadlines (LOAD_MS, STORE_MS)."""
    generous = {"host_blocks": host_blocks, "timeouts": {"load_ms": 10_000, "store_ms": 30_000}}
    with stored_behind_frozen_mount(tmp_path, test, generous, prompts) as (mount, extra):
        yield mount, {**extra, "timeouts": {"load_ms": LOAD_MS, "store_ms": STORE_MS}}


def with_file(config: dict, **file: Any) -> dict:
    """``config`` with more file-tier settings."""
    return {**config, "file": {**config["file"], **file}}


@pytest.mark.parametrize("io_engine", ["uring", "psync"])
def test_frozen_file_tier_under_load(tmp_path, busy, stress, io_engine):
    """test_connector.py's frozen file tier: every load times out once, is reported invalid and
    recomputed; thawed, nothing is left."""
    prompts = [prompt(10 + i, 3 * BLOCK + 5) for i in range(4)]
    with stored(tmp_path, "test_frozen_file_tier_under_load", 64, prompts) as (mount, extra):
        e = stress.engine(tmp_path, with_file(extra, io_engine=io_engine))
        try:
            mount.freeze()
            for i, p in enumerate(prompts):
                e.add(f"r{i}", p)
            e.run(timeout=30, until=lambda: all(e.tracked[f"r{i}"].finished_status for i in range(4)))
            assert mount.blocked_requests() > 0
            assert sorted(r for r, _, _ in e.spans) == [f"r{i}" for i in range(4)]
            stress.check_waits(e, LOAD_MS / 1000)
            assert all(e.tracked[f"r{i}"].finished_status == DONE for i in range(4))
            assert sum(len(s) for s in e.invalid_reported) == 4 * 3
            mount.thaw()
            e.run(timeout=30)
        finally:
            mount.close()
            e.close()
    stress.check_calls()


def test_shutdown_under_load_with_loads_and_stores_stuck(tmp_path, busy, stress):
    """test_shutdown.py's stuck loads and stores: the worker's shutdown is one of the timed hooks
    (bound one tick + 50 ms), the deadlines minutes away."""
    old = [prompt(70 + i, 3 * BLOCK + 5) for i in range(4)]
    with stored_behind_frozen_mount(
        tmp_path, "test_shutdown_under_load_with_loads_and_stores_stuck",
        {"host_blocks": 64, "timeouts": {"load_ms": 120_000, "store_ms": 120_000}}, old,
    ) as (mount, extra):
        e = stress.engine(tmp_path, extra)
        try:
            mount.freeze()
            for i, p in enumerate(old):
                e.add(f"r{i}", p)
            for i in range(4):
                e.add(f"n{i}", prompt(170 + i, 3 * BLOCK + 5))

            e.run(timeout=30, until=lambda: frozen.loads_and_stores_stuck(e))
            assert mount.blocked_requests() > 0
            e.worker.shutdown()
            assert stress.clock.calls[-1].hook == "worker.shutdown"
        finally:
            mount.thaw()
            e.close()
    stress.check_calls()


def test_abort_while_loading_under_load(tmp_path, busy, stress):
    """test_connector.py's abort of a loading request: reported in finished_recving once its
    load timed out, its blocks held until then; thawed, nothing is left."""
    p = prompt(50, 3 * BLOCK + 2)
    with stored(tmp_path, "test_abort_while_loading_under_load", 16, [p]) as (mount, extra):
        e = stress.engine(tmp_path, extra)
        try:
            mount.freeze()
            t = e.add("r", p)
            e.run(timeout=10, until=lambda: t.request.status == RequestStatus.WAITING_FOR_REMOTE_KVS)
            held = t.load_blocks[0][:3]
            assert len(held) == 3
            e.scheduler.finish_requests("r", RequestStatus.FINISHED_ABORTED)
            pool = e.scheduler.kv_cache_manager.block_pool

            def load_reported() -> bool:
                if "r" in e.recv_reported:
                    return True
                assert all(pool.blocks[b].ref_cnt > 0 for b in held)
                return False

            e.run(timeout=10, until=load_reported)
            assert "r" not in e.scheduler.requests
            stress.check_waits(e, LOAD_MS / 1000)
            assert [r for r, _, _ in e.spans] == ["r"]
            mount.thaw()
            e.run(timeout=30)
            assert e.invalid_reported == []
        finally:
            mount.close()
            e.close()
    stress.check_calls()


@pytest.mark.parametrize("io_engine", ["uring", "psync"])
def test_stores_evicting_frozen_file_blocks_under_load(tmp_path, busy, stress, io_engine):
    """New prompts stored into a full file tier while it is frozen: their write-through is stuck
    and their room is made by evicting stored blocks (removes stuck in the mount too); then the
    stored prompts load what is still indexed, time out, and are recomputed. Thawed, nothing is
    left and the file tier is within its capacity."""
    old = [prompt(90 + i, 3 * BLOCK + 5) for i in range(4)]
    capacity = 18  # the 12 stored blocks and 6 more: the 12 new ones make room by evicting
    with stored(tmp_path, "test_stores_evicting_frozen_file_blocks_under_load", 64, old) as (mount, extra):
        e = stress.engine(tmp_path, with_file(extra, blocks=capacity, io_engine=io_engine))
        try:
            assert e.worker._worker.native.file_blocks() == 12
            mount.freeze()
            for i in range(4):
                e.add(f"n{i}", prompt(190 + i, 3 * BLOCK + 5))
            e.run(timeout=30, until=lambda: all(e.tracked[f"n{i}"].finished_status for i in range(4)))
            # Room for the new blocks made by evicting stored ones (removes on the frozen mount):
            # the index within capacity.
            assert e.conn._sched.native.tier_sizes()[1] <= capacity
            for i, p in enumerate(old):
                e.add(f"r{i}", p)
            e.run(timeout=30, until=lambda: all(t.finished_status for t in e.tracked.values()))
            assert mount.blocked_requests() > 0
            assert all(t.finished_status == DONE for t in e.tracked.values())
            # A prompt hits the prefix of its blocks still indexed (which went depends on the
            # order the tier adopted them, maybe every prompt's first): those timed out,
            # reported invalid, recomputed.
            hits = e.conn.stats()["file_hit_blocks"]
            assert sum(len(s) for s in e.invalid_reported) == hits
            assert sorted(r for r, _, _ in e.spans) == sorted(r for r, t in e.tracked.items() if t.invalid)
            stress.check_waits(e, LOAD_MS / 1000)
            mount.thaw()
            e.run(timeout=30)
            assert e.worker._worker.native.file_blocks() <= capacity
        finally:
            mount.close()
            e.close()
    stress.check_calls()


def test_preempted_requests_with_the_file_tier_frozen_under_load(tmp_path, busy, stress):
    """test_connector.py's preemption, its stores' write-through stuck in a frozen mount: the
    steps that preempt fence only the copies out of engine memory (held to the store deadline,
    as documented; reported apart), never the stuck file writes; the preempted requests reload
    their flushed blocks from the host tier, byte-exact, and finish. The store deadline is long
    here: a copy into the host tier that a starved copy thread finishes late would fail, and
    the request would compute its blocks again instead of reloading them."""
    test = "test_preempted_requests_with_the_file_tier_frozen_under_load"
    with stored(tmp_path, test, 64, [prompt(60, 2 * BLOCK)]) as (mount, extra):
        config = {**extra, "timeouts": {"load_ms": LOAD_MS, "store_ms": 30_000}}
        # 16 usable blocks; two requests that each grow to 9 blocks: one is preempted.
        e = stress.engine(tmp_path, config, num_blocks=17, max_batched_tokens=256)
        try:
            mount.freeze()
            for i in range(2):
                e.add(f"r{i}", prompt(20 + i, 4 * BLOCK), max_tokens=5 * BLOCK)
            e.run(timeout=60, until=lambda: all(t.finished_status for t in e.tracked.values()))
            assert mount.blocked_requests() > 0
            assert e.conn.stats()["preemptions"] >= 1
            preempted = [t for t in e.tracked.values() if t.request.num_preemptions > 0]
            assert preempted
            for t in preempted:
                assert t.waits, f"the preempted request did not reload from kvx: {e.worker.stats()}"
            assert all(t.finished_status == DONE for t in e.tracked.values())
            assert e.verified_blocks >= 4
            assert e.invalid_reported == []
            stress.check_waits(e, LOAD_MS / 1000)
            assert any("[" in c.hook for c in stress.clock.calls), "no step fenced a preemption"
            mount.thaw()
            e.run(timeout=30)
        finally:
            mount.close()
            e.close()
    stress.check_calls()


# A child process that builds a connector part over a file tier at ``sys.argv[2]`` while a
# thread of it prints a tick every 50 ms: a call that holds the GIL while the mount answers
# stops the ticks.
_GIL_CHILD = """
import json, os, sys, threading, time
from kvx import _native
def tick():
    while True:
        os.write(1, b"tick\\n")
        time.sleep(0.05)
threading.Thread(target=tick, daemon=True).start()
config = json.dumps({"host_blocks": 16, "file": {"roots": [sys.argv[2]], "blocks": 1000}})
os.write(1, b"start\\n")
if sys.argv[1] == "parse_config":
    _native.parse_config(config, 16)
else:  # a decode engine's scheduler side builds its lease keeper too
    _native.SchedulerSide(config, 16, [b"ns"], consumer="ns" if sys.argv[1] == "consumer" else None)
os.write(1, b"done\\n")
"""


@pytest.mark.parametrize("build", ["SchedulerSide", "parse_config", "consumer"])
def test_a_frozen_file_tier_at_start_up_leaves_the_gil_free(tmp_path, build):
    """Building the scheduler side (and reading the config, as the worker side does) waits for
    the file-tier mount; while it waits, the process's other Python threads go on."""
    from kvx.testing import frozen_mount

    with frozen_mount(tmp_path, "test_a_frozen_file_tier_at_start_up_leaves_the_gil_free") as (mount, mnt):
        mount.freeze()
        child = subprocess.Popen([sys.executable, "-c", _GIL_CHILD, build, str(mnt)], stdout=subprocess.PIPE,
                                 text=True)
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.extend(child.stdout or ()), daemon=True)
        reader.start()
        end = time.monotonic() + 60
        while "start\n" not in lines and time.monotonic() < end:
            time.sleep(0.01)
        assert mount.wait_blocked(1, 30), "the child never reached the mount"
        before = lines.count("tick\n")
        time.sleep(1.0)
        ticks = lines.count("tick\n") - before
        assert "done\n" not in lines, "the frozen mount did not hold the child"
        mount.thaw()
        assert child.wait(60) == 0
        reader.join(10)
        assert "done\n" in lines
        # 20 ticks a second while the GIL is free; a busy machine still gets a few.
        assert ticks >= 3, f"{ticks} ticks in the second the child waited for the mount: it held the GIL"
