"""Hybrid models: several KV cache groups (vLLM's hybrid KV cache manager, ``SupportsHMA``).

vLLM gives each KV cache group (full attention, sliding window) its own block table over one
shared block pool; a block id belongs to one group at a time. In vLLM's allocation every KV
cache tensor is shared by one layer of each group (the groups' views alias the same bytes), so
the bytes of engine block ``b`` across the distinct registered tensors are exactly what the
layers of the group holding ``b`` wrote: the worker side copies blocks as today, and only the
keys tell the groups apart (each group has its own key namespace: its index and its spec).

What a hit is, what each group stores and which reused sliding-window blocks to fence is
decided in Rust (kvx-connector's ``groups``, through ``kvx._native.SchedulerSide``): a hit is
the longest prefix every group can serve, one kvx job over the blocks of every group; a
sliding-window group stores only the blocks still in its window; a block that was a
sliding-window store source and is handed out again is fenced before the step's forward may
write it. Here: vLLM's specs and scheduler output turned into plain data, and a failed load
reported per request (``failed_recving``): vLLM refuses block-level ``invalid_block_ids`` with
more than one group; the request restarts from its local prefix and is offered only the blocks
before the first failed one (of any group).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvx.vllm.log import logger
from kvx.vllm.meta import KvxConnectorMetadata
from kvx.vllm.scheduler_side import SchedulerSide


@dataclass(frozen=True)
class Group:
    """One KV cache group as kvx treats it."""

    index: int
    # None: full attention (every block of a prefix is read); else the sliding window in tokens.
    window: int | None
    extra_retained: int
    namespace: bytes

    def skipped(self, tokens: int) -> int:
        """Tokens vLLM skips (frees) for a prefix of ``tokens`` (its ``get_num_skipped_tokens``)."""
        if self.window is None:
            return 0
        return max(0, tokens - self.window + 1 - self.extra_retained)


def describe_groups(kv_cache_config: Any, namespace: bytes) -> list[Group]:
    """kvx's view of vLLM's KV cache groups; a kind kvx cannot serve raises ValueError naming it."""
    groups = kv_cache_config.kv_cache_groups
    sizes = {g.kv_cache_spec.block_size for g in groups}
    if len(sizes) != 1:
        raise ValueError(f"KvxConnector: KV cache groups with different block sizes {sorted(sizes)}; kvx needs one")
    out = []
    for i, g in enumerate(groups):
        spec = g.kv_cache_spec
        if isinstance(spec, SlidingWindowSpec):
            window: int | None = int(spec.sliding_window)
            extra = int(getattr(spec, "extra_retained_tokens", 0) or 0)
        elif isinstance(spec, FullAttentionSpec):
            window, extra = None, 0
        else:
            raise ValueError(
                f"KvxConnector: KV cache group {i} ({type(spec).__name__}, layers {list(g.layer_names)[:4]}): "
                "kvx serves full-attention and sliding-window groups only"
            )
        kind = "full" if window is None else f"sw{window}+{extra}"
        ns = namespace + f"|group{i}:{type(spec).__name__}:{kind}".encode()
        out.append(Group(i, window, extra, ns))
    return out


class HybridSchedulerSide(SchedulerSide):
    """The scheduler side over several KV cache groups (see the module docs): the native side
    keys each request in every group's namespace and plans hits, stores and fences."""

    def __init__(
        self,
        config: str,
        block_size: int,
        hash_block_size: int,
        groups: list[Group],
        tp_size: int = 1,
        pp_size: int = 1,
    ):
        super().__init__(
            config, block_size, hash_block_size, [g.namespace for g in groups], tp_size=tp_size, pp_size=pp_size,
            groups=[(g.window, g.extra_retained) for g in groups],
        )
        self.groups = groups

    @property
    def fenced_blocks(self) -> int:
        return self.native.fenced_blocks

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> list[int] | None:
        loaded = super().update_state_after_alloc(request, blocks, num_external_tokens)
        if loaded is None and num_external_tokens:
            logger.error("kvx: %s: an allocation for a load kvx did not plan", request.request_id)
        return loaded

    def hit_sources(self, request: Any, num_external_tokens: int) -> dict:
        if num_external_tokens == 0 or request.request_id not in self.requests:
            return {}
        host, file = self.native.hit(request.request_id)
        disk = 0
        if file:
            disk = num_external_tokens * file // (host + file) // self.block_size * self.block_size
        out = {CacheHitSource.DISK: disk, CacheHitSource.HOST: num_external_tokens - disk}
        return {k: v for k, v in out.items() if v > 0}

    def build_connector_meta(self, so: Any) -> KvxConnectorMetadata:
        # Blocks handed out this step that a queued sliding-window store may still read: the
        # workers fence them before this step's stores are queued.
        self.native.fence(sorted(_new_blocks(so)))
        self._preempted(so)
        for req_id, request, first, end in self._completing(so):
            computed = request.num_computed_tokens + so.num_scheduled_tokens[req_id]
            tables = [list(ids) for ids in self.cache_manager.get_block_ids(req_id)]
            self.native.save_groups(req_id, request.block_hashes, first, end, computed, tables)
        return KvxConnectorMetadata(self.native.build_meta())


def _new_blocks(so: Any) -> set[int]:
    """Engine blocks this step's scheduler output hands to requests (new, resumed, grown, copied
    into, zeroed)."""
    out: set[int] = set()
    for nr in so.scheduled_new_reqs or ():
        for ids in nr.block_ids or ():
            out.update(ids)
    cached = so.scheduled_cached_reqs
    for groups in getattr(cached, "new_block_ids", None) or ():
        for ids in groups or ():
            out.update(ids)
    out.update(getattr(so, "new_block_ids_to_zero", None) or ())
    for c in getattr(so, "kv_cache_block_copies", None) or ():
        out.add(c.dst_block_id)
    out.discard(0)
    return out
