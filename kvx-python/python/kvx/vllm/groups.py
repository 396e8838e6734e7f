"""Hybrid models: several KV cache groups (vLLM's hybrid KV cache manager, ``SupportsHMA``).

vLLM gives each KV cache group (full attention, sliding window) its own block table over one
shared block pool; a block id belongs to one group at a time. In vLLM's allocation every KV
cache tensor is shared by one layer of each group (the groups' views alias the same bytes), so
the bytes of engine block ``b`` across the distinct registered tensors are exactly what the
layers of the group holding ``b`` wrote: the worker side copies blocks as today, and only the
keys tell the groups apart (each group has its own key namespace: its index and its spec).

Scheduler side, for a request whose local prefix ends at block ``first``:

- a hit of blocks ``[first, end)`` is one every group can serve: each full-attention group holds
  all of them, each sliding-window group holds the blocks vLLM keeps for a prefix of ``end``
  blocks (those its manager does not skip, ``get_num_skipped_tokens``); ``end`` shrinks until
  all groups agree, and the whole load is one kvx job over the blocks of every group;
- stores: full-attention groups store every computed full block; a sliding-window group stores
  only the blocks still in its window once the step's tokens are computed (a block already out
  of the window is never read again and vLLM frees it at once);
- vLLM frees sliding-window blocks while the request runs, possibly while their store is still
  queued: a block that was a sliding-window store source and is handed out again is fenced
  (its queued stores flushed and waited for) before the step's forward may write it;
- a failed load is reported per request (``failed_recving``): vLLM refuses block-level
  ``invalid_block_ids`` with more than one group; the request restarts from its local prefix and
  is offered only the blocks before the first failed one (of any group).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvx import _native
from kvx._native import KEY_BYTES
from kvx.vllm.log import logger
from kvx.vllm.meta import KvxConnectorMetadata
from kvx.vllm.scheduler_side import SchedulerSide
from kvx.vllm.settings import Settings
from kvx.vllm.worker_side import WorkerSide


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


class HybridConnectorMetadata(KvxConnectorMetadata):
    """``KvxConnectorMetadata`` with what the worker needs for several groups: ``fence``, engine
    blocks to fence before this step's stores are queued; ``load_blocks``, the engine blocks of
    each request whose load starts (to report a failed load per request)."""

    __slots__ = ("fence", "load_blocks")

    def __init__(self, base: KvxConnectorMetadata, fence: list[int], load_blocks: dict[str, list[int]]):
        super().__init__(base.step, base.loads, base.delayed, base.abandoned)
        self.fence = fence
        self.load_blocks = load_blocks

    def __getstate__(self) -> tuple[Any, ...]:
        return (super().__getstate__(), self.fence, self.load_blocks)

    def __setstate__(self, state: tuple[Any, ...]) -> None:
        base, self.fence, self.load_blocks = state
        super().__setstate__(base)


@dataclass
class _Plan:
    """A hit waiting for vLLM's allocation: blocks ``[first, end)``, and per group the block
    indices to load."""

    first: int
    end: int
    wanted: list[list[int]] = field(default_factory=list)


class HybridSchedulerSide(SchedulerSide):
    """The scheduler side over several KV cache groups (see the module docs)."""

    def __init__(
        self,
        config: str,
        block_size: int,
        hash_block_size: int,
        namespace: bytes,
        groups: list[Group],
        tp_size: int = 1,
        pp_size: int = 1,
    ):
        super().__init__(config, block_size, hash_block_size, namespace, tp_size=tp_size, pp_size=pp_size)
        self.groups = groups
        # Per request id: each group's keys (KEY_BYTES each) and how many hashes they cover.
        self._gkeys: dict[str, list[bytearray]] = {}
        self._ghashes: dict[str, int] = {}
        self._plans: dict[str, _Plan] = {}
        # Sliding-window store sources whose store may still be queued or copying.
        self._sw_sources: set[int] = set()
        # Engine blocks of each load queued this step, by request id, for the worker.
        self._load_blocks: dict[str, list[int]] = {}
        self.fenced_blocks = 0

    def skipped(self, g: Group, tokens: int) -> int:
        """Tokens of a prefix of ``tokens`` that group ``g`` does not keep: asked of vLLM's own
        manager of the group when bound, else from the group's spec."""
        try:
            manager = self.cache_manager.coordinator.single_type_managers[g.index]
            return int(manager.get_num_skipped_tokens(tokens))
        except (AttributeError, IndexError, TypeError):
            return g.skipped(tokens)

    # -- keys ------------------------------------------------------------------------------
    def group_keys(self, request: Any) -> list[bytearray]:
        """Each group's keys of the request's full blocks."""
        rid = request.request_id
        keys = self._gkeys.setdefault(rid, [bytearray() for _ in self.groups])
        done = self._ghashes.get(rid, 0)
        hashes = request.block_hashes
        n = len(hashes) // self.ratio
        if n * self.ratio > done:
            new = [bytes(hashes[(i + 1) * self.ratio - 1]) for i in range(done // self.ratio, n)]
            for g in self.groups:
                keys[g.index] += _native.block_keys(g.namespace, new)
            self._ghashes[rid] = n * self.ratio
        return keys

    def _forget(self, req_id: str) -> None:
        self._gkeys.pop(req_id, None)
        self._ghashes.pop(req_id, None)
        self._plans.pop(req_id, None)

    def _wanted(self, g: Group, first: int, end: int) -> list[int]:
        """Block indices of ``[first, end)`` group ``g`` reads for a prefix of ``end`` blocks."""
        lo = max(first, self.skipped(g, end * self.block_size) // self.block_size)
        return list(range(lo, end))

    def _present(self, number: int, keys: bytes) -> int | None:
        """How many of ``keys`` (from the first) the tiers hold; None: ask again later."""
        if not keys:
            return 0
        found = self.native.get_num_new_matched_tokens(number, keys, 0)
        return None if found is None else found[0] // self.block_size

    # -- vLLM's scheduler-side calls -----------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        r = self._req(request)
        self.stats.lookups += 1
        self._plans.pop(request.request_id, None)
        keys = self.group_keys(request)
        bs = self.block_size
        first = num_computed_tokens // bs
        # The last token is always computed by vLLM (its logits; a sliding window needs it).
        end = min(len(keys[0]) // KEY_BYTES, max(0, request.num_tokens - 1) // bs)
        if r.cap is not None:
            end = min(end, r.cap)
        for g in self.groups:
            if g.window is None and end > first:
                n = self._present(r.number, bytes(keys[g.index][first * KEY_BYTES : end * KEY_BYTES]))
                if n is None:
                    return self._none(r.number)
                end = first + n
        while end > first:
            shrunk = False
            for g in self.groups:
                if g.window is None:
                    continue
                want = self._wanted(g, first, end)
                lo = want[0] if want else end
                n = self._present(r.number, bytes(keys[g.index][lo * KEY_BYTES : end * KEY_BYTES]))
                if n is None:
                    return self._none(r.number)
                if n < end - lo:
                    end = lo + n  # the hit must end before the first block this group lacks
                    shrunk = True
                    break
            if not shrunk:
                break
        if end <= first:
            self._present(r.number, b"")  # drop kvx's pending lookup
            return 0, False
        plan = _Plan(first, end, [self._wanted(g, first, end) for g in self.groups])
        composite = b"".join(
            bytes(keys[g.index][j * KEY_BYTES : (j + 1) * KEY_BYTES]) for g in self.groups for j in plan.wanted[g.index]
        )
        found = self.native.get_num_new_matched_tokens(r.number, composite, 0)
        if found is None:
            return self._none(r.number)
        if found[0] != len(composite) // KEY_BYTES * bs:
            self._present(r.number, b"")
            return 0, False
        self._plans[request.request_id] = plan
        r.local_tokens = num_computed_tokens
        r.hit = (found[1], found[2])
        tokens = (end - first) * bs
        return tokens, True

    def _none(self, number: int) -> tuple[int | None, bool]:
        self._present(number, b"")
        return None, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if num_external_tokens == 0:
            return
        r = self._req(request)
        plan = self._plans.pop(request.request_id, None)
        if plan is None:
            logger.error("kvx: %s: an allocation for a load kvx did not plan", request.request_id)
            return
        ids = blocks.get_block_ids()
        engine: list[int] = []
        for g in self.groups:
            wanted = set(plan.wanted[g.index])
            for j in range(plan.first, plan.end):
                b = ids[g.index][j] if j < len(ids[g.index]) else 0
                if (j in wanted) != (b != 0):
                    raise RuntimeError(
                        f"KvxConnector: group {g.index} of {request.request_id}: block {j} is "
                        f"{'the null block' if b == 0 else f'engine block {b}'}, kvx planned "
                        f"{'a load' if j in wanted else 'none'}"
                    )
                if b:
                    engine.append(b)
        if self.native.update_state_after_alloc(r.number, engine):
            self._load_started(request.request_id, r, num_external_tokens)
            self._load_blocks[request.request_id] = engine

    def hit_sources(self, request: Any, num_external_tokens: int) -> dict:
        r = self.reqs.get(request.request_id)
        if r is None or num_external_tokens == 0:
            return {}
        host, file = r.hit
        disk = 0
        if file:
            disk = num_external_tokens * file // (host + file) // self.block_size * self.block_size
        out = {CacheHitSource.DISK: disk, CacheHitSource.HOST: num_external_tokens - disk}
        return {k: v for k, v in out.items() if v > 0}

    def build_connector_meta(self, so: Any) -> KvxConnectorMetadata:
        # Blocks handed out this step that a queued sliding-window store may still read.
        fence = sorted(self._sw_sources.intersection(_new_blocks(so)))
        self._sw_sources.difference_update(fence)
        self.fenced_blocks += len(fence)
        self._preempted(so)
        bs = self.block_size
        for req_id, r, first, end in self._completing(so):
            done = r.request.num_computed_tokens
            n = so.num_scheduled_tokens[req_id]
            keys = self.group_keys(r.request)
            upto = min(end, len(keys[0]) // KEY_BYTES)
            if upto <= first:
                continue
            ids = self.cache_manager.get_block_ids(req_id)
            pairs_k: list[bytes] = []
            pairs_b: list[int] = []
            sw: list[int] = []
            for g in self.groups:
                lo = max(first, self.skipped(g, done + n) // bs)
                for j in range(lo, upto):
                    b = ids[g.index][j]
                    if b == 0:
                        continue
                    pairs_k.append(bytes(keys[g.index][j * KEY_BYTES : (j + 1) * KEY_BYTES]))
                    pairs_b.append(b)
                    if g.window is not None:
                        sw.append(b)
            if pairs_b and self.native.save_blocks(r.number, b"".join(pairs_k), pairs_b):
                self.stats.store_jobs += 1
                self._sw_sources.update(sw)
        abandoned, self._abandoned = self._abandoned, []
        step, loads, delayed = self.native.build_meta(abandoned)
        names = {n: self.names[n] for n in loads}
        base = KvxConnectorMetadata(step, names, {n: self.names[n] for n in delayed}, abandoned)
        load_blocks = {name: self._load_blocks.pop(name, []) for name in names.values()}
        return HybridConnectorMetadata(base, fence, load_blocks)

    def _cap(self, number: int, failed: bytes) -> None:
        """Stop offering a request the blocks from its first failed one on, in any group."""
        name = self.names.get(number, "")
        r = self.reqs.get(name)
        if r is None:
            return
        index: dict[bytes, int] = {}
        for k in self._gkeys.get(name, []):
            index.update({bytes(k[i : i + KEY_BYTES]): i // KEY_BYTES for i in range(0, len(k), KEY_BYTES)})
        for i in range(0, len(failed), KEY_BYTES):
            idx = index.get(failed[i : i + KEY_BYTES])
            if idx is not None:
                r.cap = idx if r.cap is None else min(r.cap, idx)
        self.stats.failed_loads += 1

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict | None]:
        self._forget(request.request_id)
        return super().request_finished(request, block_ids)

    def state_counts(self) -> dict[str, int]:
        out = super().state_counts()
        out["group_requests"] = len(self._gkeys) + len(self._plans) + len(self._load_blocks)
        return out


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


class HybridWorkerSide(WorkerSide):
    """The worker side over several KV cache groups: fences reused sliding-window store sources
    before the step's stores are queued, and reports a failed load per request."""

    def __init__(
        self, settings: Settings, block_size: int, num_blocks: int, shard: tuple[int, int, int, int] | None = None
    ):
        super().__init__(settings, block_size, num_blocks, shard=shard)
        self.load_blocks: dict[str, set[int]] = {}

    def start(self, meta: KvxConnectorMetadata) -> None:
        if self._started is meta:
            return
        if isinstance(meta, HybridConnectorMetadata):
            if meta.fence and self.native is not None:
                self.order_after_engine(meta)
                # Before start_step queues this step's stores (a fence flushes queued stores). A
                # fence that does not hold raises FenceNotHeldError out of the step.
                self.native.fence_blocks(meta.fence)
            for name, blocks in meta.load_blocks.items():
                self.load_blocks[name] = set(blocks)
        super().start(meta)

    def transfer_results(self) -> KVConnectorTransferResults:
        """finished_sending, finished_recving, and the requests whose load failed in any block."""
        sending, recving = self.get_finished()
        invalid = self.take_invalid()
        failed: set[str] = set()
        for name in recving or ():
            blocks = self.load_blocks.pop(name, set())
            if blocks & invalid:
                failed.add(name)
                invalid -= blocks
        if invalid:
            logger.warning("kvx: %d failed blocks of no reported load", len(invalid))
        live = {self.names[n] for n in self.loading if n in self.names}
        for name in [n for n in self.load_blocks if n not in live]:
            del self.load_blocks[name]
        return KVConnectorTransferResults(
            finished_sending=set(sending or ()),
            finished_recving=set(recving or ()),
            failed_recving=failed,
        )

    def state_counts(self) -> dict[str, int]:
        out = super().state_counts()
        out["group_loads"] = len(self.load_blocks)
        return out
