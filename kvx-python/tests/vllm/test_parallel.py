"""KvxConnector with tensor- and pipeline-parallel workers: vLLM's real scheduler in this process,
2 or 4 worker-side connectors in worker processes (vLLM's parallel state over gloo, as its
multiprocess executor sets it up on CPU), each with its own shard of the KV cache, their outputs
combined by vLLM's own KVOutputAggregator. Every rank checks its shard of every block it did not
compute itself, byte for byte."""

from __future__ import annotations

import json
import multiprocessing as mp
import pickle
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

import parallel_worker as pw
from harness import _HASHER, BLOCK, HEAD, VOCAB, chain, prompt
from ports import free_port

LAYERS = 2
DONE = RequestStatus.FINISHED_LENGTH_CAPPED


def model_dir(root: Path) -> str:
    d = root / "tiny-llama-4h"
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": pw.KV_HEADS * HEAD, "intermediate_size": 128,
        "num_attention_heads": pw.KV_HEADS, "num_key_value_heads": pw.KV_HEADS, "head_dim": HEAD,
        "num_hidden_layers": LAYERS, "vocab_size": VOCAB, "max_position_embeddings": 4096,
        "torch_dtype": "float16", "rms_norm_eps": 1e-5,
    }))
    return str(d)


@dataclass
class Tracked:
    request: Request
    states: list[int] = field(default_factory=list)
    seen: bool = False
    status: RequestStatus | None = None
    params: dict | None = None  # the kv_transfer_params of its finishing output


