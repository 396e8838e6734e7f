"""The engine settings every engine of the suite shares, with or without kvx, through
``vllm.LLM`` or ``vllm serve``: the same arithmetic in each (float32, eager, 32-token blocks,
the same prefill chunk), so greedy outputs compare token for token."""

from __future__ import annotations

import json
from typing import Any

BLOCK = 32
KV_CACHE_BYTES = 64 << 20

SHARED: dict[str, Any] = {
    "dtype": "float32",
    "block_size": BLOCK,
    "max_model_len": 512,
    "max_num_batched_tokens": 256,
    "enforce_eager": True,
    "seed": 0,
    "enable_prefix_caching": True,
}


def kv_transfer(kvx: dict | None) -> dict | None:
    """The kv_transfer_config of KvxConnector: ``kvx`` holds ``role``, ``policy``, ``extra``."""
    if kvx is None:
        return None
    return {
        "kv_connector": "KvxConnector",
        "kv_connector_module_path": "kvx.vllm",
        "kv_role": kvx.get("role", "kv_both"),
        "kv_load_failure_policy": kvx.get("policy", "recompute"),
        "kv_connector_extra_config": kvx["extra"],
    }


def llm_args(model: str, kvx: dict | None, num_blocks: int | None = None) -> dict[str, Any]:
    """``vllm.LLM`` keyword arguments."""
    kw: dict[str, Any] = {"model": model, **SHARED, "disable_log_stats": False}
    kw["kv_cache_memory_bytes"] = KV_CACHE_BYTES
    if num_blocks:
        kw["num_gpu_blocks_override"] = num_blocks
    kt = kv_transfer(kvx)
    if kt is not None:
        from vllm.config import KVTransferConfig

        kw["kv_transfer_config"] = KVTransferConfig(**kt)
    return kw


def serve_args(model: str, kvx: dict | None, port: int) -> list[str]:
    """``vllm serve`` arguments."""
    out = [model, "--host", "127.0.0.1", "--port", str(port)]
    for k, v in SHARED.items():
        flag = "--" + k.replace("_", "-")
        if v is True:
            out.append(flag)
        else:
            out += [flag, str(v)]
    out += ["--kv-cache-memory-bytes", str(KV_CACHE_BYTES)]
    kt = kv_transfer(kvx)
    if kt is not None:
        out += ["--kv-transfer-config", json.dumps(kt)]
    return out
