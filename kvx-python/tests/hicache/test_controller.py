"""kvx under SGLang's own HiCacheController, as far as it runs on CPU: a real device and host
pool, a gloo process group, the controller's storage threads calling kvx through SGLang's
zero-copy path. A backup writes pages through kvx; a prefetch of the same tokens finds them
(SGLang's own hashes), loads them into fresh host pages byte-exact; on a frozen mount the
prefetch ends by kvx's load deadline with nothing loaded, and the controller goes on."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from kvx.testing import frozen_mount

from pools import DEVICE_TOKENS, PAGE, device_pool, file_tier, fill, mha_host, page_bytes

# SGLang hashes pages with a C++ extension that torch builds on first use with ninja, which
# ci.sh installs into the venv: found on PATH next to the interpreter.
os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"


@contextlib.contextmanager
def controller(tmp_path: Path, kvx: dict) -> Iterator[tuple[Any, Any]]:
    """A HiCacheController over a real CPU device pool and host pool (page_first), with kvx as
    its dynamic storage backend, in a gloo group of one; yields (controller, host pool)."""
    # SGLang's modules are imported here, after pools (which skips the module without sglang).
    from sglang.srt.managers.cache_controller import HiCacheController
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.runtime_context import get_parallel

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        with get_parallel().override(attn_dcp_size=1, attn_dcp_rank=0, tp_rank=0, tp_size=1, pp_rank=0, pp_size=1):
            kv = device_pool()
            allocator = PagedTokenToKVPoolAllocator(DEVICE_TOKENS, PAGE, torch.bfloat16, "cpu", kv, False)
            host = mha_host(kv, "page_first")
            extra = {
                "backend_name": "kvx",
                "module_path": "kvx.sglang",
                "class_name": "KvxStorage",
                "interface_v1": 1,
                "kvx": kvx,
            }
            cc = HiCacheController(
                allocator,
                host,
                PAGE,
                dist.new_group([0], backend="gloo"),
                threading.Event(),
                write_policy="write_through",
                io_backend="direct",
                storage_backend="dynamic",
                prefetch_threshold=PAGE,
                model_name="kvx-test",
                storage_backend_extra_config=extra,
            )
            try:
                yield cc, host
            finally:
                cc.detach_storage_backend()
    finally:
        dist.destroy_process_group()


def backup(cc: Any, host: Any, tokens: list[int]) -> tuple[list[torch.Tensor], list[str]]:
    """Back up ``tokens`` (whole pages) from fresh host pages; their bytes and hashes."""
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    pages = len(tokens) // PAGE
    at = host.alloc(pages * PAGE)
    fill(host)
    data = [page_bytes(host, int(at[i * PAGE]) // PAGE) for i in range(pages)]
    hashes = get_storage_hash_str(tokens, None, page_size=PAGE)
    cc.write_storage(at, tokens, hash_value=hashes)
    op = cc.ack_backup_queue.get(timeout=120)
    assert op.completed_tokens == len(tokens)
    return data, hashes


def prefetch(cc: Any, host: Any, rid: str, tokens: list[int]) -> tuple[int, torch.Tensor | None, float]:
    """Prefetch ``tokens`` as SGLang's tree cache drives it: the hit query, host pages for the
    hit, the transfer; (tokens loaded, their host indices, seconds the transfer took)."""
    cc.prefetch(rid, tokens)
    op = cc.prefetch_hit_queue.get(timeout=120)
    if op.storage_hit_count == 0:
        return 0, None, 0.0
    op.host_indices = cc.alloc_prefetch_host_buffers(op, op.storage_hit_count)
    t0 = time.monotonic()
    cc.prefetch_buffer.put(op)
    loaded = 0
    while True:
        ack = cc.ack_prefetch_queue.get(timeout=120)
        if ack.completed_tokens is not None:
            loaded = ack.completed_tokens
        if ack.completed_req:
            return loaded, op.host_indices, time.monotonic() - t0


def test_backup_then_prefetch_through_kvx_byte_exact(tmp_path: Path) -> None:
    with controller(tmp_path, file_tier(tmp_path / "kvx")) as (cc, host):
        assert type(cc.storage_backend).__name__ == "KvxStorage"
        assert cc.page_get_func.__name__ == "_page_get_zero_copy"
        tokens = list(range(100, 100 + 8 * PAGE))
        data, _ = backup(cc, host, tokens)
        loaded, at, _ = prefetch(cc, host, "r1", tokens)
        assert loaded == len(tokens)
        assert at is not None
        assert all(torch.equal(page_bytes(host, int(at[i * PAGE]) // PAGE), d) for i, d in enumerate(data))
        # A prompt that shares the first 3 pages: the hit query stops at the first miss.
        other = tokens[: 3 * PAGE] + list(range(900, 900 + 2 * PAGE))
        loaded, _, _ = prefetch(cc, host, "r2", other)
        assert loaded == 3 * PAGE


def test_a_prefetch_from_a_frozen_mount_ends_by_kvx_deadline(tmp_path: Path) -> None:
    load_ms = 300
    with frozen_mount(tmp_path, "frozen-mount controller test") as (mount, mnt):
        # A host tier of one block: the pages are read from the (frozen) file tier.
        kvx = file_tier(mnt, host_blocks=1, timeouts={"load_ms": load_ms, "store_ms": 5000})
        with controller(tmp_path, kvx) as (cc, host):
            tokens = list(range(500, 500 + 6 * PAGE))
            backup(cc, host, tokens)
            cc.storage_backend.close()  # what was accepted reaches the mount
            cc.storage_backend.register_mem_pool_host(host)  # a fresh store: file tier only
            mount.freeze()
            loaded, _, took = prefetch(cc, host, "r1", tokens)
            print(f"frozen mount: the prefetch transfer ended after {took:.3f} s (load deadline {load_ms} ms)")
            assert loaded == 0
            assert took <= load_ms / 1000 + 0.051  # one tick plus 50 ms
            mount.thaw()
            loaded, _, _ = prefetch(cc, host, "r2", tokens)
            assert loaded == len(tokens)
