"""The connector's scheduler side: vLLM requests and steps in, kvx-offload's scheduler side."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvx import _native
from kvx._native import KEY_BYTES
from kvx.vllm.disagg import Disaggregation
from kvx.vllm.meta import KvxConnectorMetadata, KvxWorkerMetadata


@dataclass
class _Req:
    """What the scheduler side knows of one vLLM request."""

    number: int
    request: Any
    keys: bytes = b""
    nhashes: int = 0
    local_tokens: int = 0
    hit: tuple[int, int] = (0, 0)
    # Blocks from this index on are never offered again: a load of one of them failed (vLLM
    # recomputes from there; offering it again would retry the same failure forever).
    cap: int | None = None
    # The last match loads before the forward of the step that schedules the request
    # (``host_loads_in_step``): vLLM never waits for it in finished_recving.
    in_step: bool = False


@dataclass
class SchedulerStats:
    """Counters of the scheduler side (see ``KvxConnector.stats``)."""

    lookups: int = 0
    hit_tokens: int = 0
    host_hit_blocks: int = 0
    file_hit_blocks: int = 0
    loads: int = 0
    store_jobs: int = 0
    preemptions: int = 0
    failed_loads: int = 0


class SchedulerSide:
    """Maps vLLM's scheduler calls onto kvx's native ``SchedulerSide``."""

    def __init__(self, config: str, block_size: int, hash_block_size: int, namespace: bytes,
                 tp_size: int = 1, pp_size: int = 1):
        if block_size % hash_block_size:
            raise ValueError(
                f"KV block size {block_size} is not a multiple of the hash block size {hash_block_size}"
            )
        self.block_size = block_size
        self.ratio = block_size // hash_block_size
        self.namespace = namespace
        # With several workers, kvx-offload counts a job once every rank reported it.
        self.native = _native.SchedulerSide(config, block_size, tp_size, pp_size)
        self.cache_manager: Any = None
        self._next = 1
        self.reqs: dict[str, _Req] = {}
        # vLLM request id of every request number still in use.
        self.names: dict[int, str] = {}
        # Request ids whose load is queued and not yet reported in finished_recving.
        self.loading: set[str] = set()
        # Request numbers whose load this step's forward waits for (host_loads_in_step).
        self._in_step: list[int] = []
        # Finished requests vLLM still hears about (finished_sending / finished_recving).
        self.finished: dict[str, int] = {}
        self._abandoned: list[int] = []
        self.stats = SchedulerStats()
        # Prefill/decode disaggregation (kvx.vllm.disagg), when the connector's role has it.
        self.disagg: Disaggregation | None = None

    # -- keys ------------------------------------------------------------------------------
    def _req(self, request: Any) -> _Req:
        r = self.reqs.get(request.request_id)
        if r is None:
            r = _Req(number=self._next, request=request)
            self._next += 1
            self.reqs[request.request_id] = r
            self.names[r.number] = request.request_id
        return r

    def _keys(self, r: _Req) -> bytes:
        """kvx keys of the request's full KV blocks (hash-chained, so prefix-determined)."""
        hashes = r.request.block_hashes
        n = len(hashes) // self.ratio
        if n * self.ratio > r.nhashes:
            new = [bytes(hashes[(i + 1) * self.ratio - 1]) for i in range(r.nhashes // self.ratio, n)]
            r.keys += _native.block_keys(self.namespace, new)
            r.nhashes = n * self.ratio
        return r.keys

    # -- vLLM's scheduler-side calls -----------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        r = self._req(request)
        self.stats.lookups += 1
        keys = self._keys(r)
        if self.disagg is not None and self.disagg.wants(request):
            return self.disagg.match(request, r.number, keys, num_computed_tokens)
        if r.cap is not None:
            keys = keys[: r.cap * KEY_BYTES]
        found = self.native.get_num_new_matched_tokens(r.number, keys, num_computed_tokens)
        if found is None:
            return None, False
        tokens, host, file = found
        r.local_tokens = num_computed_tokens
        r.hit = (host, file)
        # vLLM computes at least one token in the step that schedules a request: a hit of the
        # whole prompt loads asynchronously (vLLM then recomputes its last token).
        r.in_step = (tokens > 0 and file == 0 and self.native.host_loads_in_step
                     and num_computed_tokens + tokens < request.num_tokens)
        return tokens, tokens > 0 and not r.in_step

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if self.disagg is not None:
            queued = self.disagg.alloc(request, blocks, num_external_tokens)
            if queued is not None:
                if queued:
                    self._load_started(request.request_id, self._req(request), num_external_tokens)
                return
        if num_external_tokens == 0:
            return
        r = self._req(request)
        ids = blocks.get_block_ids()[0]
        first = r.local_tokens // self.block_size
        n = num_external_tokens // self.block_size
        if self.native.update_state_after_alloc(r.number, ids[first : first + n]):
            self._load_started(request.request_id, r, num_external_tokens)

    def _load_started(self, req_id: str, r: _Req, num_external_tokens: int) -> None:
        """A load was planned for ``req_id``: it is loading (before this step's forward, or
        until reported in finished_recving), and counted."""
        if r.in_step:
            self._in_step.append(r.number)
        else:
            self.loading.add(req_id)
        self.stats.loads += 1
        self.stats.hit_tokens += num_external_tokens
        self.stats.host_hit_blocks += r.hit[0]
        self.stats.file_hit_blocks += r.hit[1]

    def hit_sources(self, request: Any, num_external_tokens: int) -> dict:
        r = self.reqs.get(request.request_id)
        if r is None or num_external_tokens == 0:
            return {}
        if self.disagg is not None and request.request_id in self.disagg.remote:
            return {CacheHitSource.P2P: num_external_tokens}
        file = r.hit[1]
        out = {}
        if file:
            out[CacheHitSource.DISK] = file * self.block_size
        out[CacheHitSource.HOST] = num_external_tokens - out.get(CacheHitSource.DISK, 0)
        return {k: v for k, v in out.items() if v > 0}

    def _preempted(self, so: Any) -> None:
        """Tell kvx about the requests vLLM preempted in this step's scheduler output."""
        for req_id in so.preempted_req_ids or ():
            r = self.reqs.get(req_id)
            if r is not None:
                self.native.request_preempted(r.number)
                self.stats.preemptions += 1

    def _completing(self, so: Any) -> Iterator[tuple[str, _Req, int, int]]:
        """The requests that complete at least one block in this step's scheduler output, with
        the index of their first new block and the block count once the step ran (most decode
        steps complete none: those are skipped before any key or block table is read)."""
        bs = self.block_size
        for req_id, n in so.num_scheduled_tokens.items():
            r = self.reqs.get(req_id)
            if r is None or n <= 0:
                continue
            done = r.request.num_computed_tokens
            if (done + n) // bs > done // bs:
                yield req_id, r, done // bs, (done + n) // bs

    def build_connector_meta(self, so: Any) -> KvxConnectorMetadata:
        self._preempted(so)
        for req_id, r, first, end in self._completing(so):
            keys = self._keys(r)
            upto = min(end, len(keys) // KEY_BYTES)
            if upto <= first:
                continue
            # Only this job's blocks: get_block_ids would copy the whole block table (O(context)).
            blocks = self.cache_manager.get_blocks(req_id).blocks[0][first:upto]
            job_keys = keys[first * KEY_BYTES : upto * KEY_BYTES]
            if self.native.save_blocks(r.number, job_keys, [b.block_id for b in blocks]):
                self.stats.store_jobs += 1
        abandoned, self._abandoned = self._abandoned, []
        step, loads, delayed = self.native.build_meta(abandoned)
        in_step, self._in_step = self._in_step, []
        return KvxConnectorMetadata(
            step,
            {n: self.names[n] for n in loads if n not in in_step},
            {n: self.names[n] for n in delayed},
            abandoned,
            in_step,
        )

    def update_connector_output(self, out: Any) -> None:
        wm = out.kv_connector_worker_meta
        if isinstance(wm, KvxWorkerMetadata):
            for jobs in wm.jobs:
                for number, failed in self.native.update_from_worker(jobs):
                    self._cap(number, failed)
        for req_id in out.finished_recving or ():
            self.loading.discard(req_id)
            if self.disagg is not None:
                self.disagg.loaded(req_id)
            self._release(req_id)
        for req_id in out.finished_sending or ():
            self._release(req_id)

    def _cap(self, number: int, failed: bytes) -> None:
        """Stop offering a request the blocks from its first failed one on."""
        r = self.reqs.get(self.names.get(number, ""))
        if r is None:
            return
        index = {r.keys[i : i + KEY_BYTES]: i // KEY_BYTES for i in range(0, len(r.keys), KEY_BYTES)}
        for i in range(0, len(failed), KEY_BYTES):
            idx = index.get(failed[i : i + KEY_BYTES])
            if idx is not None:
                r.cap = idx if r.cap is None else min(r.cap, idx)
        self.stats.failed_loads += 1

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict | None]:
        req_id = request.request_id
        r = self.reqs.pop(req_id, None)
        if self.disagg is not None:
            self.disagg.finished(req_id)
        if r is None:
            return False, None
        if self.disagg is not None and req_id not in self.loading:
            params = self.disagg.export(request, r.number, self._keys(r), block_ids)
            if params is not None:
                # Freed once the export's lease ended (a CUDA cache's: once copied into staging
                # buffers), and its stores, if any, are done.
                self.finished[req_id] = r.number
                return True, params
        delay = self.native.request_finished(r.number)
        if req_id in self.loading:
            # vLLM itself keeps the blocks until the load is reported in finished_recving.
            self._abandoned.append(r.number)
            delay = False
            self.finished[req_id] = r.number
        elif delay:
            self.finished[req_id] = r.number
        else:
            del self.names[r.number]
        return delay, None

    def reset_cache(self) -> bool:
        """Serve nothing held before: kvx forgets every block of its tiers (the workers drop
        them from their host tiers and remove their files at the next step). Requests in flight
        go on."""
        self.native.reset_cache()
        return True

    def _release(self, req_id: str) -> None:
        """A finished request was reported for the last time: forget its number."""
        number = self.finished.pop(req_id, None)
        if number is not None and req_id not in self.loading:
            self.names.pop(number, None)

    def state_counts(self) -> dict[str, int]:
        """Everything this side still tracks (all zero when idle)."""
        return {
            "requests": len(self.reqs),
            "numbers": len(self.names),
            "loading": len(self.loading),
            "finished": len(self.finished),
            "kvx_requests": self.native.request_count(),
            "kvx_jobs": self.native.job_count(),
            "kvx_index_busy": 0 if self.native.is_quiet() else 1,
            **(self.disagg.state_counts() if self.disagg is not None else {}),
        }
