"""Phases whose times a test compares run with the rest of the suite paused.

Two scenarios run at once on the machine's 2 cores (conftest.py, ``KVX_ENGINE_JOBS``), so a
``generate`` beside another engine's start or forward passes takes 2-4 times as long as the same
``generate`` alone: measured from each thread's run-queue wait (``/proc/<pid>/task/*/schedstat``),
the engine's two busy threads waited 6.3 s of an 8.4 s ``generate`` for a core. A bound of the
form "the frozen run's time <= the unfrozen run's time + the load deadline + a margin" compares
two such times, so both run ``alone``: every other engine of the suite is then between commands
(idle: vLLM's workers stop spinning after 1 s without work) and none is starting or stopping.

Every engine start (until ready), command and stop holds the suite ``busy``; ``alone`` waits
for every other thread's holds to end and keeps new ones out until it ends. A thread that holds
already (an engine it started that is not ready yet) may take more: it cannot wait for itself.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

ALONE_WAIT_S = 600.0


class Hold:
    """One start, command or stop in progress; ``release`` is idempotent."""

    def __init__(self, quiet: Quiet, thread: int, what: str):
        self.quiet, self.thread, self.what = quiet, thread, what
        self.released = False

    def release(self) -> None:
        self.quiet._release(self)


class Quiet:
    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._holds: list[Hold] = []
        self._alone: int | None = None  # the thread running alone
        self._wanted = 0  # threads waiting to run alone

    def hold(self, what: str) -> Hold:
        me = threading.get_ident()
        with self._cv:
            while not self._may_hold(me):
                self._cv.wait()
            h = Hold(self, me, what)
            self._holds.append(h)
            return h

    @contextlib.contextmanager
    def busy(self, what: str) -> Iterator[None]:
        h = self.hold(what)
        try:
            yield
        finally:
            h.release()

    @contextlib.contextmanager
    def alone(self) -> Iterator[None]:
        """Until the block ends, no other thread's start, command or stop runs."""
        me = threading.get_ident()
        end = time.monotonic() + ALONE_WAIT_S
        with self._cv:
            self._wanted += 1
            try:
                while self._alone is not None or any(h.thread != me for h in self._holds):
                    left = end - time.monotonic()
                    if left <= 0:
                        others = [h.what for h in self._holds if h.thread != me]
                        raise AssertionError(f"not alone after {ALONE_WAIT_S}s: still {others}")
                    self._cv.wait(left)
            finally:
                self._wanted -= 1
                self._cv.notify_all()
            self._alone = me
        try:
            yield
        finally:
            with self._cv:
                self._alone = None
                self._cv.notify_all()

    def _may_hold(self, me: int) -> bool:
        if self._alone is not None:
            return self._alone == me
        # A thread waits to run alone: only threads that hold already go on.
        return not self._wanted or any(h.thread == me for h in self._holds)

    def _release(self, h: Hold) -> None:
        with self._cv:
            if not h.released:
                h.released = True
                self._holds.remove(h)
                self._cv.notify_all()


# The suite's one instance: engine.py and server.py hold it, tests run their timed phases alone.
QUIET = Quiet()
