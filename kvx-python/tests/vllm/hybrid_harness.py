"""A CPU-only vLLM engine over a hybrid model (full-attention and sliding-window layers): vLLM's
real scheduler with its hybrid KV cache manager, KV cache groups from vLLM's own
``get_kv_cache_groups``, the KV cache allocated by vLLM's ``allocate_kv_cache`` (the groups'
layer views alias one buffer), vLLM's worker-side connector driver, and a fake model that writes
token- and layer-derived bytes, so every block of every group is checked byte for byte.
"""

from __future__ import annotations

import pickle
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from vllm.config import (
    CacheConfig,
    ModelConfig,
)
from vllm.platforms import current_platform
from vllm.sampling_params import SamplingParams
from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.worker.utils import allocate_kv_cache

from harness import _HASHER, BLOCK, HEAD, KV_HEADS, VOCAB, EngineLoop, engine_config, model_config, write_config_dir

try:  # vLLM 0.33
    from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups, get_kv_cache_groups
except ImportError:  # vLLM 0.32
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups, get_kv_cache_groups

LAYERS = 4  # sliding, full, sliding, full (Gemma-2's pattern)
WINDOW = 32
LAYER_NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


def unavailable() -> str | None:
    """Why vLLM's hybrid KV cache manager cannot run here, or None."""
    if not current_platform.support_hybrid_kv_cache():
        return (
            f"platform {type(current_platform).__name__} has no hybrid KV cache manager "
            "(set VLLM_TARGET_DEVICE=cpu)"
        )
    return None


def write_model_dir(root: Path) -> Path:
    """A local directory holding only a 4-layer Gemma-2 config.json (no weights)."""
    config = model_config(
        "Gemma2ForCausalLM",
        "gemma2",
        LAYERS,
        "bfloat16",
        sliding_window=WINDOW,
        rms_norm_eps=1e-6,
        query_pre_attn_scalar=HEAD,
        attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
        hidden_activation="gelu_pytorch_tanh",
    )
    return write_config_dir(root, "tiny-gemma2", config)


def layer_specs() -> dict:
    kw = {"block_size": BLOCK, "num_kv_heads": KV_HEADS, "head_size": HEAD, "dtype": torch.bfloat16}
    return {
        name: SlidingWindowSpec(sliding_window=WINDOW, **kw) if i % 2 == 0 else FullAttentionSpec(**kw)
        for i, name in enumerate(LAYER_NAMES)
    }


def token_words(h: int, layer: int, n: int) -> torch.Tensor:
    """The ``n`` int16 words the fake forward writes for one token of one layer."""
    base = (h ^ ((layer + 1) * 0x5BD1E995)) & 0xFFFF
    return ((base + torch.arange(n, dtype=torch.int64) * 0x3B + (h >> 16)) & 0xFFFF).to(torch.int16)


@dataclass
class Tracked:
    request: Request
    states: list[int] = field(default_factory=list)
    entered_wait: float | None = None
    waits: list[float] = field(default_factory=list)
    load_blocks: list[tuple[list[int], ...]] = field(default_factory=list)
    finished_status: RequestStatus | None = None
    seen_scheduled: bool = False


