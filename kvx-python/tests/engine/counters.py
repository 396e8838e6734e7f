"""vLLM's own Prometheus counters of an engine (``LLM.get_metrics()``), under the short names
the suite and bench/ttft.py report: prefix-cache and connector queries and hits, preemptions,
and cached prompt tokens by source (``cached_<source>``)."""

from __future__ import annotations

from typing import Any

COUNTERS = {
    "vllm:prefix_cache_queries": "local_queries",
    "vllm:prefix_cache_hits": "local_hits",
    "vllm:external_prefix_cache_queries": "external_queries",
    "vllm:external_prefix_cache_hits": "external_hits",
    "vllm:num_preemptions": "preemptions",
}
BY_SOURCE = "vllm:prompt_tokens_cached_by_source"


def read_counts(llm: Any) -> dict[str, float]:
    """The counters now, summed over their labels (``cached_<source>`` kept apart)."""
    out: dict[str, float] = {}
    for m in llm.get_metrics():
        if m.name in COUNTERS:
            out[COUNTERS[m.name]] = out.get(COUNTERS[m.name], 0) + m.value
        elif m.name == BY_SOURCE:
            key = "cached_" + m.labels.get("source", "?")
            out[key] = out.get(key, 0) + m.value
    return out
