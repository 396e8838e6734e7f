"""SGLang's host pool as kvx sees it: where each page's bytes are, and the identity of what
they hold.

A page is the runs ``get_page_buffer_meta`` names for it (one run per layer and K/V plane in
SGLang's ``layer_first`` layout, one per plane in ``page_first``, one for MLA). kvx describes
them as regions: the runs of page 0, and the distance from each page to the next, checked
against the last page so that every page SGLang can name lies where kvx will copy it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

Region = tuple[int, int, int]


@dataclass(frozen=True)
class PageMemory:
    """The pages of one host pool as kvx copies them."""

    page_tokens: int
    num_pages: int
    regions: list[Region]
    spans: list[tuple[int, int]]
    owners: list[Any]
    page_bytes: int


def _runs(pool: Any, page: int) -> tuple[list[int], list[int]]:
    ptrs, sizes = pool.get_page_buffer_meta(torch.arange(page * pool.page_size, (page + 1) * pool.page_size))
    return [int(p) for p in ptrs], [int(s) for s in sizes]


def _buffers(pool: Any) -> list[torch.Tensor]:
    """The tensors that hold the pool's pages (``kv_buffer``; MLA pools keep one too)."""
    found = [getattr(pool, name, None) for name in ("kv_buffer", "k_buffer", "v_buffer")]
    tensors = [t for t in found if isinstance(t, torch.Tensor)]
    if not tensors:
        raise ValueError(f"{type(pool).__name__}: no kv_buffer tensor to copy pages in and out of")
    if any(t.device.type != "cpu" for t in tensors):
        raise ValueError(f"{type(pool).__name__}: the host pool's buffer is not in host memory")
    return tensors


def page_memory(pool: Any) -> PageMemory:
    """The pages of SGLang's host ``pool`` (``HostKVCache``)."""
    page_tokens = int(pool.page_size)
    num_pages = int(pool.size) // page_tokens
    if num_pages < 1:
        raise ValueError(f"host pool of {pool.size} tokens holds no page of {page_tokens}")
    first, sizes = _runs(pool, 0)
    last, last_sizes = _runs(pool, num_pages - 1)
    if num_pages > 1:
        second, _ = _runs(pool, 1)
        strides = [b - a for a, b in zip(first, second, strict=True)]
    else:
        strides = list(sizes)
    for a, stride, z in zip(first, strides, last, strict=True):
        if z != a + (num_pages - 1) * stride:
            raise ValueError("the host pool's pages are not evenly spaced: kvx cannot describe them")
    if sizes != last_sizes:
        raise ValueError("the host pool's pages differ in size")
    buffers = _buffers(pool)
    return PageMemory(
        page_tokens=page_tokens,
        num_pages=num_pages,
        regions=list(zip(first, strides, sizes, strict=True)),
        spans=[(t.data_ptr(), t.numel() * t.element_size()) for t in buffers],
        owners=list(buffers),
        page_bytes=sum(sizes),
    )


def namespace(config: Any, pool: Any, memory: PageMemory) -> bytes:
    """What a page's key must carry besides SGLang's hash, which names only its tokens: the
    model, the dtype, the page size and layout, the page's bytes and this rank's place."""
    parts = [
        "kvx-sglang/1",
        f"model={config.model_name or ''}",
        f"dtype={pool.dtype}",
        f"page_tokens={memory.page_tokens}",
        f"layout={getattr(pool, 'layout', '')}",
        f"page_bytes={memory.page_bytes}",
        f"mla={bool(config.is_mla_model)}",
        f"tp={config.tp_rank}/{config.tp_size}",
        f"pp={config.pp_rank}/{config.pp_size}",
        f"cp={config.attn_cp_rank}/{config.attn_cp_size}",
        f"dp={getattr(config, 'dp_rank', 0)}",
    ]
    return "|".join(parts).encode()
