"""The test's end of an engine process (engine_main.py): start it, send commands, read results.

Every engine process of the suite gets the same environment: no model hub, and
``VLLM_CPU_NUM_OF_RESERVED_CPU=1`` so that an engine with a KV connector (for which vLLM
reserves one more core) and one without run their forward passes on the same number of
threads, the same arithmetic; and a vLLM cache directory of the venv's own
(``VLLM_CACHE_ROOT``): vLLM keeps one model-inspection file per model class there, keyed by
its source's hash, so another vLLM version sharing the default directory (the 0.33 venv's
tests) overwrites it, and each engine start then inspects the model again in a process of
its own (tens of seconds here). engine-venv.sh fills it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from quiet import QUIET

HERE = Path(__file__).parent
# ci.sh: nothing here may skip.
REQUIRED = os.environ.get("KVX_ENGINE_REQUIRED") == "1"
START_TIMEOUT_S = 600.0
COMMAND_TIMEOUT_S = 300.0


def vllm_cache_root() -> str:
    return str(Path(sys.prefix) / "kvx-vllm-cache")


def engine_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        {
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "VLLM_DO_NOT_TRACK": "1",
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "1",
            "PYTHONUNBUFFERED": "1",
        }
    )
    env["VLLM_CACHE_ROOT"] = vllm_cache_root()
    # The KV cache size is the engine's argument, not the legacy variable.
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    return env


def skip_or_fail(reason: str) -> None:
    """A check that cannot run here: one skip line, or a failure where nothing may skip."""
    import pytest

    if REQUIRED:
        pytest.fail(f"{reason} (KVX_ENGINE_REQUIRED=1: nothing may skip)")
    print(f"skip: {reason}")
    pytest.skip(reason)


def stacks(pgid: int) -> str:
    """Every Python thread's stack of each process in the group, by
    py-spy where this venv has it: what a hung engine was doing."""
    spy = Path(sys.prefix) / "bin" / "py-spy"
    if not spy.exists():
        return "(no py-spy in this venv: no stacks)"
    pids = subprocess.run(["pgrep", "-g", str(pgid)], check=False, capture_output=True, text=True).stdout.split()
    out = []
    for pid in pids:
        try:
            dump = [str(spy), "dump", "--pid", pid]
            r = subprocess.run(dump, check=False, capture_output=True, text=True, timeout=30)
            out.append(f"--- pid {pid}\n{r.stdout}{r.stderr}")
        except subprocess.TimeoutExpired:
            out.append(f"--- pid {pid}: py-spy timed out")
    return "\n".join(out)


def log_tail(path: Path, lines: int = 60) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as e:
        return f"(no log: {e})"


# ``vllm.LLM``'s engine core in the engine process itself (vLLM's InprocClient); the worker,
# with kvx's worker side, stays a process of its own, so the step metadata still crosses a
# process boundary. A start then spawns one interpreter fewer: about 30 s less here, of the
# ~60 s a start took. ``vllm serve`` (server.py) keeps vLLM's default, a separate engine core,
# and so does an engine whose connector must go on stepping between ``generate`` calls.
IN_PROCESS_CORE = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


_stopping: list[threading.Thread] = []


def wait_stopped() -> None:
    """Until every engine ``Engine.stop`` stopped has exited."""
    while _stopping:
        _stopping.pop().join()


class Engine:
    """One engine process; ``start`` returns at once, ``ready`` waits for the engine."""

    def __init__(self, name: str, tmp: Path, cfg: dict, cpu: str | None = None, core_process: bool = False):
        """``cpu``: the core its worker's one compute thread is bound to (vLLM's
        ``VLLM_CPU_OMP_THREADS_BIND``); ``None``: vLLM's own choice (the first core).
        ``core_process``: the engine core in a process of its own, stepping in its busy loop
        between ``generate`` calls too (an in-process core steps only inside them)."""
        self.name = name
        self.log = tmp / f"{name}.log"
        self.began = time.monotonic()
        self.started_s: float | None = None
        self.stopped_s: float | None = None
        self._log = open(self.log, "w")
        # Held until the engine is ready (or killed): a start takes the cores for tens of seconds.
        self._starting = QUIET.hold(f"engine {name}: start")
        self.p = subprocess.Popen(
            [sys.executable, str(HERE / "engine_main.py"), json.dumps(cfg)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env=engine_env()
            | ({} if core_process else IN_PROCESS_CORE)
            | ({} if cpu is None else {"VLLM_CPU_OMP_THREADS_BIND": cpu}),
            cwd=str(tmp),
            start_new_session=True,
        )
        self._ready = False

    def _read(self, timeout: float) -> dict:
        import select

        assert self.p.stdout is not None
        end = time.monotonic() + timeout
        while True:
            left = end - time.monotonic()
            if left <= 0:
                raise AssertionError(
                    f"{self.name}: no answer in {timeout}s\n{log_tail(self.log)}\n{stacks(self.p.pid)}"
                )
            r, _, _ = select.select([self.p.stdout], [], [], min(left, 1.0))
            if r:
                line = self.p.stdout.readline()
                if not line:
                    code = self.p.wait()
                    raise AssertionError(f"{self.name}: exited {code}\n{log_tail(self.log)}")
                out = json.loads(line)
                if not out.get("ok"):
                    raise AssertionError(f"{self.name}: {out.get('error')}\n{log_tail(self.log)}")
                return out

    def ready(self) -> Engine:
        if not self._ready:
            try:
                out = self._read(START_TIMEOUT_S)
            finally:
                self._starting.release()
            self.started_s = time.monotonic() - self.began
            self._ready = True
            print(f"engine {self.name}: ready in {self.started_s:.1f}s (LLM() {out['started_s']:.1f}s)")
        return self

    def send(self, do: str, **kw: Any) -> dict:
        with QUIET.busy(f"engine {self.name}: {do}"):
            self.ready()
            assert self.p.stdin is not None
            self.p.stdin.write(json.dumps({"do": do, **kw}) + "\n")
            self.p.stdin.flush()
            return self._read(COMMAND_TIMEOUT_S)

    def generate(self, prompts: list[list[int]], max_tokens: int, params: list | None = None) -> dict:
        return self.send("generate", prompts=prompts, max_tokens=max_tokens, params=params)

    def stop(self) -> None:
        """Stop the engine (vLLM's engine-core shutdown) in the background: vLLM waits 5 s
        for its worker before it kills it, time the next engine's start need not wait for.
        ``wait_stopped`` waits for every engine stopped so."""
        t = threading.Thread(target=self._stop, name=f"stop-{self.name}", daemon=True)
        t.start()
        _stopping.append(t)

    def _stop(self) -> None:
        with QUIET.busy(f"engine {self.name}: stop"):
            try:
                if self.p.poll() is None:
                    out = self.send("stop")
                    self.stopped_s = out.get("stopped_s")
                    self.p.wait(timeout=60)
            except (AssertionError, subprocess.TimeoutExpired) as e:
                print(f"engine {self.name}: stop: {e}")
            finally:
                self.kill()
                self._log.close()

    def kill(self) -> None:
        """SIGKILL this engine's process group (its engine core and worker too)."""
        self._starting.release()
        try:
            os.killpg(self.p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.p.wait()
