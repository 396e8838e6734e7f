"""kvx's counters in vLLM's stats: ``KvxStats`` (what ``get_kv_connector_stats`` hands vLLM,
summed over the workers and the scheduler, logged in vLLM's "KV Transfer metrics" line) and
``KvxPromMetrics`` (the same under vLLM's ``/metrics``, as ``vllm:kvx_*``).

The data is the dict kvx's native sides build (``take_stats``): a count by tier as
``{tier: n}``, one by tier and reason as ``{tier: {reason: n}}``, ``load_seconds`` a list of
load latencies, ``file_breakers_open`` the file tier's roots whose breaker is not closed (on
the worker with the most: a state, not a count, so it is not summed).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

# name: (what it counts, its labels beyond vLLM's own). Reasons are kvx's failure reasons
# (`timed_out`: a missed deadline; `breaker_open`, `not_found`, `corrupt`, `no_room`...).
COUNTERS: dict[str, tuple[str, tuple[str, ...]]] = {
    "loaded_blocks": ("Blocks kvx loaded into engine memory, by source tier", ("tier",)),
    "loaded_bytes": ("Bytes kvx loaded into engine memory, by source tier", ("tier",)),
    "load_failed_blocks": ("Blocks a kvx load did not bring, by tier and reason", ("tier", "reason")),
    "stored_blocks": ("Blocks kvx stored, by tier", ("tier",)),
    "stored_bytes": ("Bytes kvx stored, by tier", ("tier",)),
    "store_failed_blocks": ("Blocks a tier's store did not take, by tier and reason", ("tier", "reason")),
    "store_skipped_blocks": ("Blocks kvx stored in no tier, by reason", ("reason",)),
}
BREAKERS = "file_breakers_open"
LOAD_SECONDS = "load_seconds"
LOAD_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


def _merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """``a`` and ``b`` summed: counts added, nested counts merged, lists joined; the breaker
    state is the larger one."""
    out = dict(a)
    for k, v in b.items():
        if k not in out:
            out[k] = v
        elif k == BREAKERS:
            out[k] = max(out[k], v)
        elif isinstance(v, dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = out[k] + v
    return out


def _flat(data: dict[str, Any], prefix: str = "") -> dict[str, int | float]:
    """Counts under ``name[label,...]`` names, for the log line."""
    out: dict[str, int | float] = {}
    for k, v in data.items():
        name = f"{prefix},{k}" if prefix else k
        if isinstance(v, dict):
            out |= _flat(v, name)
        elif not isinstance(v, list):
            out[name] = v
    return out


@dataclass
class KvxStats(KVConnectorStats):
    """One interval of kvx's counters (see the module's docstring)."""

    data: dict[str, Any] = field(default_factory=dict)

    def reset(self) -> None:
        self.data.clear()

    def aggregate(self, other: KVConnectorStats) -> KvxStats:
        self.data = _merge(self.data, other.data)
        return self

    def reduce(self) -> dict[str, int | float]:
        out = {}
        for name, v in _flat({k: v for k, v in self.data.items() if k != LOAD_SECONDS}).items():
            head, _, labels = name.partition(",")
            out[f"{head}[{labels}]" if labels else head] = v
        loads = sorted(self.data.get(LOAD_SECONDS, ()))
        if loads:
            out["loads"] = len(loads)
            out["load_ms_mean"] = round(1000 * sum(loads) / len(loads), 3)
            out["load_ms_max"] = round(1000 * loads[-1], 3)
        return out

    def is_empty(self) -> bool:
        return not self.data


class KvxPromMetrics(KVConnectorPromMetrics):
    """kvx's counters as ``vllm:kvx_<name>`` metrics, per engine like vLLM's own."""

    def __init__(self, vllm_config: Any, metric_types: dict[type, type], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {
            name: self._counter_cls(name=f"vllm:kvx_{name}", documentation=doc,
                                    labelnames=[*labelnames, *labels])
            for name, (doc, labels) in COUNTERS.items()
        }
        self._breakers = self._gauge_cls(
            name=f"vllm:kvx_{BREAKERS}", documentation="File-tier roots whose breaker is not closed",
            labelnames=labelnames, multiprocess_mode="mostrecent",
        )
        self._loads = self._histogram_cls(
            name=f"vllm:kvx_{LOAD_SECONDS}", documentation="Time of each kvx load, start to verdict",
            labelnames=labelnames, buckets=LOAD_BUCKETS,
        )

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        engine = self.per_engine_labelvalues[engine_idx]
        for name, counter in self._counters.items():
            for labels, n in _flat(transfer_stats_data.get(name, {})).items():
                counter.labels(*engine, *labels.split(",")).inc(n)
        if BREAKERS in transfer_stats_data:
            self._breakers.labels(*engine).set(transfer_stats_data[BREAKERS])
        loads = self._loads.labels(*engine)
        for s in transfer_stats_data.get(LOAD_SECONDS, ()):
            loads.observe(s)


__all__ = ["KvxPromMetrics", "KvxStats"]
