"""A CPU-only vLLM engine for the connector tests: vLLM's real v1 Scheduler and its own
worker-side connector driver (ActiveKVConnector), with a fake model whose forward writes
token-derived bytes into a CPU paged KV tensor, so every block kvx loads is checked byte for byte.
"""

from __future__ import annotations

import json
import pickle
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer import kv_transfer_state
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.gpu.kv_connector import ActiveKVConnector

BLOCK = 16
LAYERS = 2
KV_HEADS = 2
HEAD = 32
VOCAB = 1000
SLOT = KV_HEADS * HEAD  # int16 words of one token slot in one K or V plane

init_none_hash(sha256)
_HASHER = get_request_block_hasher(BLOCK, sha256)


def model_config(architecture: str, model_type: str, layers: int, dtype: str, **more: Any) -> dict:
    """A small model's config.json fields (KV_HEADS heads of HEAD, VOCAB tokens), with ``more``."""
    return {
        "architectures": [architecture],
        "model_type": model_type,
        "hidden_size": KV_HEADS * HEAD,
        "intermediate_size": 128,
        "num_attention_heads": KV_HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD,
        "num_hidden_layers": layers,
        "vocab_size": VOCAB,
        "max_position_embeddings": 4096,
        "torch_dtype": dtype,
        **more,
    }


def write_config_dir(root: Path, name: str, config: dict) -> Path:
    """A local model directory ``root/name`` holding only ``config`` as config.json (no weights).
    Engines in several processes share one model directory (P/D: the model's path is part of
    kvx's key namespace), so an unchanged config is not rewritten while another engine reads it."""
    d = root / name
    d.mkdir(parents=True, exist_ok=True)
    text = json.dumps(config)
    f = d / "config.json"
    if not f.exists() or f.read_text() != text:
        f.write_text(text)
    return d


def write_model_dir(root: Path) -> Path:
    """A local model directory holding only a 2-layer Llama config.json (no weights)."""
    config = model_config("LlamaForCausalLM", "llama", LAYERS, "float16", rms_norm_eps=1e-5)
    return write_config_dir(root, "tiny-llama", config)


def chain(h: int, tok: int) -> int:
    """Prefix state after one more token (the fake model's "KV" depends on the whole prefix)."""
    return ((h * 1_000_003) ^ (tok + 0x9E3779B9)) & 0xFFFFFFFFFFFF


_ARANGE = torch.arange(SLOT, dtype=torch.int64)


def slot_words(h: int, layer: int, plane: int) -> torch.Tensor:
    """The int16 words the fake forward writes for a token whose prefix state is ``h``."""
    base = (h ^ ((layer * 2 + plane + 1) * 0x5BD1E995)) & 0xFFFF
    return ((base + _ARANGE * 0x3B + (h >> 16)) & 0xFFFF).to(torch.int16)


@dataclass
class Tracked:
    """What the harness knows about one request."""

    request: Request
    states: list[int] = field(default_factory=list)  # prefix state after each token
    entered_wait: float | None = None
    wait_started: list[float] = field(default_factory=list)  # when each wait for a load began
    waits: list[float] = field(default_factory=list)
    load_blocks: list[list[int]] = field(default_factory=list)  # block ids of each load
    blocks: set[int] = field(default_factory=set)  # every engine block it ever held while running
    finished_status: RequestStatus | None = None
    seen_scheduled: bool = False
    verified: int = 0  # blocks ``_check`` found exact (loaded or cached, never computed here)
    finished_at: float | None = None  # monotonic time of its finishing output
    params: dict | None = None  # the kv_transfer_params its finishing output returned
    sent_at: float | None = None  # monotonic time the worker reported it in finished_sending
    recv_at: list[float] = field(default_factory=list)  # each finished_recving report's time
    invalid: set[int] = field(default_factory=set)  # engine blocks of its loads reported invalid


