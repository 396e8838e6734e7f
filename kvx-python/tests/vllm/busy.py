"""A busy machine: processes that spin on every core for a bounded time, so that a test's
threads compete for the CPU with more runnable threads than there are cores."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator

# Each spinner ends by itself after its lifetime, even if nothing kills it.
_SPIN = "import sys, time\nend = time.monotonic() + float(sys.argv[1])\nwhile time.monotonic() < end:\n    pass\n"


@contextlib.contextmanager
def spinners(per_core: int = 2, lifetime_s: float = 120.0) -> Iterator[int]:
    """``per_core`` spinning processes per core (``os.cpu_count()``), each ending by itself after
    ``lifetime_s`` at the latest; killed (and reaped) on exit. Yields how many run."""
    n = per_core * (os.cpu_count() or 1)
    procs = [
        subprocess.Popen([sys.executable, "-c", _SPIN, str(lifetime_s)], stdin=subprocess.DEVNULL)
        for _ in range(n)
    ]
    try:
        yield n
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()
