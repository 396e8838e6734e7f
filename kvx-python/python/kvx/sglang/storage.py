"""``KvxStorage``: SGLang's ``HiCacheStorage`` over kvx's tiers.

SGLang builds it as ``KvxStorage(storage_config, kwargs)`` (its dynamic backend factory), then
hands it the host pool (``register_mem_pool_host``); kvx's page store is built then, over the
pool's own memory (``get_page_buffer_meta``: kvx copies pages in and out of it, no staging
copy in Python). Its settings are the ``kvx`` object of SGLang's
``--hicache-storage-backend-extra-config``: kvx-offload's config keys (kvx-python/README.md).

Every call returns by kvx's deadline (``timeouts.load_ms`` / ``store_ms``) plus a small margin,
with one verdict per page; nothing raises into SGLang's I/O threads: a failure is ``False`` for
the pages it touched (SGLang recomputes them) and one log line.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo

from kvx import _native
from kvx.sglang.pool import PageMemory, namespace, page_memory

logger = logging.getLogger("kvx.sglang")

# kvx's load deadline when the config names none: SGLang waits 1 s (plus 0.25 s per 1k tokens)
# for a prefetch by default, so a load that may take kvx's library default of 10 s would hold
# its I/O thread long after SGLang gave up on the prefetch.
DEFAULT_LOAD_MS = 1000


def _settings(extra: dict[str, Any]) -> dict[str, Any]:
    if int(extra.get("interface_v1", 0)) != 1:
        raise ValueError(
            "hicache-storage-backend-extra-config: interface_v1 must be 1 (kvx copies pages "
            "straight in and out of SGLang's host pool)"
        )
    cfg = extra.get("kvx", {})
    if not isinstance(cfg, dict):
        raise ValueError(f"hicache-storage-backend-extra-config: kvx: expected an object, got {cfg!r}")
    cfg = json.loads(json.dumps(cfg))
    timeouts = cfg.setdefault("timeouts", {})
    if not isinstance(timeouts, dict):
        raise ValueError(f"hicache-storage-backend-extra-config: kvx.timeouts: expected an object, got {timeouts!r}")
    timeouts.setdefault("load_ms", DEFAULT_LOAD_MS)
    return cfg


class _Rates:
    """Pages per call and GB/s, for SGLang's storage metrics, since they were last taken."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._calls: dict[str, tuple[list[int], list[float]]] = {"get": ([], []), "set": ([], [])}

    def note(self, what: str, pages: int, page_bytes: int, seconds: float) -> None:
        with self._lock:
            counts, rates = self._calls[what]
            counts.append(pages)
            rates.append(pages * page_bytes / max(seconds, 1e-9) / 1e9)

    def take(self) -> dict[str, tuple[list[int], list[float]]]:
        with self._lock:
            calls, self._calls = self._calls, {"get": ([], []), "set": ([], [])}
            return calls


