"""The connector's scheduler side: vLLM requests and steps in, kvx-offload's scheduler side."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvx import _native
from kvx.vllm.disagg import Disaggregation, namespace_id
from kvx.vllm.meta import KvxConnectorMetadata, KvxWorkerMetadata


class SchedulerSide:
    """Maps vLLM's scheduler calls onto kvx's native ``SchedulerSide``, which owns the request
    table (vLLM's request ids, kvx's numbers, each request's keys, match, load and finishing)."""

    def __init__(self, config: str, block_size: int, hash_block_size: int, namespaces: list[bytes],
                 tp_size: int = 1, pp_size: int = 1, groups: list[tuple[int | None, int]] | None = None,
                 roles: tuple[bool, bool] = (False, False)):
        """``roles``: (exports to a remote decode, loads from a remote prefill) under prefill/decode
        disaggregation (``kvx.vllm.disagg``)."""
        if block_size % hash_block_size:
            raise ValueError(
                f"KV block size {block_size} is not a multiple of the hash block size {hash_block_size}"
            )
        self.block_size = block_size
        self.ratio = block_size // hash_block_size
        self.namespaces = namespaces
        produce, consume = roles
        # With several workers, kvx-offload counts a job once every rank reported it.
        self.native = _native.SchedulerSide(config, block_size, namespaces, tp_size, pp_size, self.ratio, groups,
                                            consumer=namespace_id(namespaces[0]) if consume else None)
        self.cache_manager: Any = None
        # vLLM's live requests (their block hashes and computed tokens grow as they run).
        self.requests: dict[str, Any] = {}
        # Prefill/decode disaggregation, when the connector's role has it.
        self.disagg: Disaggregation | None = None
        if produce or consume:
            self.disagg = Disaggregation(self.native, block_size, namespaces[0], produce, consume)

    def keys_of(self, request: Any, group: int = 0) -> bytes:
        """kvx keys of a request's full KV blocks in a group's namespace, live or not (the
        native side keys live requests itself; this is for tools and tests)."""
        hashes = request.block_hashes
        last = [bytes(hashes[(i + 1) * self.ratio - 1]) for i in range(len(hashes) // self.ratio)]
        return _native.block_keys(self.namespaces[group], last)

    # -- vLLM's scheduler-side calls -----------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        self.requests[request.request_id] = request
        if self.disagg is not None:
            remote = self.disagg.match(request, num_computed_tokens)
            if remote is not None:
                return remote
        found = self.native.get_num_new_matched_tokens(
            request.request_id, request.block_hashes, num_computed_tokens, request.num_tokens
        )
        return (None, False) if found is None else found

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> list[int] | None:
        """Queue the load of the last match into ``blocks``; the engine blocks it loads, if any."""
        if self.disagg is not None and self.disagg.alloc(request, blocks, num_external_tokens) is not None:
            return None
        if num_external_tokens == 0:
            return None
        return self.native.update_state_after_alloc(
            request.request_id, [list(ids) for ids in blocks.get_block_ids()], num_external_tokens
        )

    def hit_sources(self, request: Any, num_external_tokens: int) -> dict:
        if num_external_tokens == 0 or request.request_id not in self.requests:
            return {}
        if self.disagg is not None and self.disagg.is_remote(request.request_id):
            return {CacheHitSource.P2P: num_external_tokens}
        file = self.native.hit(request.request_id)[1]
        out = {}
        if file:
            out[CacheHitSource.DISK] = file * self.block_size
        out[CacheHitSource.HOST] = num_external_tokens - out.get(CacheHitSource.DISK, 0)
        return {k: v for k, v in out.items() if v > 0}

    def _preempted(self, so: Any) -> None:
        """Tell kvx about the requests vLLM preempted in this step's scheduler output."""
        for req_id in so.preempted_req_ids or ():
            self.native.request_preempted(req_id)

    def _completing(self, so: Any) -> Iterator[tuple[str, Any, int, int]]:
        """The requests that complete at least one block in this step's scheduler output, with
        the index of their first new block and the block count once the step ran (most decode
        steps complete none: those are skipped before any key or block table is read)."""
        bs = self.block_size
        for req_id, n in so.num_scheduled_tokens.items():
            request = self.requests.get(req_id)
            if request is None or n <= 0:
                continue
            done = request.num_computed_tokens
            if (done + n) // bs > done // bs:
                yield req_id, request, done // bs, (done + n) // bs

    def build_connector_meta(self, so: Any) -> KvxConnectorMetadata:
        self._preempted(so)
        for req_id, request, first, end in self._completing(so):
            # Only this job's blocks: get_block_ids would copy the whole block table (O(context)).
            blocks = self.cache_manager.get_blocks(req_id).blocks[0][first:end]
            self.native.save_blocks(req_id, request.block_hashes, first, [b.block_id for b in blocks])
        return KvxConnectorMetadata(self.native.build_meta())

    def update_connector_output(self, out: Any) -> None:
        wm = out.kv_connector_worker_meta
        if isinstance(wm, KvxWorkerMetadata):
            for jobs in wm.jobs:
                self.native.update_from_worker(jobs)
        recving = list(out.finished_recving or ())
        if self.disagg is not None:
            self.disagg.loaded(recving)
        self.native.reported(recving, list(out.finished_sending or ()))

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict | None]:
        req_id = request.request_id
        known = self.requests.pop(req_id, None) is not None
        if self.disagg is not None:
            self.disagg.finished(req_id)
        if not known:
            return False, None
        if self.disagg is not None and not self.native.is_loading(req_id):
            number = self.native.admit(req_id)
            self.native.extend_keys(req_id, request.block_hashes)
            params = self.disagg.export(request, number, self.native.keys(req_id), block_ids)
            if params is not None:
                # Freed once the export's lease ended (a CUDA cache's: once copied into staging
                # buffers), and its stores, if any, are done.
                self.native.request_exported(req_id)
                return True, params
        return self.native.request_finished(req_id), None

    def reset_cache(self) -> bool:
        """Serve nothing held before: kvx forgets every block of its tiers (the workers drop
        them from their host tiers and remove their files at the next step). Requests in flight
        go on."""
        self.native.reset_cache()
        return True

    def state_counts(self) -> dict[str, int]:
        """Everything this side still tracks (all zero when idle)."""
        live, finished, loading, numbers, keyed, hybrid = self.native.table_counts()
        return {
            "requests": len(self.requests),
            "live": live,
            "numbers": numbers,
            "loading": loading,
            "finished": finished,
            "keyed": keyed,
            "group_requests": hybrid,
            "kvx_requests": self.native.request_count(),
            "kvx_jobs": self.native.job_count(),
            "kvx_index_busy": 0 if self.native.is_quiet() else 1,
            **(self.disagg.state_counts() if self.disagg is not None else {}),
        }
