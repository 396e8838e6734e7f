"""The connector's settings: the keys of vLLM's ``kv_connector_extra_config``.

| key | default | meaning |
|---|---|---|
| ``host_blocks`` | 1024 | host-tier capacity, in KV blocks (kvx-owned host memory) |
| ``file_dirs`` | absent | directories of the file tier (list); no file tier when absent |
| ``file_blocks`` | 16384 | file-tier capacity in blocks (only with ``file_dirs``) |
| ``io_engine`` | ``"uring"`` | file I/O engine: ``"uring"`` (io_uring) or ``"psync"`` (threads) |
| ``load_deadline_ms`` | 10000 | deadline of each load; a request never waits longer for kvx |
| ``store_deadline_ms`` | 30000 | deadline of each store |
| ``eviction`` | ``"lru"`` | eviction order of both tiers: ``"lru"`` or ``"arc"`` |

Unknown keys are an error that names them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Mapping

DEFAULTS: dict[str, Any] = {
    "host_blocks": 1024,
    "file_dirs": None,
    "file_blocks": 16384,
    "io_engine": "uring",
    "load_deadline_ms": 10_000,
    "store_deadline_ms": 30_000,
    "eviction": "lru",
}

_CHOICES = {"io_engine": ("uring", "psync"), "eviction": ("lru", "arc")}


def _positive_int(key: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ValueError(f"kv_connector_extra_config[{key!r}]: expected a positive integer, got {v!r}")
    return v


def _choice(key: str, v: Any) -> str:
    if v not in _CHOICES[key]:
        opts = " or ".join(repr(c) for c in _CHOICES[key])
        raise ValueError(f"kv_connector_extra_config[{key!r}]: expected {opts}, got {v!r}")
    return v


def _dirs(key: str, v: Any) -> list[str]:
    if isinstance(v, (str, bytes)) or not isinstance(v, (list, tuple)) or not v:
        raise ValueError(
            f"kv_connector_extra_config[{key!r}]: expected a non-empty list of directories, got {v!r}"
        )
    out = []
    for d in v:
        if not isinstance(d, str) or not d:
            raise ValueError(f"kv_connector_extra_config[{key!r}]: {d!r} is not a directory path")
        if not os.path.isdir(d):
            raise ValueError(f"kv_connector_extra_config[{key!r}]: {d} does not exist or is not a directory")
        if not os.access(d, os.W_OK | os.X_OK):
            raise ValueError(f"kv_connector_extra_config[{key!r}]: {d} is not writable")
        out.append(d)
    return out


@dataclass(frozen=True)
class KvxConfig:
    """Validated connector settings (see the module docs for keys and defaults)."""

    host_blocks: int = DEFAULTS["host_blocks"]
    file_dirs: list[str] | None = field(default=None)
    file_blocks: int = DEFAULTS["file_blocks"]
    io_engine: str = DEFAULTS["io_engine"]
    load_deadline_ms: int = DEFAULTS["load_deadline_ms"]
    store_deadline_ms: int = DEFAULTS["store_deadline_ms"]
    eviction: str = DEFAULTS["eviction"]

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> "KvxConfig":
        """Parse ``kv_connector_extra_config``; raises ``ValueError`` naming the bad key."""
        extra = dict(extra or {})
        unknown = sorted(set(extra) - set(DEFAULTS))
        if unknown:
            raise ValueError(
                "kv_connector_extra_config: unknown key(s) "
                + ", ".join(repr(k) for k in unknown)
                + " (known: "
                + ", ".join(sorted(DEFAULTS))
                + ")"
            )
        v = {**DEFAULTS, **extra}
        return cls(
            host_blocks=_positive_int("host_blocks", v["host_blocks"]),
            file_dirs=None if v["file_dirs"] is None else _dirs("file_dirs", v["file_dirs"]),
            file_blocks=_positive_int("file_blocks", v["file_blocks"]),
            io_engine=_choice("io_engine", v["io_engine"]),
            load_deadline_ms=_positive_int("load_deadline_ms", v["load_deadline_ms"]),
            store_deadline_ms=_positive_int("store_deadline_ms", v["store_deadline_ms"]),
            eviction=_choice("eviction", v["eviction"]),
        )