class ParallelEngine:
    """vLLM's scheduler here, one process per worker, vLLM's aggregator in between."""

    def __init__(self, tmp: Path, extra: dict, tp: int, pp: int, policy: str = "recompute",
                 num_blocks: int = 64, kv_role: str = "kv_both"):
        self.world = tp * pp
        mdir = model_dir(tmp)
        self.cfg = pw.build_config(mdir, tp, pp, extra, policy, num_blocks, kv_role)
        ctx = mp.get_context("spawn")
        port = free_port()
        self.conns: list[Any] = []
        self.procs: list[Any] = []
        for rank in range(self.world):
            here, there = ctx.Pipe()
            p = ctx.Process(target=pw.main, args=(rank, tp, pp, port, mdir, extra, policy, num_blocks,
                                                  LAYERS, there, kv_role), daemon=True)
            p.start()
            self.conns.append(here)
            self.procs.append(p)
        self.places = [self._recv(c, 180) for c in self.conns]
        kcc = pw.kv_cache_config(num_blocks, list(range(LAYERS)), pw.KV_HEADS // tp)
        self.num_blocks = num_blocks
        self.scheduler = Scheduler(self.cfg, kcc, StructuredOutputManager(self.cfg), block_size=BLOCK,
                                   log_stats=True)
        self.conn = self.scheduler.connector
        self.agg = KVOutputAggregator.from_connector(self.conn, self.world)
        self.tracked: dict[str, Tracked] = {}
        self.verified = [0] * self.world
        self.invalid_reported: list[set[int]] = []
        self.recv_reported: set[str] = set()

    @staticmethod
    def _recv(conn: Any, timeout: float) -> Any:
        if not conn.poll(timeout):
            raise AssertionError(f"a worker did not answer within {timeout}s")
        kind, payload = conn.recv()
        if kind == "error":
            raise AssertionError(f"worker failed:\n{payload}")
        return payload

    def add(self, req_id: str, p: list[int], max_tokens: int = 2, params: dict | None = None) -> None:
        extra = None if params is None else {"kv_transfer_params": params}
        req = Request(req_id, p, SamplingParams(max_tokens=max_tokens, ignore_eos=True, extra_args=extra),
                      None, block_hasher=_HASHER)
        self.tracked[req_id] = Tracked(req)
        self.scheduler.add_request(req)

    def _states(self, t: Tracked) -> list[int]:
        toks = t.request.all_token_ids
        h = t.states[-1] if t.states else 0
        for tok in toks[len(t.states):]:
            h = chain(h, tok)
            t.states.append(h)
        return t.states

    def step(self) -> None:
        so = self.scheduler.schedule()
        writes, checks, req_ids, sampled = [], [], [], []
        for req_id, n in so.num_scheduled_tokens.items():
            t = self.tracked[req_id]
            end = t.request.num_computed_tokens
            start = end - n
            states = self._states(t)
            ids = self.scheduler.kv_cache_manager.get_block_ids(req_id)[0]
            if not t.seen or start == 0:
                full = start // BLOCK
                checks.append((req_id, list(ids[:full]), states[: full * BLOCK]))
                t.seen = True
            writes.extend((ids[p // BLOCK], p % BLOCK, states[p]) for p in range(start, end))
            req_ids.append(req_id)
            sampled.append([states[end - 1] % VOCAB] if end >= t.request.num_tokens else [])
        payload = pickle.dumps((so, writes, checks))
        for c in self.conns:
            c.send(("step", payload))
        outputs = []
        for rank, c in enumerate(self.conns):
            kvo, bad, verified = pickle.loads(self._recv(c, 60))
            assert not bad, bad
            self.verified[rank] = verified
            outputs.append(ModelRunnerOutput(req_ids=list(req_ids),
                                             req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                             sampled_token_ids=[list(s) for s in sampled],
                                             kv_connector_output=kvo))
        out = self.agg.aggregate(outputs, 0)
        assert out is not None
        kvo = out.kv_connector_output
        if kvo is not None:
            if kvo.invalid_block_ids:
                self.invalid_reported.append(set(kvo.invalid_block_ids))
            self.recv_reported.update(kvo.finished_recving or ())
        for eco in self.scheduler.update_from_output(so, out).values():
            for o in eco.outputs:
                if o.finish_reason is not None:
                    t = self.tracked[o.request_id]
                    t.status = t.request.status
                    t.params = o.kv_transfer_params

    def state(self) -> dict:
        s = self.scheduler
        st = {
            "vllm_requests": len(s.requests),
            "vllm_used_blocks": self.num_blocks - 1 - s.kv_cache_manager.block_pool.get_num_free_blocks(),
            **{f"sched_{k}": v for k, v in self.conn.state_counts().items()},
            "sched_partials": self.conn._sched.native.partial_count(),
        }
        for rank, c in enumerate(self.conns):
            c.send(("state", None))
            w = self._recv(c, 30)
            w.pop("file_blocks")
            st.update({f"rank{rank}_{k}": v for k, v in w.items()})
        return st

    def idle(self) -> bool:
        """No request left and nothing tracked on the scheduler or any worker."""
        return self.scheduler.get_num_unfinished_requests() == 0 and all(v == 0 for v in self.state().values())

    def run(self, timeout: float = 60.0) -> None:
        end = time.monotonic() + timeout
        while True:
            self.step()
            if self.idle():
                return
            if time.monotonic() > end:
                raise AssertionError(f"not idle after {timeout}s: {self.state()}")
            time.sleep(0.002)

    def file_blocks(self) -> list[int]:
        out = []
        for c in self.conns:
            c.send(("state", None))
            out.append(self._recv(c, 30)["file_blocks"])
        return out

    def close(self) -> None:
        self.scheduler.shutdown()
        for c in self.conns:
            try:
                c.send(None)
                self._recv(c, 30)
            except (OSError, EOFError, AssertionError):
                pass
        for p in self.procs:
            p.join(10)
            if p.is_alive():
                p.kill()


def shard_file(root: Path, tp_rank: int, tp: int, pp_rank: int, pp: int, key: bytes) -> Path:
    hexkey = key.hex()
    return root / f"shard-tp{tp_rank}of{tp}-pp{pp_rank}of{pp}" / hexkey[:2] / f"{hexkey}.kvb"


def keys_of(e: ParallelEngine, req_id: str) -> list[bytes]:
    side = e.conn._sched
    raw = side.keys_of(e.tracked[req_id].request)
    return [raw[i : i + 16] for i in range(0, len(raw), 16)]


def flip_payload_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_hits_restart_and_one_worker_failure_recomputed(tmp_path, tp):
    files = tmp_path / "files"
    files.mkdir()
    extra = {"host_blocks": 32, "file": {"roots": [str(files)], "blocks": 1024}}
    p = prompt(11, 5 * BLOCK + 3)
    e = ParallelEngine(tmp_path, extra, tp, 1)
    try:
        assert sorted(e.places) == [(r, 0) for r in range(tp)]
        e.add("a", p)
        e.run()
        e.add("b", p)
        e.run()
        st = e.conn.stats()
        assert (st["host_hit_blocks"], st["hit_tokens"]) == (5, 5 * BLOCK)
        assert e.tracked["b"].status == DONE
        assert e.recv_reported == {"b"}
        assert e.verified == [5] * tp, "every rank checked its shard of the 5 loaded blocks"
        assert e.invalid_reported == []
        assert e.file_blocks() == [5] * tp, "one file per block per shard"
        keys = keys_of(e, "a")
    finally:
        e.close()
    for r in range(tp):
        for k in keys[:5]:
            assert shard_file(files, r, tp, 0, 1, k).is_file()
    assert not list(files.glob("??/*.kvb")), "no unsharded block files"
    # The last rank's shard of block 2 goes bad: after a restart only that rank fails it, vLLM
    # unions the invalid blocks, and the request recomputes from block 2.
    flip_payload_byte(shard_file(files, tp - 1, tp, 0, 1, keys[2]))
    e = ParallelEngine(tmp_path, extra, tp, 1)
    try:
        e.add("c", p)
        e.run()
        st = e.conn.stats()
        assert (st["file_hit_blocks"], st["failed_loads"]) == (5, 1)
        assert e.tracked["c"].status == DONE
        assert len(e.invalid_reported) == 1 and len(e.invalid_reported[0]) == 1, e.invalid_reported
        assert e.recv_reported == {"c"}
        # The two blocks before the bad one were loaded and checked on every rank.
        assert e.verified == [2] * tp
        e.add("d", p)  # block 2 was recomputed and stored again: a full hit
        e.run()
        assert e.tracked["d"].status == DONE
        assert e.verified == [2 + 5] * tp
    finally:
        e.close()


def test_one_worker_failure_fails_the_request_under_fail(tmp_path):
    files = tmp_path / "files"
    files.mkdir()
    extra = {"host_blocks": 32, "file": {"roots": [str(files)], "blocks": 1024}}
    p = prompt(12, 4 * BLOCK + 1)
    e = ParallelEngine(tmp_path, extra, 2, 1, policy="fail")
    try:
        e.add("a", p)
        e.run()
        keys = keys_of(e, "a")
    finally:
        e.close()
    flip_payload_byte(shard_file(files, 0, 2, 0, 1, keys[1]))
    e = ParallelEngine(tmp_path, extra, 2, 1, policy="fail")
    try:
        e.add("b", p)
        e.run()
        assert e.tracked["b"].status == RequestStatus.FINISHED_ERROR
        assert len(e.invalid_reported) == 1, e.invalid_reported
    finally:
        e.close()


def test_pipeline_parallel_and_a_missing_shard_is_not_adopted(tmp_path):
    files = tmp_path / "files"
    files.mkdir()
    extra = {"host_blocks": 32, "file": {"roots": [str(files)], "blocks": 1024}}
    p = prompt(13, 4 * BLOCK + 5)
    e = ParallelEngine(tmp_path, extra, 1, 2)
    try:
        assert sorted(e.places) == [(0, 0), (0, 1)]
        e.add("a", p)
        e.run()
        e.add("b", p)
        e.run()
        assert e.conn.stats()["host_hit_blocks"] == 4
        assert e.verified == [4, 4], "each stage checked its layers of the 4 loaded blocks"
        keys = keys_of(e, "a")
    finally:
        e.close()
    # The second stage lost its shard of block 3: after a restart the scheduler adopts only the
    # blocks both stages hold, so the hit stops at 3 blocks and nothing fails.
    shard_file(files, 0, 1, 1, 2, keys[3]).unlink()
    e = ParallelEngine(tmp_path, extra, 1, 2)
    try:
        e.add("c", p)
        e.run()
        st = e.conn.stats()
        assert (st["file_hit_blocks"], st["failed_loads"]) == (3, 0)
        assert e.invalid_reported == []
        assert e.tracked["c"].status == DONE
        assert e.verified == [3, 3]
    finally:
        e.close()


def test_prefill_decode_between_tensor_parallel_engines(tmp_path):
    """P and D each with 2 tensor-parallel workers in processes of their own: P's worker r
    serves its shard of the prompt's blocks on port + r, D's worker r reads it from there, and
    every D worker checks its shard of every loaded block byte for byte. P frees the blocks
    once D is done; both end idle."""
    port = free_port()
    p_extra = {"host_blocks": 32, "remote": {"listen": f"127.0.0.1:{port}", "lease_ttl_ms": 30000,
                                             "heartbeat_ms": 1000}}
    d_extra = {"host_blocks": 32, "remote": {"load_ms": 10000}}
    tokens = prompt(14, 4 * BLOCK + 3)
    # One model directory for both: P and D must name the model the same way (key namespace).
    p = ParallelEngine(tmp_path, p_extra, 2, 1, kv_role="kv_producer")
    d = None
    try:
        d = ParallelEngine(tmp_path, d_extra, 2, 1, kv_role="kv_consumer")
        p.add("a", tokens, max_tokens=1, params={"do_remote_decode": True})
        end = time.monotonic() + 60
        while p.tracked["a"].status is None:
            assert time.monotonic() < end, "P never finished the prefill"
            p.step()
        params = p.tracked["a"].params
        assert params is not None and params.get("do_remote_prefill") is True, params
        assert len(params["kvx"]["producers"]) == 2, "one address per P worker"
        d.add("a", tokens, max_tokens=2, params=params)
        # Both engines step: P's next step exports the request, D's scheduler waits for the
        # lease, D's workers load their shards, then D decodes and tells P it is done.
        while not (d.idle() and p.idle()):
            assert time.monotonic() < end, f"not idle: P {p.state()}, D {d.state()}"
            p.step()
            d.step()
        assert d.tracked["a"].status == DONE
        assert d.recv_reported == {"a"}
        assert d.invalid_reported == []
        assert d.verified == [4, 4], "each D worker checked its shard of the 4 loaded blocks"
    finally:
        p.close()
        if d is not None:
            d.close()
