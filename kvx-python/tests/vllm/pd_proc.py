"""The tests' end of ``pd_engine.py``: spawn one engine process, send it commands, wait for its
events, signal it (SIGKILL, SIGSTOP, SIGCONT), and always end it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from harness import write_model_dir

ENGINE = Path(__file__).with_name("pd_engine.py")
START_TIMEOUT = 120.0  # importing vLLM and torch on a busy 2-core machine


class ProcessError(AssertionError):
    """The engine process reported an error or died; carries its traceback or log tail."""


class EngineProc:
    """One ``pd_engine.py`` process and its event stream."""

    def __init__(self, name: str, tmp: Path, cfg: dict, prefix: Sequence[str] = ()):
        """Spawn it (``prefix``: e.g. ``ip netns exec NS``); ``ready()`` waits for it to start."""
        self.name = name
        self.log = tmp / f"{name}.log"
        # One model directory for every engine of a test (its path is part of kvx's namespace).
        cfg = {"tmp": str(write_model_dir(tmp).parent), **cfg}
        self._log = open(self.log, "wb")
        self.proc = subprocess.Popen(
            [*prefix, sys.executable, str(ENGINE), json.dumps(cfg)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            start_new_session=True,
        )
        self.events: list[dict] = []
        self._cv = threading.Condition()
        self._eof = False
        threading.Thread(target=self._read, daemon=True).start()

    def ready(self) -> EngineProc:
        """Wait until the engine runs (importing vLLM takes seconds)."""
        ev = self.wait("ready", timeout=START_TIMEOUT)
        # `ip netns exec` execs the command: the engine is the process we spawned.
        assert ev["pid"] == self.proc.pid, (ev, self.proc.pid)
        return self

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            ev = json.loads(line)
            with self._cv:
                self.events.append(ev)
                self._cv.notify_all()
        with self._cv:
            self._eof = True
            self._cv.notify_all()

    def log_tail(self, n: int = 4000) -> str:
        """The end of the process's log (stderr)."""
        try:
            return self.log.read_bytes()[-n:].decode(errors="replace")
        except OSError:
            return ""

    # -- commands ---------------------------------------------------------------------------
    def send(self, cmd: str, **kw) -> None:
        """Send one command."""
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps({"cmd": cmd, **kw}) + "\n").encode())
        self.proc.stdin.flush()

    def add(self, rid: str, prompt: list[int], max_tokens: int = 2, params=None) -> None:
        """Queue a request (``params``: its kv_transfer_params)."""
        self.send("add", id=rid, prompt=prompt, max_tokens=max_tokens, params=params)

    # -- events -----------------------------------------------------------------------------
    def find(self, ev: str, rid: str | None = None) -> list[dict]:
        """Events of kind ``ev`` so far (of request ``rid`` if given)."""
        with self._cv:
            return [e for e in self.events if e["ev"] == ev and (rid is None or e.get("id") == rid)]

    def wait(
        self,
        ev: str,
        rid: str | None = None,
        timeout: float = 30.0,
        pred: Callable[[dict], bool] | None = None,
        after: int = 0,
    ) -> dict:
        """The first event of kind ``ev`` (of ``rid``, matching ``pred``) at index ``after`` or
        later; raises with the process's log when it does not come in ``timeout`` seconds or
        the process reports an error."""
        end = time.monotonic() + timeout
        with self._cv:
            while True:
                for e in self.events[after:]:
                    if e["ev"] == "error":
                        raise ProcessError(f"{self.name} failed:\n{e['trace']}")
                    if e["ev"] == ev and (rid is None or e.get("id") == rid) and (pred is None or pred(e)):
                        return e
                left = end - time.monotonic()
                if self._eof or left <= 0:
                    why = "exited" if self._eof else f"no {ev} event for {rid} in {timeout}s"
                    raise ProcessError(f"{self.name}: {why}; log tail:\n{self.log_tail()}")
                self._cv.wait(min(left, 0.5))

    def state(self, timeout: float = 30.0) -> dict:
        """The engine's state report (``state``, ``idle``, ``verified``, ``full_collections``)."""
        n = len(self.events)
        self.send("state")
        return self.wait("state", timeout=timeout, after=n)

    def wait_idle(self, timeout: float = 30.0) -> dict:
        """Poll the state until both the scheduler and kvx are idle; raise with the last state."""
        end = time.monotonic() + timeout
        while True:
            st = self.state()
            if st["idle"]:
                return st
            if time.monotonic() > end:
                raise AssertionError(f"{self.name} not idle after {timeout}s: {st['state']}")
            time.sleep(0.05)

    # -- signals and ending -----------------------------------------------------------------
    def signal(self, sig: int) -> float:
        """Send ``sig``; returns the monotonic time just before it was sent (the process may
        act on it before ``os.kill`` returns)."""
        t = time.monotonic()
        os.kill(self.proc.pid, sig)
        return t

    def kill(self) -> float:
        """SIGKILL, and reap it."""
        t = self.signal(signal.SIGKILL)
        self.proc.wait(10)
        return t

    def stop(self) -> float:
        """SIGSTOP."""
        return self.signal(signal.SIGSTOP)

    def cont(self) -> float:
        """SIGCONT."""
        return self.signal(signal.SIGCONT)

    def close(self, timeout: float = 10.0) -> int | None:
        """End the process: ``stop`` command, else SIGKILL after ``timeout``; its exit code."""
        if self.proc.poll() is None:
            try:
                os.kill(self.proc.pid, signal.SIGCONT)
                self.send("stop")
                self.proc.stdin.close()  # type: ignore[union-attr]
            except OSError:
                pass
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._log.close()
        return self.proc.returncode