class HybridEngine(EngineLoop):
    """Scheduler + worker connector + fake model over vLLM-allocated CPU KV caches, two groups."""

    def __init__(
        self,
        tmp: Path,
        extra: dict,
        *,
        num_blocks: int = 64,
        policy: str = "recompute",
        max_num_seqs: int = 8,
        max_batched_tokens: int = 512,
        layout: str | None = None,
        prefix_caching: bool = False,
    ):
        self.num_blocks = num_blocks
        model = ModelConfig(
            model=str(write_model_dir(tmp)), skip_tokenizer_init=True, dtype="bfloat16", max_model_len=2048
        )
        cache = CacheConfig(block_size=BLOCK, num_gpu_blocks_override=num_blocks, enable_prefix_caching=prefix_caching)
        self.vllm_config = engine_config(
            model, cache, extra, policy=policy, kv_role="kv_both",
            max_num_seqs=max_num_seqs, max_batched_tokens=max_batched_tokens,
        )
        assert not self.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager, "HMA is off"
        specs = layer_specs()
        names = [layout] if layout else [m.name for m in KVCacheLayout]
        self.layout = resolve_kv_cache_layout(self.vllm_config, [names], list(specs.values()))
        groups = get_kv_cache_groups(self.vllm_config, specs)
        self.kv_cache_config = get_kv_cache_config_from_groups(self.vllm_config, groups, 1 << 34)
        assert self.kv_cache_config.num_blocks == num_blocks
        self.groups = [list(g.layer_names) for g in self.kv_cache_config.kv_cache_groups]
        self.sliding = [
            isinstance(g.kv_cache_spec, SlidingWindowSpec) for g in self.kv_cache_config.kv_cache_groups
        ]
        self.vllm_config.cache_config.num_gpu_blocks = num_blocks
        self._start_worker_connector()
        self.kv = allocate_kv_cache(self.kv_cache_config, torch.device("cpu"), self.layout)
        self._start_scheduler(self.kv)
        self.verified = [0] * len(self.groups)  # blocks checked byte for byte, per group
        self.failed_reported: set[str] = set()

    # -- requests ---------------------------------------------------------------------------
    def add(self, req_id: str, prompt: list[int], max_tokens: int = 2) -> Tracked:
        req = Request(
            req_id, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), None, block_hasher=_HASHER
        )
        t = Tracked(req)
        self.tracked[req_id] = t
        self.scheduler.add_request(req)
        return t

    def block_ids(self, req_id: str) -> tuple[list[int], ...]:
        return self.scheduler.kv_cache_manager.get_block_ids(req_id)

    # -- the fake model ---------------------------------------------------------------------
    def _slot(self, layer: int, block: int, off: int) -> torch.Tensor:
        """int16 view of one token slot of one layer in one block ([heads, C] of [B, H, N, C])."""
        return self.kv[LAYER_NAMES[layer]].view(torch.int16)[block, :, off, :]

    def _layer(self, name: str) -> int:
        return LAYER_NAMES.index(name)

    def _write(self, ids: tuple[list[int], ...], p: int, h: int) -> None:
        for g, layers in enumerate(self.groups):
            b = ids[g][p // BLOCK]
            assert b != 0, f"token {p} of group {g} falls into the null block"
            for name in layers:
                slot = self._slot(self._layer(name), b, p % BLOCK)
                slot.copy_(token_words(h, self._layer(name), slot.numel()).view(slot.shape))

    def _check(self, t: Tracked, upto: int) -> None:
        """Every block vLLM holds for the request below token ``upto``, in every group, holds
        its tokens' bytes for each of the group's layers; a sliding-window group holds at least
        its window."""
        states = self._states(t)
        ids = self.block_ids(t.request.request_id)
        for g, layers in enumerate(self.groups):
            held = [b for b in range(upto // BLOCK) if ids[g][b] != 0]
            if self.sliding[g] and upto >= BLOCK:
                # The blocks the window of the next token reads are all there.
                need = range(max(0, upto - WINDOW + 1) // BLOCK, upto // BLOCK)
                assert all(ids[g][b] != 0 for b in need), (t.request.request_id, g, ids[g])
            for b in held:
                for name in layers:
                    layer = self._layer(name)
                    for o in range(BLOCK):
                        got = self._slot(layer, ids[g][b], o)
                        want = token_words(states[b * BLOCK + o], layer, got.numel()).view(got.shape)
                        if not torch.equal(got, want):
                            raise AssertionError(
                                f"{t.request.request_id}: group {g} block {b} (engine block {ids[g][b]}) "
                                f"layer {layer} token {o} does not hold its bytes"
                            )
                self.verified[g] += 1

    def _forward(self, so) -> ModelRunnerOutput:
        req_ids, sampled = [], []
        resumed = getattr(so.scheduled_cached_reqs, "resumed_req_ids", ()) or ()
        for req_id, n in so.num_scheduled_tokens.items():
            t = self.tracked[req_id]
            req = t.request
            end = req.num_computed_tokens
            start = end - n
            if not t.seen_scheduled or start == 0 or req_id in resumed:
                self._check(t, start)
                t.seen_scheduled = True
            states = self._states(t)
            ids = self.block_ids(req_id)
            for p in range(start, end):
                self._write(ids, p, states[p])
            req_ids.append(req_id)
            sampled.append([states[end - 1] % VOCAB] if end >= req.num_tokens else [])
        return ModelRunnerOutput(
            req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)}, sampled_token_ids=sampled
        )

    # -- stepping ---------------------------------------------------------------------------
    def step(self) -> None:
        so = self.scheduler.schedule()
        now = time.monotonic()
        for t in self.tracked.values():
            if t.request.status == RequestStatus.WAITING_FOR_REMOTE_KVS and t.entered_wait is None:
                t.entered_wait = now
                t.load_blocks.append(tuple(list(x) for x in self.block_ids(t.request.request_id)))
        so.kv_connector_metadata = pickle.loads(pickle.dumps(so.kv_connector_metadata))
        if so.total_num_scheduled_tokens == 0:
            out = self.driver.no_forward(so)
        else:
            self.driver.pre_forward(so)
            out = self._forward(so)
            self.driver.finish_forward()
            out.kv_connector_output = self.driver.post_forward(so.finished_req_ids)
        kvo = out.kv_connector_output
        if kvo is not None:
            if kvo.kv_connector_worker_meta is not None:
                kvo.kv_connector_worker_meta = pickle.loads(pickle.dumps(kvo.kv_connector_worker_meta))
            if kvo.invalid_block_ids:
                self.invalid_reported.append(set(kvo.invalid_block_ids))
            self.failed_reported |= set(kvo.failed_recving or ())
            now = time.monotonic()
            for r in kvo.finished_recving or ():
                self.recv_reported.add(r)
                t = self.tracked.get(r)
                if t is not None and t.entered_wait is not None:
                    t.waits.append(now - t.entered_wait)
                    t.entered_wait = None
        outputs = self.scheduler.update_from_output(so, out)
        for eco in outputs.values():
            for o in eco.outputs:
                if o.finish_reason is not None:
                    t = self.tracked[o.request_id]
                    t.finished_status = t.request.status
        self.steps += 1

    def keys_of(self, req_id: str, group: int) -> bytes:
        """kvx block keys of one group of a request's full blocks (16 bytes each)."""
        side = self.conn._sched
        return side.keys_of(self.tracked[req_id].request, group)
