"""What the connector reads from vLLM's config, the same way on vLLM 0.32 and 0.33: the
resolved KV cache layout, the layout kvx prefers, and the size of the largest store job."""

from __future__ import annotations

import math
from typing import Any

from kvx.vllm.log import logger

#: Versions of vLLM this package was tested with (``pyproject.toml`` declares the range).
TESTED_VLLM = ("0.32.0", "0.33.0")

#: The layout kvx asks for: blocks outermost, so a block of every layer is one run of bytes
#: (one copy per block instead of one per layer and K/V plane), with tokens before heads inside
#: a layer's block as in vLLM's default (``LBNHC``), which keeps the attention kernels' view of a
#: layer's block unchanged.
PREFERRED_LAYOUT = "BLNHC"

UNRESOLVED = "unresolved"


def warn_if_untested() -> None:
    """Log a warning on a vLLM version outside ``TESTED_VLLM``'s minor versions."""
    import vllm

    version = str(getattr(vllm, "__version__", "?"))
    if ".".join(version.split(".")[:2]) not in {".".join(v.split(".")[:2]) for v in TESTED_VLLM}:
        logger.warning("kvx: vLLM %s is untested; kvx.vllm is tested with %s", version, ", ".join(TESTED_VLLM))


def canonical_layout(name: str) -> str:
    """vLLM's name for a layout, aliases (``NHD``, ``HND``) resolved."""
    try:
        from vllm.config.cache import _layout_from_name
    except ImportError:  # a vLLM without physical layouts: the name is all there is
        return name
    return str(_layout_from_name(name).name)


def resolved_layout(vllm_config: Any, kv_cache_config: Any) -> str:
    """The physical KV cache layout vLLM resolved for this engine, as its canonical name.

    The engine core resolves it before it builds the scheduler (``CacheConfig.kv_cache_layout``)
    and hands it to every worker in ``KVCacheConfig.kv_cache_layout``, so both sides of the
    connector agree. ``"unresolved"`` where neither holds one (KV caches not allocated by vLLM).
    """
    name = getattr(kv_cache_config, "kv_cache_layout", None) or getattr(
        vllm_config.cache_config, "kv_cache_layout", None
    )
    return canonical_layout(name) if name else UNRESOLVED


def preferred_layout(vllm_config: Any) -> str | None:
    """``PREFERRED_LAYOUT``, or ``None`` where stating it cannot help: the CPU attention backend
    supports ``LBHNC`` only; MLA caches have no K/V heads; hybrid and attention-free models
    resolve their layout from their own specs (a block-outermost layout cannot split a block
    into kernel blocks)."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        return None
    m = vllm_config.model_config
    if m is None:
        return None
    for flag in ("use_mla", "is_hybrid", "is_attention_free"):
        try:
            if getattr(m, flag, False):
                return None
        except Exception:  # a config without model info (unit tests): no opinion
            return None
    return PREFERRED_LAYOUT


def max_store_job_blocks(block_size: int, vllm_config: Any) -> int:
    """Most blocks one request can compute in one step, i.e. the largest store job: the
    scheduler gives a request at most ``max_num_batched_tokens`` tokens per step (and never more
    than ``max_model_len``)."""
    tokens = vllm_config.scheduler_config.max_num_batched_tokens
    max_len = getattr(vllm_config.model_config, "max_model_len", None)
    if max_len:
        tokens = min(tokens, max_len)
    return math.ceil(tokens / block_size)


def check_host_blocks(
    host_blocks: int, block_size: int, vllm_config: Any, windows: list[tuple[int | None, int]] | None = None
) -> None:
    """Refuse a host tier of ``host_blocks`` smaller than one store job: it could never hold a whole prefill
    chunk of a request (the rest of such a job goes only to the file tier, or nowhere without
    one).
    ``windows``: for a hybrid model, each KV cache group's (sliding window in tokens or None for
    full attention, extra tokens vLLM retains); one store job then holds every group's blocks,
    a sliding-window group's at most its window's."""
    per_group = max_store_job_blocks(block_size, vllm_config)
    need = 0
    for window, extra in windows or [(None, 0)]:
        if window is None:
            need += per_group
        else:
            need += min(per_group, math.ceil((window + extra) / block_size) + 1)
    if host_blocks < need:
        sc = vllm_config.scheduler_config
        raise ValueError(
            f"kv_connector_extra_config: host_blocks = {host_blocks} is smaller than one store "
            f"job of up to {need} blocks: a request computes up to {per_group} blocks of each KV "
            f"cache group in one step (max_num_batched_tokens "
            f"{sc.max_num_batched_tokens}, max_model_len {vllm_config.model_config.max_model_len}, "
            f"block_size {block_size}), and the host tier must hold a whole job; set host_blocks "
            f"to at least {need}"
        )
