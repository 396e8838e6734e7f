"""One real vLLM engine (``vllm.LLM`` on vLLM's CPU platform: its engine core in this
process, its worker process, real forward passes of the test model) driven by JSON lines on stdin, one
result line on stdout per command (``engine.Engine`` is the other end).

Run as ``python engine_main.py CONFIG_JSON``. CONFIG_JSON: ``model`` (a directory), ``kvx``
(null: no connector; else ``role``, ``policy``, ``extra``: the connector's extra config),
``num_blocks`` (the engine's KV cache in blocks; null: 64 MiB of blocks), ``mount`` (null, or
``mnt`` and ``backing``: serve a kvx.testing.FrozenMount from this process).

Commands: ``generate`` (``prompts``, ``max_tokens``, optional ``params``: kv_transfer_params per
prompt), ``reset`` (``connector``: LLM.reset_prefix_cache's reset_connector), ``freeze``,
``thaw``, ``corrupt`` (``root``: overwrite part of the payload of every block file under it),
``copy`` (``src``, ``dst``: a copy of a file tier), ``wait_files`` (``root``, ``count``:
until exactly that many block files are there), ``stop``.

Each ``generate`` result holds the output token ids and finish reasons, its wall time, and
what vLLM itself counted meanwhile: the Prometheus counters of ``LLM.get_metrics()`` (prefix
cache and external prefix cache queries and hits, cached prompt tokens by source, preemptions)
and, from the scheduler's stats, the connector hits of requests resumed after a preemption
(vLLM counts those apart and exports them nowhere).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
import traceback
from pathlib import Path
from typing import Any

# Results go to the original stdout; anything else written to fd 1 (vLLM's logs) goes to
# stderr, so the result stream holds only results.
_RESULTS = os.fdopen(os.dup(1), "w", buffering=1)
os.dup2(2, 1)
sys.stdout = sys.stderr

import settings  # noqa: E402
from counters import read_counts  # noqa: E402
from tier import block_files, corrupt, wait_files  # noqa: E402


def emit(**kw: Any) -> None:
    _RESULTS.write(json.dumps(kw) + "\n")


class Counts:
    """vLLM's Prometheus counters, read through ``LLM.get_metrics()``."""

    def __init__(self, llm: Any):
        self.llm = llm

    def read(self) -> dict[str, float]:
        return read_counts(self.llm)


class ResumedHits:
    """A stat logger beside vLLM's own: adds up the connector hits vLLM's scheduler recorded
    for requests resumed after a preemption (``PrefixCacheStats.preempted_hits``)."""

    def __init__(self) -> None:
        self.hits = 0
        self.requests = 0

    def record(self, scheduler_stats: Any, iteration_stats: Any, **_: Any) -> None:
        s = getattr(scheduler_stats, "connector_prefix_cache_stats", None)
        if s is not None:
            self.hits += s.preempted_hits
            self.requests += s.preempted_requests

    def log(self) -> None:
        pass

    def log_engine_initialized(self) -> None:
        pass

    def record_sleep_state(self, *_: Any) -> None:
        pass


def main() -> int:
    cfg = json.loads(sys.argv[1])
    mount = None
    if cfg.get("mount"):
        from kvx.testing import FrozenMount

        mount = FrozenMount(cfg["mount"]["mnt"], cfg["mount"]["backing"])

    from vllm.entrypoints.llm import LLM
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import SamplingParams

    t0 = time.monotonic()
    llm = LLM(**settings.llm_args(cfg["model"], cfg.get("kvx"), cfg.get("num_blocks")))
    resumed = ResumedHits()
    # vLLM's StatLoggerManager hands every step's SchedulerStats to each of its loggers.
    llm.llm_engine.logger_manager.stat_loggers.append(resumed)
    counts = Counts(llm)
    emit(ok=True, started_s=time.monotonic() - t0, pid=os.getpid())

    def generate(c: dict) -> dict:
        params = c.get("params") or [None] * len(c["prompts"])
        sps = []
        for p in params:
            sp = SamplingParams(temperature=0.0, max_tokens=c["max_tokens"], ignore_eos=True)
            if p is not None:
                sp.extra_args = {"kv_transfer_params": p}
            sps.append(sp)
        before, resumed_before = counts.read(), (resumed.hits, resumed.requests)
        t = time.monotonic()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in c["prompts"]], sps, use_tqdm=False)
        seconds = time.monotonic() - t
        after = counts.read()
        return {
            "tokens": [list(o.outputs[0].token_ids) for o in outs],
            "finish": [o.outputs[0].finish_reason for o in outs],
            "cached": [o.num_cached_tokens for o in outs],
            "params": [o.kv_transfer_params for o in outs],
            "seconds": seconds,
            "counts": {k: after.get(k, 0) - before.get(k, 0) for k in after},
            "resumed_hits": resumed.hits - resumed_before[0],
            "resumed_requests": resumed.requests - resumed_before[1],
            "blocked": mount.blocked_requests() if mount is not None else None,
        }

    try:
        for raw in sys.stdin:
            if not raw.strip():
                continue
            c = json.loads(raw)
            do = c["do"]
            try:
                if do == "stop":
                    break
                if do == "generate":
                    r = generate(c)
                elif do == "reset":
                    r = {"reset": llm.reset_prefix_cache(reset_connector=c.get("connector", False))}
                elif do == "freeze":
                    assert mount is not None
                    mount.freeze()
                    r = {}
                elif do == "thaw":
                    assert mount is not None
                    mount.thaw()
                    r = {}
                elif do == "corrupt":
                    r = {"files": corrupt(Path(c["root"]))}
                elif do == "copy":
                    shutil.copytree(c["src"], c["dst"])
                    r = {"files": len(block_files(Path(c["dst"])))}
                elif do == "wait_files":
                    r = {"files": wait_files(Path(c["root"]), c["count"])}
                else:
                    raise ValueError(f"unknown command {do!r}")
                emit(ok=True, **r)
            except Exception:
                emit(ok=False, error=traceback.format_exc())
    finally:
        if mount is not None:
            mount.thaw()
        t = time.monotonic()
        llm.llm_engine.engine_core.shutdown()
        shut = time.monotonic() - t
        if mount is not None:
            mount.close()
        emit(ok=True, stopped_s=shut)
    return 0


if __name__ == "__main__":
    code = 1
    try:
        code = main()
    except BaseException:
        emit(ok=False, error=traceback.format_exc())
    _RESULTS.flush()
    os._exit(code)
