"""What a KV connector costs vLLM per engine step: kvx's ``KvxConnector`` beside vLLM's own
``OffloadingConnector`` and no connector, same workload, same run.

vLLM's real v1 ``Scheduler`` and its worker-side connector driver (``ActiveKVConnector``) run on
CPU with a stand-in model (one layer, one KV head, head size 16: a 1 KiB block) whose forward
writes nothing into the KV cache and samples a fixed token: connector work and scheduling are
what is timed. vLLM's prefix cache is off, so every hit comes from the connector's host tier.

For each size N (running requests), each connector runs three phases:

- ``miss``: N requests over shared prefixes (prompts ``--min-prompt``..``--max-prompt`` tokens,
  groups of 8 sharing their first half) prefill; the tier is empty, so every lookup misses
  (every computed block is stored as well: neither connector can be told not to).
- ``store``: once every prompt is in, ``--decode`` steps of all N requests decoding (one token
  each per step); every block they complete is stored. (Requests whose prefill ended earlier
  decode meanwhile, in the ``miss`` steps, as under continuous batching.)
- ``hit``: N new requests whose prompts share all but the last eighth of the first N's prefill;
  the host tier holds those blocks, which are loaded (async), then the rest is computed.

Connectors: ``none``; ``offloading``, vLLM's ``OffloadingConnector`` with its CPU offloading
manager, whose worker is ``host_offload.HostOffloadingWorker`` (vLLM's refuses a machine without
CUDA; the stand-in copies blocks synchronously with torch on the CPU); ``kvx``; ``kvx-before``,
kvx with ``build_connector_meta`` as before the per-step cost fix (``kvx_before.py``).

Per step: the time inside each connector method on the scheduler side (called from
``schedule()``/``update_from_output()``) and on the worker side (called by ``ActiveKVConnector``),
the pickled size of the step's connector metadata, and the time of the whole ``schedule()`` +
``update_from_output()``. Median and p99 over the phase's steps.

    python kvx-python/bench/step_cost.py            # table
    python kvx-python/bench/step_cost.py --json     # the same numbers as JSON

Not part of the test suite (it runs for minutes).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pickle
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.distributed.kv_transfer import kv_transfer_state
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.gpu.kv_connector import ActiveKVConnector

BLOCK = 16
LAYERS = 1
KV_HEADS = 1
HEAD = 16
VOCAB = 1000
GROUP = 8  # requests sharing a prefix
BLOCK_BYTES = 2 * BLOCK * KV_HEADS * HEAD * 2 * LAYERS
ALIGN = CPUOffloadingSpec.BLOCK_SIZE_ALIGNMENT

SCHED_METHODS = (
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "update_connector_output",
    "request_finished",
    "request_finished_all_groups",
    "has_pending_block_frees",
    "get_external_cache_hit_sources",
    "get_kv_connector_stats",
    "take_events",
    "has_pending_push_work",
)
WORKER_METHODS = (
    "handle_preemptions",
    "bind_connector_metadata",
    "start_load_kv",
    "wait_for_layer_load",
    "save_kv_layer",
    "wait_for_save",
    "get_finished",
    "get_block_ids_with_load_errors",
    "build_connector_worker_meta",
    "get_kv_connector_stats",
    "clear_connector_metadata",
)
CONNECTORS = ("none", "offloading", "kvx-before", "kvx")

init_none_hash(sha256)
_HASHER = get_request_block_hasher(BLOCK, sha256)


def model_dir(root: Path, max_len: int) -> Path:
    """A config-only one-layer Llama (no weights, no tokenizer)."""
    d = root / "bench-llama"
    d.mkdir(parents=True, exist_ok=True)
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": KV_HEADS * HEAD,
        "intermediate_size": 64,
        "num_attention_heads": KV_HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD,
        "num_hidden_layers": LAYERS,
        "vocab_size": VOCAB,
        "max_position_embeddings": max_len,
        "torch_dtype": "float16",
        "rms_norm_eps": 1e-5,
    }
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def tokens(seed: int, n: int) -> list[int]:
    """``n`` deterministic token ids."""
    x = seed * 7919 + 17
    out = []
    for _ in range(n):
        x = (x * 1103515245 + 12345) & 0x7FFFFFFF
        out.append(x % (VOCAB - 10) + 5)
    return out


def prompts(n: int, lo: int, hi: int, salt: int) -> list[list[int]]:
    """``n`` prompts of ``lo``..``hi`` tokens (spread evenly); each group of ``GROUP`` shares
    the first half of its shortest prompt."""
    out = []
    for i in range(n):
        length = lo + (hi - lo) * ((i * 7919) % n) // max(n - 1, 1)
        g = i // GROUP
        shared = tokens(1_000_000 + g, lo // 2)
        out.append(shared + tokens(salt * 10_000_000 + i, length - len(shared)))
    return out


class Timed:
    """Replaces named methods of one object with wrappers adding their time to ``step``."""

    def __init__(self, obj: Any, names: tuple[str, ...]) -> None:
        self.step: dict[str, float] = defaultdict(float)
        self.offered: dict[str, int] = {}  # request id -> tokens its last lookup offered
        for name in names:
            fn = getattr(obj, name, None)
            if fn is not None and callable(fn):
                setattr(obj, name, self._wrap(name, fn))

    def _wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        acc = self.step
        clock = time.perf_counter

        offered = self.offered if name == "get_num_new_matched_tokens" else None

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = clock()
            try:
                out = fn(*args, **kwargs)
            finally:
                acc[name] += clock() - t0
            if offered is not None and out[0] is not None:
                offered[args[0].request_id] = out[0]
            return out

        return timed

    def take(self) -> dict[str, float]:
        """This step's times per method (and resets them)."""
        out = dict(self.step)
        self.step.clear()
        return out