def engine_config(
    model: ModelConfig, cache: CacheConfig, extra: dict, *, policy: str, kv_role: str,
    max_num_seqs: int, max_batched_tokens: int,
) -> VllmConfig:
    """vLLM's config of a test engine on CPU with KvxConnector (``extra``: its
    kv_connector_extra_config), chunked prefill on, 2048-token model length."""
    return VllmConfig(
        model_config=model,
        cache_config=cache,
        scheduler_config=SchedulerConfig(
            max_model_len=2048,
            is_encoder_decoder=False,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_batched_tokens,
            enable_chunked_prefill=True,
        ),
        device_config=DeviceConfig("cpu"),
        kv_transfer_config=KVTransferConfig(
            kv_connector="KvxConnector",
            kv_connector_module_path="kvx.vllm",
            kv_role=kv_role,
            kv_load_failure_policy=policy,
            kv_connector_extra_config=extra,
        ),
    )


class EngineLoop:
    """Stepping an engine until it is idle, and the state that says so: shared by ``Engine``
    and the hybrid-model engine (each has ``scheduler``, ``conn``, ``worker``, ``num_blocks``
    and ``step``)."""

    scheduler: Scheduler
    conn: Any
    worker: Any
    num_blocks: int
    vllm_config: VllmConfig
    kv_cache_config: Any
    tracked: dict

    # -- setting up, as vLLM's engine core and a worker do ----------------------------------
    def _start_worker_connector(self) -> None:
        """The worker side first: a KV cache kvx cannot serve must fail before any step."""
        self.worker = KVConnectorFactory.create_connector(
            self.vllm_config, KVConnectorRole.WORKER, self.kv_cache_config
        )
        kv_transfer_state._KV_CONNECTOR_AGENT = self.worker

    def _start_scheduler(self, kv_caches: dict) -> None:
        """vLLM's per-step worker driver over ``kv_caches``, its scheduler, and the records
        every engine keeps."""
        try:
            self.driver = ActiveKVConnector(self.vllm_config, kv_caches)
        except Exception:
            kv_transfer_state._KV_CONNECTOR_AGENT = None
            self.worker.shutdown()
            raise
        self.scheduler = Scheduler(
            self.vllm_config,
            self.kv_cache_config,
            StructuredOutputManager(self.vllm_config),
            block_size=BLOCK,
            log_stats=True,
        )
        self.conn = self.scheduler.connector
        self.tracked = {}
        self.invalid_reported: list[set[int]] = []
        self.recv_reported: set[str] = set()
        self.steps = 0
        # What update_from_output hands vLLM's stat loggers, each step (log_stats=True).
        self.scheduler_stats: list[Any] = []

    def _states(self, t: Any) -> list[int]:
        """The prefix state after each of a request's tokens so far."""
        h = t.states[-1] if t.states else 0
        for tok in t.request.all_token_ids[len(t.states) :]:
            h = chain(h, tok)
            t.states.append(h)
        return t.states

    def close(self) -> None:
        self.scheduler.shutdown()
        self.worker.shutdown()
        kv_transfer_state._KV_CONNECTOR_AGENT = None

    def run(self, timeout: float = 30.0, until=None) -> None:
        """Step until every request finished and kvx and vLLM are idle (or ``until()``)."""
        end = time.monotonic() + timeout
        while True:
            self.step()
            if until is not None and until():
                return
            if until is None and self.idle():
                return
            if time.monotonic() > end:
                raise AssertionError(f"not idle after {timeout}s: {self.state()}")
            if self.scheduler.get_num_unfinished_requests() == 0:
                time.sleep(0.001)

    # -- state ------------------------------------------------------------------------------
    def state(self) -> dict:
        s = self.scheduler
        return {
            "vllm_requests": len(s.requests),
            "vllm_unfinished": s.get_num_unfinished_requests(),
            "vllm_recving": len(s.finished_recving_kv_req_ids) + len(s.failed_recving_kv_req_ids),
            "vllm_used_blocks": self.num_blocks - 1 - s.kv_cache_manager.block_pool.get_num_free_blocks(),
            **{f"sched_{k}": v for k, v in self.conn.state_counts().items()},
            **{f"worker_{k}": v for k, v in self.worker.state_counts().items()},
        }

    def idle(self) -> bool:
        return all(v == 0 for v in self.state().values())


