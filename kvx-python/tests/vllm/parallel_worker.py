"""One vLLM worker process for the tensor-/pipeline-parallel tests: vLLM's parallel state
initialised as its multiprocess executor does (gloo on CPU), the worker-side KvxConnector created
the way vLLM creates it, vLLM's own per-step connector driver (ActiveKVConnector), and a fake
model that writes and checks only this worker's shard of each block: its heads (tensor
parallel) of its layers (pipeline parallel)."""

from __future__ import annotations

import pickle
import traceback
from typing import Any

import torch

from harness import BLOCK, HEAD

KV_HEADS = 4  # divisible by every tensor-parallel size tested
_ARANGE = torch.arange(KV_HEADS * HEAD, dtype=torch.int64)


def slot_words(h: int, layer: int, plane: int) -> torch.Tensor:
    """All heads' int16 words of one token slot in one K or V plane (harness.slot_words's
    formula over 4 heads); a worker writes and checks its own heads of them."""
    base = (h ^ ((layer * 2 + plane + 1) * 0x5BD1E995)) & 0xFFFF
    return ((base + _ARANGE * 0x3B + (h >> 16)) & 0xFFFF).to(torch.int16)


def build_config(model_dir: str, tp: int, pp: int, extra: dict, policy: str, num_blocks: int,
                 kv_role: str = "kv_both") -> Any:
    """The engine's VllmConfig (the same in the scheduler and every worker)."""
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
        VllmConfig,
    )

    model = ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="float16", max_model_len=2048)
    cfg = VllmConfig(
        model_config=model,
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=False),
        parallel_config=ParallelConfig(tensor_parallel_size=tp, pipeline_parallel_size=pp,
                                       distributed_executor_backend="mp"),
        scheduler_config=SchedulerConfig(max_model_len=2048, is_encoder_decoder=False, max_num_seqs=8,
                                         max_num_batched_tokens=512, enable_chunked_prefill=True),
        device_config=DeviceConfig("cpu"),
        kv_transfer_config=KVTransferConfig(kv_connector="KvxConnector", kv_connector_module_path="kvx.vllm",
                                            kv_role=kv_role, kv_load_failure_policy=policy,
                                            kv_connector_extra_config=extra),
    )
    cfg.cache_config.num_gpu_blocks = num_blocks
    return cfg


def kv_cache_config(num_blocks: int, layers: list[int], heads: int) -> Any:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec([f"layer{i}" for i in layers],
                                          FullAttentionSpec(block_size=BLOCK, num_kv_heads=heads,
                                                            head_size=HEAD, dtype=torch.float16))],
    )


class Shard:
    """This worker's KV tensors and the fake model over its shard."""

    def __init__(self, tp_rank: int, tp: int, pp_rank: int, pp: int, layers: int, num_blocks: int):
        self.heads = KV_HEADS // tp
        self.h0 = tp_rank * self.heads
        per = layers // pp
        self.layers = list(range(pp_rank * per, (pp_rank + 1) * per))
        self.kv = {f"layer{i}": torch.zeros((2, num_blocks, BLOCK, self.heads, HEAD), dtype=torch.float16)
                   for i in self.layers}

    def words(self, h: int, layer: int, plane: int) -> torch.Tensor:
        full = slot_words(h, layer, plane).view(KV_HEADS, HEAD)
        return full[self.h0 : self.h0 + self.heads]

    def write(self, block: int, off: int, h: int) -> None:
        for layer in self.layers:
            t = self.kv[f"layer{layer}"].view(torch.int16)
            for plane in range(2):
                t[plane, block, off] = self.words(h, layer, plane)

    def check(self, block: int, states: list[int]) -> str | None:
        for layer in self.layers:
            t = self.kv[f"layer{layer}"].view(torch.int16)
            for plane in range(2):
                want = torch.stack([self.words(s, layer, plane) for s in states])
                if not torch.equal(t[plane, block], want):
                    return f"engine block {block} layer {layer} plane {plane}"
        return None


def main(rank: int, tp: int, pp: int, port: int, model_dir: str, extra: dict, policy: str,
         num_blocks: int, layers: int, conn: Any, kv_role: str = "kv_both") -> None:
    """Serve steps from ``conn`` until told to stop: (scheduler output, writes, checks) in,
    (kv_connector_output, check failures, verified blocks) out, all pickled."""
    try:
        from vllm.config import set_current_vllm_config
        from vllm.distributed.kv_transfer import kv_transfer_state
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank
        from vllm.v1.worker.gpu.kv_connector import ActiveKVConnector
        from vllm.v1.worker.gpu_worker import init_worker_distributed_environment

        cfg = build_config(model_dir, tp, pp, extra, policy, num_blocks, kv_role)
        with set_current_vllm_config(cfg):
            init_worker_distributed_environment(cfg, rank, f"tcp://127.0.0.1:{port}", rank, "gloo")
            tp_rank, pp_rank = get_tensor_model_parallel_rank(), get_pp_group().rank_in_group
            shard = Shard(tp_rank, tp, pp_rank, pp, layers, num_blocks)
            kcc = kv_cache_config(num_blocks, shard.layers, shard.heads)
            worker = KVConnectorFactory.create_connector(cfg, KVConnectorRole.WORKER, kcc)
            kv_transfer_state._KV_CONNECTOR_AGENT = worker
            driver = ActiveKVConnector(cfg, shard.kv)
        conn.send(("ready", (tp_rank, pp_rank)))
    except Exception:
        conn.send(("error", traceback.format_exc()))
        return
    verified = 0
    while True:
        msg = conn.recv()
        if msg is None:
            break
        op, payload = msg
        try:
            if op == "step":
                so, writes, checks = pickle.loads(payload)
                bad = []
                if so.total_num_scheduled_tokens == 0:
                    out = driver.no_forward(so)
                else:
                    driver.pre_forward(so)
                    for req_id, blocks, states in checks:
                        for b, block in enumerate(blocks):
                            why = shard.check(block, states[b * BLOCK : (b + 1) * BLOCK])
                            if why is not None:
                                bad.append(f"rank {rank}: {req_id} block {b}: {why}")
                            else:
                                verified += 1
                    for block, off, h in writes:
                        shard.write(block, off, h)
                    driver.finish_forward()
                    from vllm.v1.outputs import ModelRunnerOutput

                    out = ModelRunnerOutput(req_ids=[], req_id_to_index={})
                    out.kv_connector_output = driver.post_forward(so.finished_req_ids)
                conn.send(("ok", pickle.dumps((out.kv_connector_output, bad, verified))))
            elif op == "state":
                st = worker.state_counts()
                st["file_blocks"] = worker._worker.native.file_blocks()
                conn.send(("ok", st))
        except Exception:
            conn.send(("error", traceback.format_exc()))
    worker.shutdown()
    kv_transfer_state._KV_CONNECTOR_AGENT = None
    conn.send(("bye", None))