class KvxStorage(HiCacheStorage):
    """SGLang's HiCache storage backend on kvx (zero-copy, ``interface_v1``)."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None) -> None:
        self._config = storage_config
        self._settings = _settings(storage_config.extra_config or {})
        self._store: _native.PageStore | None = None
        self._memory: PageMemory | None = None
        self._namespace = b""
        self._rates = _Rates()
        self._warned: set[str] = set()

    # Setup.

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        self.close()  # a pool registered again replaces the store over the previous one
        memory = page_memory(mem_pool_host)
        c = self._config
        shard = (c.tp_rank, c.tp_size, c.pp_rank, c.pp_size)
        self._store = _native.PageStore(
            json.dumps(self._settings),
            memory.page_tokens,
            memory.regions,
            memory.num_pages,
            memory.spans,
            memory.owners,
            shard,
        )
        self._memory = memory
        self._namespace = namespace(c, mem_pool_host, memory)
        logger.info(
            "kvx page store: %d pages of %d tokens (%d bytes each, %d runs) in %s",
            memory.num_pages,
            memory.page_tokens,
            memory.page_bytes,
            len(memory.regions),
            self._settings,
        )

    # What SGLang calls.

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        try:
            return self._native().exists(self._keys(keys))
        except Exception as e:
            self._failed("batch_exists", e)
            return 0

    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        return self._transfer("get", keys, host_indices)

    def batch_set_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        return self._transfer("set", keys, host_indices)

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # The copying legacy interface hands kvx tensors outside the host pool, which kvx was not
    # given: those calls are refused (SGLang uses batch_get_v1 / batch_set_v1 with
    # interface_v1, which the constructor requires).

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        self._refuse("get")
        return None

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None) -> list[Any]:
        self._refuse("batch_get")
        return [None] * len(keys)

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        self._refuse("set")
        return False

    def batch_set(
        self, keys: list[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None
    ) -> bool:
        self._refuse("batch_set")
        return False

    def clear(self) -> None:
        try:
            self._native().clear()
        except Exception as e:
            self._failed("clear", e)

    def get_stats(self) -> Any:
        from sglang.srt.observability.metrics_collector import StorageMetrics

        calls = self._rates.take()
        return StorageMetrics(
            prefetch_pgs=calls["get"][0],
            backup_pgs=calls["set"][0],
            prefetch_bandwidth=calls["get"][1],
            backup_bandwidth=calls["set"][1],
        )

    def kvx_stats(self) -> dict[str, Any]:
        """kvx's own counts since the last call (blocks and bytes by tier, failures by reason,
        load latencies), as the vLLM connector reports them."""
        try:
            return self._native().take_stats()
        except Exception as e:
            self._failed("kvx_stats", e)
            return {}

    def close(self) -> None:
        store, self._store = self._store, None
        if store is not None:
            store.close()

    # Helpers.

    def _native(self) -> _native.PageStore:
        if self._store is None:
            raise _native.KvxError("no host pool registered yet")
        return self._store

    def _keys(self, keys: list[str]) -> bytes:
        return _native.block_keys(self._namespace, [k.encode() for k in keys])

    def _pages(self, n: int, host_indices: torch.Tensor) -> tuple[list[int], list[bool]]:
        """The page of each key, and whether SGLang's indices name one page exactly."""
        assert self._memory is not None
        tokens = self._memory.page_tokens
        flat = host_indices.reshape(-1).tolist()
        if len(flat) != n * tokens:
            raise ValueError(f"{n} keys but {len(flat)} host indices (pages of {tokens} tokens)")
        pages, whole = [], []
        for i in range(n):
            run = flat[i * tokens : (i + 1) * tokens]
            first = int(run[0])
            pages.append(first // tokens)
            whole.append(
                first % tokens == 0
                and first // tokens < self._memory.num_pages
                and run == list(range(first, first + tokens))
            )
        return pages, whole

    def _transfer(self, what: str, keys: list[str], host_indices: torch.Tensor) -> list[bool]:
        if not keys:
            return []
        t0 = time.monotonic()
        try:
            store = self._native()
            pages, whole = self._pages(len(keys), host_indices)
            n = whole.index(False) if False in whole else len(keys)
            if n < len(keys):
                logger.error(
                    "kvx %s: the host indices of key %d do not name one whole page of the pool's %d",
                    what,
                    n,
                    self._memory.num_pages if self._memory else 0,
                )
            call = store.load if what == "get" else store.store
            done = call(self._keys(keys[:n]), pages[:n]) if n else []
        except Exception as e:
            self._failed(f"batch_{what}_v1", e)
            return [False] * len(keys)
        assert self._memory is not None
        ok = done.index(False) if False in done else len(done)
        self._rates.note(what, ok, self._memory.page_bytes, time.monotonic() - t0)
        return list(done) + [False] * (len(keys) - n)

    def _failed(self, call: str, e: Exception) -> None:
        logger.error("kvx %s failed: %s", call, e)

    def _refuse(self, call: str) -> None:
        if call not in self._warned:
            self._warned.add(call)
            logger.error("kvx: %s copies through tensors outside the host pool; kvx serves interface_v1 only", call)
