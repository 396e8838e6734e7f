"""SGLang host pools on CPU, and kvx's backend built over one by SGLang's own factory.

SGLang's own classes (sglang 0.5.23, installed without its GPU stack by kvx-python/ci.sh). Where
sglang is not installed the tests that import this module skip with one line, unless
KVX_SGLANG_REQUIRED=1 (CI)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

try:
    import sglang.srt.mem_cache.hicache_storage  # noqa: F401
except ImportError as e:
    if os.environ.get("KVX_SGLANG_REQUIRED") == "1":
        raise
    print(f"skip: tests/hicache: sglang is not installed ({e})")
    pytest.skip(f"sglang is not installed ({e})", allow_module_level=True)

from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

PAGE = 4
LAYERS = 2
HEADS = 2
HEAD_DIM = 8
DEVICE_TOKENS = 64
LAYOUTS = ["layer_first", "page_first", "page_first_direct"]


def device_pool(dtype: torch.dtype = torch.bfloat16, page: int = PAGE) -> Any:
    """A real MHA device pool, in host memory (SGLang's CPU device)."""
    return MHATokenToKVPool(
        DEVICE_TOKENS, page, dtype, HEADS, HEAD_DIM, LAYERS, "cpu", False, start_layer=0, end_layer=LAYERS - 1
    )


def mha_host(kv: Any, layout: str) -> Any:
    """A real MHA host pool of twice ``kv``'s size in host memory, filled with random values."""
    host = MHATokenToKVPoolHost(
        kv.get_device_pool_infos()[0].buffer_info,
        2,
        0,
        kv.page_size,
        layout,
        pin_memory=False,
        device="cpu",
        device_capacity_tokens=kv.size,
        start_layer=kv.start_layer,
        end_layer=kv.end_layer,
        write_back_staging=kv.hicache_write_back_staging,
    )
    fill(host)
    return host


def host_pool(layout: str = "page_first", dtype: torch.dtype = torch.bfloat16, page: int = PAGE) -> Any:
    """A real MHA host pool over a fresh device pool, filled with random values."""
    return mha_host(device_pool(dtype, page), layout)


def mla_host_pool(layout: str = "page_first") -> Any:
    """A real MLA host pool (latent KV of 16 + rope of 8 per token) in host memory, filled."""
    kv = MLATokenToKVPool(DEVICE_TOKENS, PAGE, torch.bfloat16, 16, 8, LAYERS, "cpu", False, start_layer=0, end_layer=1)
    host = MLATokenToKVPoolHost(
        kv.get_device_pool_infos()[0].buffer_info,
        2.0,
        0,
        PAGE,
        layout,
        pin_memory=False,
        device="cpu",
        device_capacity_tokens=kv.size,
        start_layer=0,
        end_layer=LAYERS - 1,
        target_layer_num=LAYERS,
    )
    fill(host)
    return host


def fill(host: Any) -> None:
    host.kv_buffer.copy_(torch.randn(host.kv_buffer.shape).to(host.kv_buffer.dtype))


def storage_config(
    kvx: dict, *, tp_rank: int = 0, tp_size: int = 1, model: str = "kvx-test", mla: bool = False, **extra: Any
) -> Any:
    return HiCacheStorageConfig(
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=mla,
        enable_storage_metrics=False,
        is_page_first_layout=True,
        model_name=model,
        extra_config={
            "backend_name": "kvx",
            "module_path": "kvx.sglang",
            "class_name": "KvxStorage",
            "interface_v1": 1,
            "kvx": kvx,
            **extra,
        },
    )


def file_tier(root: Path, **kvx: Any) -> dict:
    root.mkdir(parents=True, exist_ok=True)
    return {"host_blocks": 8, "file": {"roots": [str(root)], "blocks": 4096}, **kvx}


def backend(config: Any, host: Any) -> Any:
    """kvx's backend as SGLang attaches one: built by the factory, then the pool registered."""
    b = StorageBackendFactory.create_backend("dynamic", config, host)
    b.register_mem_pool_host(host)
    b.on_host_pools_registered()
    return b


def indices(first_page: int, pages: int, page: int = PAGE) -> torch.Tensor:
    return torch.arange(first_page * page, (first_page + pages) * page, dtype=torch.int64)


def page_bytes(host: Any, page_index: int) -> torch.Tensor:
    return host.get_data_page(page_index * host.page_size, flat=True).clone()
