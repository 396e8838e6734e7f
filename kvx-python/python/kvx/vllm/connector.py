"""``KvxConnector``: vLLM's ``KVConnectorBase_V1`` (0.32 and 0.33) on kvx-offload.

Enable it with::

    --kv-transfer-config '{"kv_connector": "KvxConnector", "kv_connector_module_path": "kvx.vllm",
                           "kv_role": "kv_both", "kv_connector_extra_config": {...}}'

(keys and defaults: kvx-python/README.md; kvx-offload reads them, as JSON). Loads are asynchronous: a request waits in
``WAITING_FOR_REMOTE_KVS`` at most one load deadline; blocks that fail to load (missing,
corrupt, timed out) are reported exactly through ``get_block_ids_with_load_errors`` in the step
in which the request appears in ``finished_recving``, and vLLM's ``kv_load_failure_policy``
decides to recompute them or fail the request. Stores are planned by the scheduler side from
the tokens each step computes, submitted at the start of the next step, and hold a finished
request's blocks only while they are in flight.
"""

from __future__ import annotations

import json
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from kvx._native import KvxError
from kvx.vllm import compat, parallel
from kvx.vllm.groups import HybridSchedulerSide, describe_groups
from kvx.vllm.meta import KvxConnectorMetadata, KvxWorkerMetadata
from kvx.vllm.scheduler_side import SchedulerSide
from kvx.vllm.settings import Settings
from kvx.vllm.stats import KvxPromMetrics, KvxStats
from kvx.vllm.worker_side import WorkerSide


def _namespace(vllm_config: Any, kv_cache_config: Any) -> bytes:
    """Identity of the KV bytes a block key stands for: model, dtypes, block size, parallelism,
    and the physical KV cache layout (a block's bytes mean something else under another one)."""
    m, c, p = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
    parts = (
        "kvx-vllm-2",
        str(getattr(m, "model", "")),
        str(getattr(m, "revision", "")),
        str(getattr(m, "dtype", "")),
        str(getattr(c, "cache_dtype", "")),
        str(c.block_size),
        str(p.tensor_parallel_size),
        str(p.pipeline_parallel_size),
        f"layout={compat.resolved_layout(vllm_config, kv_cache_config)}",
    )
    return "|".join(parts).encode()


def _remote_roles(kv_transfer_config: Any, settings: Settings) -> tuple[bool, bool]:
    """(exports, loads from a producer) for vLLM's ``kv_role`` and kvx's ``remote`` section:
    ``kv_producer`` exports, ``kv_consumer`` loads, ``kv_both`` does what ``remote`` sets up
    (exports with ``remote.listen``, loads with any ``remote``). A producer or consumer role
    without ``remote`` is refused."""
    role = getattr(kv_transfer_config, "kv_role", "kv_both") or "kv_both"
    remote = settings.values.get("remote")
    if role in ("kv_producer", "kv_consumer") and remote is None:
        raise ValueError(f"KvxConnector: kv_role {role} needs a `remote` section in kv_connector_extra_config")
    listen = isinstance(remote, dict) and remote.get("listen") is not None
    if role == "kv_producer" and not listen:
        raise ValueError("KvxConnector: kv_role kv_producer needs remote.listen (where its workers serve blocks)")
    produce = listen and role in ("kv_producer", "kv_both")
    consume = remote is not None and role in ("kv_consumer", "kv_both")
    return produce, consume


class KvxConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM KV connector over kvx's host-memory and file tiers, with per-block load failures."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        compat.warn_if_untested()
        extra = self._kv_transfer_config.kv_connector_extra_config
        try:
            self.config = json.dumps(dict(extra or {}))
        except TypeError as e:
            raise ValueError(f"kv_connector_extra_config: not JSON data: {e}") from e
        tp_size, pp_size = parallel.sizes(vllm_config)  # tensor x pipeline parallel workers
        if kv_cache_config is None:
            raise ValueError("KvxConnector needs the KV cache config (vLLM >= 0.32)")
        groups = kv_cache_config.kv_cache_groups
        if not groups:
            raise ValueError("KvxConnector: the KV cache config has no KV cache group")
        namespace = _namespace(vllm_config, kv_cache_config)
        # Several groups (a hybrid model): kvx.vllm.groups; one group: as before.
        hybrid = describe_groups(kv_cache_config, namespace) if len(groups) > 1 else None
        block_size = groups[0].kv_cache_spec.block_size
        windows = [(g.window, g.extra_retained) for g in hybrid] if hybrid is not None else None
        settings = Settings.parse(self.config, block_size)
        compat.check_host_blocks(settings.values["host_blocks"], block_size, vllm_config, windows)
        hash_block_size = getattr(kv_cache_config, "hash_block_size", None) or block_size
        self._sched: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        # Several groups: a failed load is reported per request (vLLM refuses block ids).
        self._per_request_failures = hybrid is not None
        roles = _remote_roles(self._kv_transfer_config, settings)
        if hybrid is not None and any(roles):
            raise ValueError("KvxConnector: prefill/decode disaggregation of hybrid models is not supported yet")
        if role == KVConnectorRole.SCHEDULER:
            if hybrid is not None:
                self._sched = HybridSchedulerSide(
                    self.config, block_size, hash_block_size, hybrid, tp_size=tp_size, pp_size=pp_size
                )
            else:
                self._sched = SchedulerSide(
                    self.config, block_size, hash_block_size, [namespace], tp_size=tp_size, pp_size=pp_size,
                    roles=roles,
                )
        else:
            shard = parallel.worker_place(vllm_config).shard()
            self._worker = WorkerSide(settings, block_size, kv_cache_config.num_blocks, shard=shard)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        """The layout kvx asks vLLM for: block-outermost, so each block is one run of bytes
        (one copy per block, not one per layer); ``None`` where it cannot help (see
        ``compat.preferred_layout``). vLLM drops a preference its attention backends do not
        support (with a warning), and ``VLLM_KV_CACHE_LAYOUT`` overrides it."""
        return compat.preferred_layout(vllm_config)

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """Sleep mode (vLLM >= 0.33): the worker side drops its pointers into the KV cache in
        ``unregister_kv_caches`` and takes them again in ``restore_kv_caches``."""
        return True

    def _worker_side(self) -> WorkerSide:
        if self._worker is None:
            raise RuntimeError("KvxConnector: a worker call on the scheduler's connector")
        return self._worker

    def _scheduler_side(self) -> SchedulerSide:
        if self._sched is None:
            raise RuntimeError("KvxConnector: a scheduler call on a worker's connector")
        return self._sched

    # -- worker side ---------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self._worker_side().register(kv_caches)

    def unregister_kv_caches(self) -> None:
        # Sleep (vLLM >= 0.33): the KV cache memory goes away until restore_kv_caches.
        self._worker_side().unregister()

    def restore_kv_caches(self) -> None:
        self._worker_side().restore()

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        # Before the forward may overwrite a preempted request's blocks: the whole step starts
        # here (stores of preempted requests flushed and waited for, their loads fenced).
        assert isinstance(kv_connector_metadata, KvxConnectorMetadata)
        self._worker_side().start(kv_connector_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvxConnectorMetadata)
        self._worker_side().start(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are asynchronous, between steps

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return  # stores are planned per step by the scheduler side

    def wait_for_save(self) -> None:
        if self.has_connector_metadata():
            meta = self._get_connector_metadata()
            assert isinstance(meta, KvxConnectorMetadata)
            self._worker_side().start(meta)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self._worker_side().get_finished()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        if self._per_request_failures:
            return self._worker_side().transfer_results()
        return super().get_transfer_results(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        if self._per_request_failures:
            return set()
        return self._worker_side().take_invalid()

    def build_connector_worker_meta(self) -> KvxWorkerMetadata | None:
        return self._worker_side().take_worker_meta()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker_side().close()

    # -- scheduler side ------------------------------------------------------------------------
    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self._scheduler_side().cache_manager = kv_cache_manager

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler_side().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._scheduler_side().update_state_after_alloc(request, blocks, num_external_tokens)

    def get_external_cache_hit_sources(self, request: Any, num_external_tokens: int) -> dict:
        return self._scheduler_side().hit_sources(request, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return self._scheduler_side().build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        self._scheduler_side().update_connector_output(connector_output)

    def reset_cache(self) -> bool:
        # LLM.reset_prefix_cache(reset_connector=True): vLLM asks the scheduler's connector only;
        # the workers learn it from the next step's metadata.
        return self._scheduler_side().reset_cache()

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler_side().request_finished(request, block_ids)

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        # vLLM's call with the hybrid KV cache manager (SupportsHMA), one block list per group.
        flat = block_ids[0] if len(block_ids) == 1 else [b for ids in block_ids for b in ids if b]
        return self.request_finished(request, flat)

    # -- vLLM's stats and metrics ---------------------------------------------------------------
    def get_kv_connector_stats(self) -> KvxStats | None:
        # Each step, on each worker and on the scheduler: what this side moved since the last
        # call (vLLM sums them); None while nothing happened or before the KV caches came.
        side = self._sched if self._sched is not None else self._worker
        native = side.native if side is not None else None
        try:
            data = native.take_stats() if native is not None else {}
        except KvxError:
            return None  # the worker side is closed
        return KvxStats(data=data) if data else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KvxStats:
        return KvxStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: dict[type, type], labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KvxPromMetrics:
        return KvxPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # -- kvx -------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Counters of this side. Scheduler: lookups, hit tokens and blocks per tier, loads,
        store jobs, preemptions, failed loads, and ``store_skipped_no_room`` (blocks no tier had
        room for). Worker: kvx's tracker (live tasks, zombie ops and bytes, timeouts, late
        completions), host-tier blocks, the file tier's counters, and ``store_skipped_<kind>``
        (blocks whose store ended in no tier, by the kind of their last failure)."""
        if self._sched is not None:
            side = self._scheduler_side()
            return dict(side.native.counters()) | dict(side.native.store_skips())
        native = self._worker_side().native
        return dict(native.stats()) if native is not None else {}

    def state_counts(self) -> dict[str, int]:
        """Everything this side still tracks about requests and transfers (zeros when idle)."""
        side = self._sched if self._sched is not None else self._worker_side()
        return side.state_counts()