class Engine(EngineLoop):
    """One engine: scheduler + worker connector + fake model over CPU KV tensors."""

    def __init__(
        self,
        tmp: Path,
        extra: dict,
        *,
        num_blocks: int = 64,
        policy: str = "recompute",
        max_num_seqs: int = 8,
        max_batched_tokens: int = 128,
        kv_caches: dict | None = None,
        prefix_caching: bool = False,
        cross_layer: bool = False,
        layouts: list[str] | None = None,
        kv_role: str = "kv_both",
    ):
        """``layouts``: allocate the KV cache with vLLM's own functions, in the layout vLLM
        resolves when the attention backends support these (most preferred first, as a worker
        reports them); ``None``: the harness's own tensors (``kv_caches`` or the defaults)."""
        self.num_blocks = num_blocks
        model = ModelConfig(model=str(write_model_dir(tmp)), skip_tokenizer_init=True, dtype="float16",
                            max_model_len=2048)
        self.vllm_config = engine_config(
            model, CacheConfig(block_size=BLOCK, enable_prefix_caching=prefix_caching), extra,
            policy=policy, kv_role=kv_role, max_num_seqs=max_num_seqs, max_batched_tokens=max_batched_tokens,
        )
        self.vllm_config.cache_config.num_gpu_blocks = num_blocks
        spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD, dtype=torch.float16)
        groups = [KVCacheGroupSpec([f"layer{i}" for i in range(LAYERS)], spec)]
        self.layout: str | None = None
        if layouts is not None:
            # As vLLM's engine core and workers do: resolve one layout (the connector's
            # preference counts), plan the tensors for it, allocate them.
            self.kv_cache_config, kv_caches, self.layout = vllm_kv_caches(self.vllm_config, groups, layouts, num_blocks)
        else:
            self.kv_cache_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)
        self._start_worker_connector()
        self.cross_layer = cross_layer
        if kv_caches is None and cross_layer:
            # One tensor for all layers, a block one contiguous run: (blocks, layers, K/V, ...).
            big = torch.zeros((num_blocks, LAYERS, 2, BLOCK, KV_HEADS, HEAD), dtype=torch.float16)
            kv_caches = {f"layer{i}": big[:, i] for i in range(LAYERS)}
        elif kv_caches is None:
            # vLLM's flash-attention layout: (K/V, blocks, block size, kv heads, head size).
            kv_caches = {
                f"layer{i}": torch.zeros((2, num_blocks, BLOCK, KV_HEADS, HEAD), dtype=torch.float16)
                for i in range(LAYERS)
            }
        self.kv = kv_caches
        # [K/V, blocks, ...] tensors (the harness's default) or block-first ones.
        self.kv_first = self.kv["layer0"].shape[0] != num_blocks
        self._start_scheduler(kv_caches)
        self.verified_blocks = 0
        self.send_reported: list[str] = []
        self.meta_sizes: list[int] = []
        self.resumed_as_new = 0  # preempted requests that came back among the new ones (V2 runner)

    # -- requests ---------------------------------------------------------------------------
    def add(
        self, req_id: str, prompt: list[int], max_tokens: int = 2, kv_transfer_params: Any = None
    ) -> Tracked:
        """Queue a request; ``kv_transfer_params`` reaches the connector as a proxy sends it
        (P/D: ``{"do_remote_decode": True}`` on P, P's returned params on D)."""
        extra = None if kv_transfer_params is None else {"kv_transfer_params": kv_transfer_params}
        req = Request(
            req_id,
            prompt,
            SamplingParams(max_tokens=max_tokens, ignore_eos=True, extra_args=extra),
            None,
            block_hasher=_HASHER,
        )
        t = Tracked(req)
        self.tracked[req_id] = t
        self.scheduler.add_request(req)
        return t

    # -- the fake model ---------------------------------------------------------------------
    def _slot(self, layer: int, block: int, off: int) -> torch.Tensor:
        """int16 view of one token slot of one layer (K and V, every head), through the
        tensor's own strides: whatever the physical layout, the model reads and writes it
        only through these views, as attention kernels do."""
        t = self.kv[f"layer{layer}"].view(torch.int16)
        return t[:, block, off] if self.kv_first else t[block, :, off]

    @staticmethod
    def _words(h: int, layer: int) -> torch.Tensor:
        return torch.cat([slot_words(h, layer, 0), slot_words(h, layer, 1)])

    def _write(self, block: int, off: int, h: int) -> None:
        for layer in range(LAYERS):
            slot = self._slot(layer, block, off)
            slot.copy_(self._words(h, layer).view(slot.shape))

    def block_content(self, block: int) -> torch.Tensor:
        """What engine block ``block`` holds, every layer and slot, read through the views."""
        return torch.stack(
            [self._slot(layer, block, o).reshape(-1) for layer in range(LAYERS) for o in range(BLOCK)]
        )

    def _check(self, t: Tracked, upto: int) -> None:
        """Every full block below token ``upto`` holds its tokens' bytes."""
        states = self._states(t)
        ids = self.scheduler.kv_cache_manager.get_block_ids(t.request.request_id)[0]
        for b in range(upto // BLOCK):
            for layer in range(LAYERS):
                got = torch.stack([self._slot(layer, ids[b], o).reshape(-1) for o in range(BLOCK)])
                want = torch.stack([self._words(states[b * BLOCK + o], layer) for o in range(BLOCK)])
                if not torch.equal(got, want):
                    raise AssertionError(
                        f"{t.request.request_id}: block {b} (engine block {ids[b]}) layer {layer} "
                        "does not hold its tokens' bytes"
                    )
            self.verified_blocks += 1
            t.verified += 1

    def _forward(self, so) -> ModelRunnerOutput:
        req_ids, sampled = [], []
        for req_id, n in so.num_scheduled_tokens.items():
            t = self.tracked[req_id]
            req = t.request
            end = req.num_computed_tokens  # already advanced by the scheduler
            start = end - n
            resumed = self._resumed(so, req_id)
            if t.seen_scheduled and any(r.req_id == req_id for r in so.scheduled_new_reqs):
                self.resumed_as_new += 1
            if not t.seen_scheduled or start == 0 or resumed:
                # First time this request runs (or again after a preemption): whatever it did
                # not compute itself — local prefix cache, kvx loads — must already be exact.
                self._check(t, start)
                t.seen_scheduled = True
            states = self._states(t)
            ids = self.scheduler.kv_cache_manager.get_block_ids(req_id)[0]
            t.blocks.update(ids)
            for p in range(start, end):
                self._write(ids[p // BLOCK], p % BLOCK, states[p])
            req_ids.append(req_id)
            sampled.append([states[end - 1] % VOCAB] if end >= req.num_tokens else [])
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
        )

    @staticmethod
    def _resumed(so, req_id: str) -> bool:
        """Running again after a preemption: in ``resumed_req_ids`` (vLLM 0.32, and 0.33's V1
        model runner) or among the new requests with its whole block table (0.33's V2 runner)."""
        c = so.scheduled_cached_reqs
        if req_id in getattr(c, "resumed_req_ids", ()):
            return True
        return any(r.req_id == req_id for r in so.scheduled_new_reqs)

    # -- stepping ---------------------------------------------------------------------------
    def step(self) -> None:
        self.execute(self.schedule())

    def schedule(self):
        """vLLM's ``schedule()``: the scheduler output of one step, not yet run."""
        so = self.scheduler.schedule()
        now = time.monotonic()
        for t in self.tracked.values():
            if t.request.status == RequestStatus.WAITING_FOR_REMOTE_KVS and t.entered_wait is None:
                t.entered_wait = now
                t.wait_started.append(now)
                t.load_blocks.append(list(self.scheduler.kv_cache_manager.get_block_ids(t.request.request_id)[0]))
        return so

    def execute(self, so) -> None:
        """Run one scheduled step: worker connector, fake forward, ``update_from_output``."""
        # What crosses from the scheduler process to the worker is pickled, as in vLLM.
        wire = pickle.dumps(so.kv_connector_metadata)
        self.meta_sizes.append(len(wire))
        so.kv_connector_metadata = pickle.loads(wire)
        if so.total_num_scheduled_tokens == 0:
            out = self.driver.no_forward(so)
        else:
            self.driver.pre_forward(so)
            out = self._forward(so)
            self.driver.finish_forward()
            out.kv_connector_output = self.driver.post_forward(so.finished_req_ids)
        kvo = out.kv_connector_output
        now = time.monotonic()
        if kvo is not None and kvo.kv_connector_worker_meta is not None:
            kvo.kv_connector_worker_meta = pickle.loads(pickle.dumps(kvo.kv_connector_worker_meta))
        if kvo is not None:
            if kvo.invalid_block_ids:
                self.invalid_reported.append(set(kvo.invalid_block_ids))
            for r in kvo.finished_recving or ():
                self.recv_reported.add(r)
                t = self.tracked.get(r)
                if t is not None:
                    t.recv_at.append(now)
                    if t.load_blocks:
                        t.invalid |= set(kvo.invalid_block_ids or ()) & set(t.load_blocks[-1])
                if t is not None and t.entered_wait is not None:
                    t.waits.append(now - t.entered_wait)
                    t.entered_wait = None
            self.send_reported.extend(kvo.finished_sending or ())
            for r in kvo.finished_sending or ():
                if r in self.tracked:
                    self.tracked[r].sent_at = now
        outputs = self.scheduler.update_from_output(so, out)
        self.scheduler_stats.extend(eco.scheduler_stats for eco in outputs.values() if eco.scheduler_stats)
        for eco in outputs.values():
            for o in eco.outputs:
                if o.finish_reason is not None:
                    t = self.tracked[o.request_id]
                    t.finished_status = t.request.status
                    t.finished_at = now
                    t.params = o.kv_transfer_params
        self.steps += 1

    def keys_of(self, req_id: str) -> bytes:
        """kvx block keys of a request's full blocks (16 bytes each)."""
        side = self.conn._sched
        return side.keys_of(self.tracked[req_id].request)


def vllm_kv_caches(vllm_config, groups, layouts: list[str], num_blocks: int):
    """(KV cache config, KV caches, layout name) as vLLM makes them: ``resolve_kv_cache_layout``
    with ``layouts`` as every worker's supported list, the tensors planned for that layout, and
    ``allocate_kv_cache``. vLLM 0.33 moved ``get_kv_cache_config_from_groups`` to
    ``kv_cache_planning``."""
    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
    from vllm.v1.worker.utils import allocate_kv_cache

    try:
        from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups
    except ImportError:
        from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups

    specs = [g.kv_cache_spec for g in groups]
    layout = resolve_kv_cache_layout(vllm_config, [list(layouts)], specs)
    per_block = sum(g.kv_cache_spec.page_size_bytes * len(g.layer_names) for g in groups)
    kcc = get_kv_cache_config_from_groups(vllm_config, groups, per_block * num_blocks)
    assert kcc.num_blocks == num_blocks, (kcc.num_blocks, num_blocks)
    # The engine core hands the resolved layout to every worker in the KV cache config.
    kcc.kv_cache_layout = vllm_config.cache_config.kv_cache_layout
    return kcc, allocate_kv_cache(kcc, torch.device("cpu"), layout), layout.name


def prompt(seed: int, n: int) -> list[int]:
    """A deterministic prompt of ``n`` tokens."""
    x = seed * 7919 + 17
    out = []
    for _ in range(n):
        x = (x * 1103515245 + 12345) & 0x7FFFFFFF
        out.append(x % (VOCAB - 10) + 5)
    return out
