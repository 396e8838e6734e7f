"""The test's end of a ``vllm serve`` process (serve_main.py): start it on a free port of
127.0.0.1, send OpenAI completions requests with token-id prompts, read ``/metrics``, stop it
with a signal."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import settings
from engine import HERE, engine_env, log_tail
from ports import free_port
from quiet import QUIET

START_TIMEOUT_S = 600.0
REQUEST_TIMEOUT_S = 120.0
# /metrics counter -> this suite's name (the engine_main.py names).
COUNTERS = {
    "vllm:prefix_cache_hits_total": "local_hits",
    "vllm:external_prefix_cache_queries_total": "external_queries",
    "vllm:external_prefix_cache_hits_total": "external_hits",
    "vllm:num_preemptions_total": "preemptions",
    # kvx's own counters in vLLM's /metrics (the connector's build_prom_metrics), all tiers.
    "vllm:kvx_loaded_blocks_total": "kvx_loaded_blocks",
    "vllm:kvx_load_failed_blocks_total": "kvx_load_failed_blocks",
}
BY_SOURCE = "vllm:prompt_tokens_cached_by_source_total"


# How long a process of the server's group (its engine core and worker, where kvx's driver
# runs) may outlive the server: teardown and reaping on a loaded 2-core machine.
OUTLIVE_S = 2.0


def group_members(pgid: int) -> list[str]:
    """The live processes of a process group ("pid name"), zombies left out."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        # pid (comm) state ppid pgrp ...: comm may hold spaces, so split after its ')'.
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        state, _ppid, pgrp = stat[stat.rindex(")") + 2 :].split()[:3]
        if int(pgrp) == pgid and state != "Z":
            out.append(f"{entry} {name}")
    return out


def outliving(pgid: int, within: float) -> list[str]:
    """The processes of the group still alive ``within`` seconds from now (none: at once)."""
    end = time.monotonic() + within
    while True:
        left = group_members(pgid)
        if not left or time.monotonic() >= end:
            return left
        time.sleep(0.05)


def parse_metrics(text: str) -> dict[str, float]:
    """The suite's counters from Prometheus text: summed over label sets; cached prompt tokens
    by source as ``cached_<source>``."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        name, _, labels = head.partition("{")
        if name in COUNTERS:
            key = COUNTERS[name]
        elif name == BY_SOURCE:
            source = labels.split('source="', 1)[1].split('"', 1)[0]
            key = f"cached_{source}"
        else:
            continue
        out[key] = out.get(key, 0.0) + float(value)
    return out


class Server:
    """One ``vllm serve`` process, in a process group of its own (its engine core and worker
    are in it too)."""

    def __init__(self, name: str, tmp: Path, model: str, kvx: dict | None, drain_s: int | None = None):
        """``drain_s``: vLLM's ``--shutdown-timeout`` (drain mode: the engine core stops its
        workers, whose ``shutdown()`` runs the connector's); ``None``: vLLM's default, abort."""
        self.name, self.model = name, model
        self.port = free_port()
        args = settings.serve_args(model, kvx, self.port)
        if drain_s is not None:
            args += ["--shutdown-timeout", str(drain_s)]
        self.log = tmp / f"{name}.log"
        self._log = open(self.log, "w")
        self.began = time.monotonic()
        # Held until the server is ready (or killed), as an engine's start (quiet.py).
        self._starting = QUIET.hold(f"server {name}: start")
        self.p = subprocess.Popen(
            [sys.executable, str(HERE / "serve_main.py"), *args],
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=engine_env(),
            cwd=str(tmp),
            start_new_session=True,
        )
        self.started_s: float | None = None

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def ready(self) -> Server:
        try:
            return self._wait_ready()
        finally:
            self._starting.release()

    def _wait_ready(self) -> Server:
        end = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < end:
            if self.p.poll() is not None:
                raise AssertionError(f"{self.name}: exited {self.p.returncode}\n{log_tail(self.log)}")
            try:
                with urllib.request.urlopen(self.url("/health"), timeout=5) as r:
                    if r.status == 200:
                        self.started_s = time.monotonic() - self.began
                        print(f"server {self.name}: ready in {self.started_s:.1f}s")
                        return self
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        raise AssertionError(f"{self.name}: not ready in {START_TIMEOUT_S}s\n{log_tail(self.log)}")

    def complete(self, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
        """One completions request with these token-id prompts (greedy, no early stop)."""
        body = {
            "model": self.model,
            "prompt": prompts,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        req = urllib.request.Request(
            self.url("/v1/completions"),
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        t = time.monotonic()
        with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as r:
            out = json.loads(r.read())
        choices = sorted(out["choices"], key=lambda c: c["index"])
        return {
            "tokens": [c["token_ids"] for c in choices],
            "finish": [c["finish_reason"] for c in choices],
            "seconds": time.monotonic() - t,
        }

    def metrics(self) -> dict[str, float]:
        with urllib.request.urlopen(self.url("/metrics"), timeout=REQUEST_TIMEOUT_S) as r:
            return parse_metrics(r.read().decode())

    def generate(self, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
        """``complete``, with what vLLM's /metrics counted meanwhile (``counts``)."""
        with QUIET.busy(f"server {self.name}: generate"):
            before = self.metrics()
            out = self.complete(prompts, max_tokens)
            after = self.metrics()
        out["counts"] = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
        return out

    def stop(self, sig: signal.Signals, group: bool, timeout: float) -> dict[str, Any]:
        """Send ``sig`` (to the whole process group, as a terminal's Ctrl-C does, or to the
        server process alone, as a container stop does) and wait for the server to exit; the
        group is killed after ``timeout``. Returns the exit code, the seconds until exit, and
        what the server printed."""
        with QUIET.busy(f"server {self.name}: stop"):
            t = time.monotonic()
            if group:
                os.killpg(self.p.pid, sig)
            else:
                self.p.send_signal(sig)
            try:
                code: int | None = self.p.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                code = None
            took = time.monotonic() - t
            left = outliving(self.p.pid, OUTLIVE_S)
            self.kill()
        self._log.close()
        return {"code": code, "seconds": took, "left": left, "output": self.log.read_text(errors="replace")}

    def kill(self) -> None:
        """SIGKILL whatever of the process group is left."""
        self._starting.release()
        try:
            os.killpg(self.p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.p.wait()
