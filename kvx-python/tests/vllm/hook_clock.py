"""Timing a connector's hooks on a busy machine: each call's wall time, and the time its thread
spent runnable but not running meanwhile (waiting on a run queue), the only time a "never
blocks" bound excuses. A call that waits on a lock, a condition or a stuck file operation
sleeps: that time is not excused.

The run-queue wait is the second field of ``/proc/thread-self/schedstat`` (nanoseconds); where
the kernel has no schedstat, it is estimated from the thread's involuntary context switches
(``getrusage(RUSAGE_THREAD).ru_nivcsw``), ``SWITCH_ALLOWANCE_NS`` each.

A hook that waits for kvx's own threads by design (``shutdown`` joins the driver thread and the
copy threads) also excuses their run-queue wait meanwhile (``ThreadWaits``): time they were
runnable but not running, never time they slept.

For diagnosis each interval also says how much of it the thread ran on a CPU, how long it spent
in Python's garbage collector and how many major page faults it took (the rest of its time it
slept: on a lock, the GIL, the disk)."""

from __future__ import annotations

import gc
import inspect
import os
import resource
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

TICK_NS = 1_000_000  # kvx_core::TICK
ALLOWANCE_NS = 50_000_000
BOUND_NS = TICK_NS + ALLOWANCE_NS
# The fallback's excuse per involuntary switch: a few scheduler slices of a loaded 2-core machine.
SWITCH_ALLOWANCE_NS = 20_000_000


class _GcTime:
    """Time this process spent in Python's garbage collector so far (ns)."""

    def __init__(self) -> None:
        self.total_ns = 0
        self._start = 0
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter_ns()
        else:
            self.total_ns += time.perf_counter_ns() - self._start


_GC = _GcTime()


def _has_schedstat() -> bool:
    try:
        with open("/proc/thread-self/schedstat") as f:
            return len(f.read().split()) >= 2
    except OSError:
        return False


SCHEDSTAT = _has_schedstat()
SOURCE = (
    "run-queue wait from /proc/thread-self/schedstat"
    if SCHEDSTAT
    else f"involuntary switches (getrusage RUSAGE_THREAD) x {SWITCH_ALLOWANCE_NS // 1_000_000} ms"
)


def _read_runq(path: str) -> int:
    fd = os.open(path, os.O_RDONLY)
    try:
        return int(os.read(fd, 128).split()[1])
    finally:
        os.close(fd)


_OWN: dict[int, int] = {}  # thread id -> its open schedstat (no file opened per reading)


def _own_runq() -> int:
    tid = threading.get_native_id()
    fd = _OWN.get(tid)
    if fd is None:
        fd = _OWN[tid] = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
    return int(os.pread(fd, 128, 0).split()[1])


@dataclass(frozen=True)
class Times:
    """The calling thread's clocks at one moment, or (a difference) over an interval (ns)."""

    wall: int
    runq: int  # waiting on a run queue (the fallback's estimate without schedstat)
    cpu: int  # running on a CPU
    gc: int  # in Python's garbage collector (this process)
    faults: int  # major page faults (waits for the disk)

    @staticmethod
    def now() -> Times:
        ru = resource.getrusage(resource.RUSAGE_THREAD)
        runq = _own_runq() if SCHEDSTAT else ru.ru_nivcsw * SWITCH_ALLOWANCE_NS
        return Times(time.perf_counter_ns(), runq, time.thread_time_ns(), _GC.total_ns, ru.ru_majflt)

    def __sub__(self, other: Times) -> Times:
        return Times(self.wall - other.wall, self.runq - other.runq, self.cpu - other.cpu,
                     self.gc - other.gc, self.faults - other.faults)

    def describe(self) -> dict[str, float]:
        """Its parts in ms (slept: neither running nor runnable), for a report."""
        return {
            "wall_ms": self.wall / 1e6, "runq_ms": self.runq / 1e6, "cpu_ms": self.cpu / 1e6,
            "slept_ms": (self.wall - self.runq - self.cpu) / 1e6, "gc_ms": self.gc / 1e6, "faults": self.faults,
        }


def runq_ns() -> int:
    """The calling thread's run-queue wait so far, in ns."""
    return Times.now().runq


def thread_sched_ns(tid: int) -> tuple[int, int]:
    """Another thread of this process: (time on a CPU, time on a run queue) so far, in ns;
    (0, 0) without schedstat or once it ended."""
    if not SCHEDSTAT:
        return 0, 0
    try:
        with open(f"/proc/self/task/{tid}/schedstat") as f:
            cpu, runq = f.read().split()[:2]
        return int(cpu), int(runq)
    except (OSError, IndexError, ValueError):
        return 0, 0


_TICK_NS = 1_000_000_000 // os.sysconf("SC_CLK_TCK")


def steal_ns() -> list[int]:
    """Each CPU's steal time so far (the hypervisor ran something else on it; the 8th field of
    /proc/stat, in ticks), in ns; empty where the kernel does not say."""
    try:
        with open("/proc/stat") as f:
            rows = [line.split() for line in f if line.startswith("cpu") and line[3:4].isdigit()]
        return [int(r[8]) * _TICK_NS for r in rows if len(r) > 8]
    except (OSError, ValueError):
        return []


def threads_named(prefix: str) -> set[int]:
    """Thread ids of this process whose name starts with ``prefix``."""
    out = set()
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().startswith(prefix):
                    out.add(int(tid))
        except OSError:
            continue
    return out