class Bench:
    """One engine (scheduler, worker connector, stand-in model) with one connector kind."""

    def __init__(self, kind: str, tmp: Path, n: int, num_blocks: int, host_blocks: int, max_len: int,
                 batched_tokens: int) -> None:
        self.kind = kind
        model = ModelConfig(model=str(model_dir(tmp, max_len)), skip_tokenizer_init=True, dtype="float16",
                            max_model_len=max_len)
        ktc = None
        if kind in ("kvx", "kvx-before"):
            name, module = ("KvxConnector", "kvx.vllm") if kind == "kvx" else ("KvxConnectorBefore", "kvx_before")
            ktc = KVTransferConfig(kv_connector=name, kv_connector_module_path=module,
                                   kv_role="kv_both", kv_load_failure_policy="recompute",
                                   kv_connector_extra_config={"host_blocks": host_blocks})
        elif kind == "offloading":
            ktc = KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both",
                                   kv_connector_extra_config={
                                       "spec_name": "HostCPUOffloadingSpec",
                                       "spec_module_path": "host_offload",
                                       # vLLM rounds each offloaded block up to this alignment
                                       "cpu_bytes_to_use": host_blocks * max(BLOCK_BYTES, ALIGN),
                                       "offload_prompt_only": False,
                                   })
        self.vllm_config = VllmConfig(
            model_config=model,
            cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=False),
            scheduler_config=SchedulerConfig(max_model_len=max_len, is_encoder_decoder=False, max_num_seqs=n,
                                             max_num_batched_tokens=batched_tokens, enable_chunked_prefill=True),
            device_config=DeviceConfig("cpu"),
            kv_transfer_config=ktc,
        )
        self.vllm_config.cache_config.num_gpu_blocks = num_blocks
        spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD, dtype=torch.float16)
        kcc = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                            kv_cache_groups=[KVCacheGroupSpec([f"layer{i}" for i in range(LAYERS)], spec)])
        # Block-first tensors (each block one contiguous KiB): both connectors take them.
        self.kv = {f"layer{i}": torch.zeros((num_blocks, 2, BLOCK, KV_HEADS, HEAD), dtype=torch.float16)
                   for i in range(LAYERS)}
        self.worker: Any = None
        self.driver: Any = None
        self.wtimed: Timed | None = None
        if ktc is not None:
            self.worker = KVConnectorFactory.create_connector(self.vllm_config, KVConnectorRole.WORKER, kcc)
            kv_transfer_state._KV_CONNECTOR_AGENT = self.worker
            self.wtimed = Timed(self.worker, WORKER_METHODS)
            self.driver = ActiveKVConnector(self.vllm_config, self.kv)
        self.scheduler = Scheduler(self.vllm_config, kcc, StructuredOutputManager(self.vllm_config),
                                   block_size=BLOCK, log_stats=False)
        conn = self.scheduler.connector
        self.stimed = Timed(conn, SCHED_METHODS) if conn is not None else None
        self.requests: dict[str, Request] = {}

    def add(self, req_id: str, prompt: list[int], max_tokens: int) -> None:
        req = Request(req_id, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), None,
                      block_hasher=_HASHER)
        self.requests[req_id] = req
        self.scheduler.add_request(req)

    def _forward(self, so: Any) -> ModelRunnerOutput:
        req_ids, sampled = [], []
        for req_id in so.num_scheduled_tokens:
            req = self.requests[req_id]
            req_ids.append(req_id)
            sampled.append([7] if req.num_computed_tokens >= req.num_tokens else [])
        return ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                 sampled_token_ids=sampled)

    def step(self) -> dict[str, Any]:
        """One engine step; what it cost."""
        if self.stimed is not None:
            self.stimed.take()  # add_request's on_new_request is not a step's
        t0 = time.perf_counter()
        wall0 = t0
        so = self.scheduler.schedule()
        t_sched = time.perf_counter() - t0
        sched_part = self.stimed.take() if self.stimed is not None else {}
        meta_bytes = 0
        if self.driver is not None:
            wire = pickle.dumps(so.kv_connector_metadata)
            meta_bytes = len(wire)
            so.kv_connector_metadata = pickle.loads(wire)
        if so.total_num_scheduled_tokens == 0:
            out = self.driver.no_forward(so) if self.driver is not None else ModelRunnerOutput(
                req_ids=[], req_id_to_index={}, sampled_token_ids=[])
        elif self.driver is not None:
            self.driver.pre_forward(so)
            out = self._forward(so)
            self.driver.finish_forward()
            out.kv_connector_output = self.driver.post_forward(so.finished_req_ids)
        else:
            out = self._forward(so)
        worker_part = self.wtimed.take() if self.wtimed is not None else {}
        kvo = out.kv_connector_output
        if kvo is not None and kvo.kv_connector_worker_meta is not None:
            kvo.kv_connector_worker_meta = pickle.loads(pickle.dumps(kvo.kv_connector_worker_meta))
        t1 = time.perf_counter()
        self.scheduler.update_from_output(so, out)
        t_update = time.perf_counter() - t1
        if self.stimed is not None:
            for k, v in self.stimed.take().items():
                sched_part[k] = sched_part.get(k, 0.0) + v
        return {
            "tokens": so.total_num_scheduled_tokens,
            "running": len(self.scheduler.running),
            "step_s": t_sched + t_update,
            "wall_s": time.perf_counter() - wall0,
            "sched": sched_part,
            "worker": worker_part,
            "meta_bytes": meta_bytes,
        }

    def run_until(self, done: Callable[[], bool], limit: int) -> list[dict[str, Any]]:
        """Steps until ``done()``; what each cost."""
        out: list[dict[str, Any]] = []
        for _ in range(limit):
            if done():
                return out
            out.append(self.step())
        raise RuntimeError(f"{self.kind}: phase did not end in {limit} steps")

    def close(self) -> None:
        self.scheduler.shutdown()
        if self.worker is not None:
            self.worker.shutdown()
        kv_transfer_state._KV_CONNECTOR_AGENT = None


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def summarize(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """Median and p99 per step of every measured quantity of one phase."""
    def stats(xs: list[float]) -> dict[str, float]:
        return {"median": statistics.median(xs) if xs else 0.0, "p99": pct(xs, 0.99)}

    sched_names = sorted({k for s in steps for k in s["sched"]})
    worker_names = sorted({k for s in steps for k in s["worker"]})
    return {
        "steps": len(steps),
        "wall_s": sum(s["wall_s"] for s in steps),
        "tokens_per_step": stats([s["tokens"] for s in steps]),
        "running": stats([s["running"] for s in steps]),
        "step_s": stats([s["step_s"] for s in steps]),
        "sched_total_s": stats([sum(s["sched"].values()) for s in steps]),
        "worker_total_s": stats([sum(s["worker"].values()) for s in steps]),
        "meta_bytes": stats([s["meta_bytes"] for s in steps]),
        "sched": {k: stats([s["sched"].get(k, 0.0) for s in steps]) for k in sched_names},
        "worker": {k: stats([s["worker"].get(k, 0.0) for s in steps]) for k in worker_names},
        # per-step cost against the work: total seconds over total tokens
        "sched_us_per_token": 1e6 * sum(sum(s["sched"].values()) for s in steps)
        / max(1, sum(s["tokens"] for s in steps)),
    }


def run_size(kind: str, n: int, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    first = prompts(n, args.min_prompt, args.max_prompt, salt=1)
    cut = [p[: len(p) - len(p) // 8] for p in first]
    second = [c + tokens(3_000_000 + i, len(p) - len(c)) for i, (p, c) in enumerate(zip(first, cut, strict=True))]
    # Requests that finish their prefill early decode until the last prompt is in (continuous
    # batching): room for that, then ``--decode`` steps with all N decoding.
    total = sum(len(p) for p in first)
    extra = -(-total // max(args.batched_tokens - n, 1)) + args.decode + 64
    max_len = args.max_prompt + extra
    blocks = sum((len(p) + extra) // BLOCK + 1 for p in first)
    b = Bench(kind, tmp, n, blocks + 64, blocks + 1024, max_len, args.batched_tokens)
    try:
        for i, p in enumerate(first):
            b.add(f"a{i}", p, max_tokens=max_len - len(p))
        reqs = [b.requests[f"a{i}"] for i in range(n)]
        miss = b.run_until(lambda: all(r.num_computed_tokens >= r.num_prompt_tokens for r in reqs), 100_000)
        store = [b.step() for _ in range(args.decode)]
        b.scheduler.finish_requests([r.request_id for r in reqs], RequestStatus.FINISHED_ABORTED)
        b.run_until(lambda: not b.scheduler.has_requests(), 100_000)
        # Stores still in flight (and delayed frees) drain before the next phase.
        for _ in range(200):
            b.step()
        for i, p in enumerate(second):
            b.add(f"b{i}", p, max_tokens=1)
        reqs = [b.requests[f"b{i}"] for i in range(n)]
        hit = b.run_until(lambda: all(r.num_computed_tokens >= r.num_prompt_tokens for r in reqs), 100_000)
        offered = b.stimed.offered if b.stimed is not None else {}
        loaded = sum(offered.get(f"b{i}", 0) for i in range(n))
        return {"miss": summarize(miss), "store": summarize(store), "hit": summarize(hit),
                "hit_tokens_loaded": loaded, "hit_tokens_prompt": sum(len(p) for p in second)}
    finally:
        b.close()


def fmt_us(x: float) -> str:
    return f"{x * 1e6:.0f}"


def table(results: dict[str, Any]) -> str:
    rows = ["| N | phase | connector | steps | phase s | tok/step | sched+update µs med / p99 | "
            "sched-side connector µs med / p99 | sched-side µs per 1k tokens | "
            "worker-side connector µs med / p99 | metadata B med / p99 |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for n, per_kind in results.items():
        for phase in ("miss", "store", "hit"):
            for kind in CONNECTORS:
                if kind not in per_kind:
                    continue
                s = per_kind[kind][phase]
                rows.append(
                    f"| {n} | {phase} | {kind} | {s['steps']} | {s['wall_s']:.2f} | "
                    f"{s['tokens_per_step']['median']:.0f} | "
                    f"{fmt_us(s['step_s']['median'])} / {fmt_us(s['step_s']['p99'])} | "
                    f"{fmt_us(s['sched_total_s']['median'])} / {fmt_us(s['sched_total_s']['p99'])} | "
                    f"{s['sched_us_per_token'] * 1000:.0f} | "
                    f"{fmt_us(s['worker_total_s']['median'])} / {fmt_us(s['worker_total_s']['p99'])} | "
                    f"{s['meta_bytes']['median']:.0f} / {s['meta_bytes']['p99']:.0f} |")
    rows += ["", "Per method, µs per step (median / p99):", ""]
    for n, per_kind in results.items():
        for phase in ("miss", "store", "hit"):
            for kind in ("offloading", "kvx-before", "kvx"):
                if kind not in per_kind:
                    continue
                s = per_kind[kind][phase]
                parts = [f"{k} {fmt_us(v['median'])}/{fmt_us(v['p99'])}" for side in ("sched", "worker")
                         for k, v in s[side].items() if v["p99"] >= 1e-6]
                rows.append(f"- N={n} {phase} {kind}: " + "; ".join(parts))
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--sizes", default="64,256,1024", help="running requests, comma-separated")
    ap.add_argument("--connectors", default=",".join(CONNECTORS),
                    help="kvx-before: kvx with build_connector_meta as before the per-step cost fix")
    ap.add_argument("--min-prompt", type=int, default=1024)
    ap.add_argument("--max-prompt", type=int, default=32768)
    ap.add_argument("--decode", type=int, default=48, help="steps of the store phase (all N decoding)")
    ap.add_argument("--batched-tokens", type=int, default=8192, help="max_num_batched_tokens")
    ap.add_argument("--json", action="store_true", help="print JSON instead of the table")
    ap.add_argument("--from-json", metavar="FILE", help="print the table of an earlier run's --json output")
    args = ap.parse_args()
    if args.from_json:
        print(table(json.loads(Path(args.from_json).read_text())["results"]))
        return
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as d:
        for n in (int(x) for x in args.sizes.split(",")):
            results[str(n)] = {}
            for kind in args.connectors.split(","):
                t0 = time.monotonic()
                results[str(n)][kind] = run_size(kind, n, args, Path(d))
                gc.collect()
                print(f"# N={n} {kind}: {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
    meta = {"args": vars(args), "block_bytes": BLOCK_BYTES, "vllm": __import__("vllm").__version__,
            "cpus": os.cpu_count()}
    if args.json:
        print(json.dumps({"meta": meta, "results": results}, indent=1))
    else:
        print(table(results))


if __name__ == "__main__":
    main()