class ThreadWaits:
    """The run-queue wait of this process's threads named ``prefix`` (those alive now) until
    ``stop``: a sampling thread reads each one's schedstat every ``period_s`` while the call
    being timed releases the GIL. A thread that exits keeps its last sample: its wait after
    that sample is not counted (so never excused). Without schedstat: 0."""

    def __init__(self, prefix: str, period_s: float = 0.0005):
        self.fds: dict[int, int] = {}
        if SCHEDSTAT:
            for tid in threads_named(prefix):
                try:
                    self.fds[tid] = os.open(f"/proc/self/task/{tid}/schedstat", os.O_RDONLY)
                except OSError:
                    continue
        self.last: dict[int, int] = {}
        self._sample()
        self.first = dict(self.last)
        self._period = period_s
        self._stop = threading.Event()
        self._sampler = threading.Thread(target=self._run, name="hook-clock-sampler", daemon=True)
        self._sampler.start()

    def _run(self) -> None:
        while not self._stop.wait(self._period):
            self._sample()

    def _sample(self) -> None:
        for tid, fd in list(self.fds.items()):
            try:
                self.last[tid] = int(os.pread(fd, 128, 0).split()[1])
            except (OSError, IndexError, ValueError):  # it exited
                os.close(fd)
                del self.fds[tid]

    def stop(self) -> int:
        """Their run-queue wait since the start, summed (ns)."""
        self._stop.set()
        self._sampler.join()
        self._sample()
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()
        return sum(self.last[t] - self.first[t] for t in self.first if t in self.last)


@dataclass
class Call:
    """One timed hook call."""

    hook: str  # "scheduler.build_connector_meta", "worker.wait_for_save[451 ms]" (another bound)
    at: float  # monotonic time it started
    took: Times
    bound_ns: int
    others_ns: int = 0  # run-queue wait of the kvx threads a joining hook waits for (excused)

    @property
    def unexcused_ns(self) -> int:
        return self.took.wall - self.took.runq - self.others_ns

    def __str__(self) -> str:
        t = self.took
        return (
            f"{self.hook} took {t.wall / 1e6:.2f} ms: {t.runq / 1e6:.2f} ms on a run queue, "
            f"{t.cpu / 1e6:.2f} ms on a CPU ({t.gc / 1e6:.2f} ms of it in the garbage collector), "
            f"{t.faults} major page faults; the threads it waited for {self.others_ns / 1e6:.2f} ms on "
            f"their run queues (bound {self.bound_ns / 1e6:.0f} ms + the run-queue waits)"
        )


@dataclass
class HookClock:
    """Times every public method of the connector instances it wraps."""

    calls: list[Call] = field(default_factory=list)

    def wrap(self, obj: Any, side: str, bound_ns: Callable[[str], int] = lambda hook: BOUND_NS,
             joins: frozenset[str] = frozenset()) -> list[str]:
        """Replace each public method of ``obj`` (its class's plain functions, inherited ones
        included) by a timed one on the instance; ``bound_ns(name)`` is the bound of a call
        made now; the methods in ``joins`` wait for kvx's threads (``ThreadWaits``). Returns
        the names wrapped."""
        names = []
        for name in dir(type(obj)):
            if name.startswith("_") or not inspect.isfunction(inspect.getattr_static(type(obj), name)):
                continue
            setattr(obj, name, self._timed(f"{side}.{name}", name, getattr(obj, name), bound_ns, name in joins))
            names.append(name)
        return names

    def _timed(self, hook: str, name: str, method: Callable, bound_ns: Callable[[str], int], joins: bool) -> Callable:
        def timed(*args: Any, **kwargs: Any) -> Any:
            bound = bound_ns(name)
            others = ThreadWaits("kvx-") if joins else None
            at = time.monotonic()
            t0 = Times.now()
            try:
                return method(*args, **kwargs)
            finally:
                took = Times.now() - t0
                waited = others.stop() if others is not None else 0
                # A call held to another bound is reported apart: "worker.wait_for_save[451 ms]".
                named = hook if bound == BOUND_NS else f"{hook}[{bound / 1e6:.0f} ms]"
                self.calls.append(Call(named, at, took, bound, waited))

        return timed

    def over_bound(self) -> list[Call]:
        """Calls that took longer than their bound plus the run-queue waits they excuse."""
        return [c for c in self.calls if c.unexcused_ns > c.bound_ns]

    def worst(self) -> dict[str, dict[str, float]]:
        """Per hook: calls, worst wall time, worst run-queue wait, and the parts (ms) of the
        call with the most unexcused time."""
        out: dict[str, dict[str, float]] = {}
        worst: dict[str, Call] = {}
        for c in self.calls:
            w = out.setdefault(c.hook, {"calls": 0, "max_wall_ms": 0.0, "max_runq_ms": 0.0})
            w["calls"] += 1
            w["max_wall_ms"] = max(w["max_wall_ms"], c.took.wall / 1e6)
            w["max_runq_ms"] = max(w["max_runq_ms"], c.took.runq / 1e6)
            if c.hook not in worst or c.unexcused_ns > worst[c.hook].unexcused_ns:
                worst[c.hook] = c
        for hook, c in worst.items():
            out[hook].update(c.took.describe(), unexcused_ms=c.unexcused_ns / 1e6, others_ms=c.others_ns / 1e6)
        return out
