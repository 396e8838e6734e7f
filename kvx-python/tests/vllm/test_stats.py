"""kvx's counters in vLLM's own stats: what the connector hands vLLM each step
(``get_kv_connector_stats`` on the worker and the scheduler, summed by vLLM's scheduler) reaches
vLLM's "KV Transfer metrics" log line (``KVConnectorLogging``) and its Prometheus registry
(``KVConnectorProm``, as ``vllm serve``'s ``/metrics`` has it), after a run of vLLM's real
scheduler."""

from __future__ import annotations

from prometheus_client import REGISTRY
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging, KVConnectorProm
from vllm.v1.metrics.prometheus import unregister_vllm_metrics

from harness import BLOCK, Engine, prompt
from test_connector import corrupt_one_block, file_dir

ENGINE = {"model_name": "m", "engine": "0"}


def observed(e: Engine) -> list[str]:
    """Feed every step's connector stats to vLLM's Prometheus and logging classes; the log
    line(s) vLLM would print."""
    unregister_vllm_metrics()
    prom = KVConnectorProm(e.vllm_config, list(ENGINE), {0: list(ENGINE.values())})
    logging = KVConnectorLogging(e.vllm_config.kv_transfer_config)
    for st in e.scheduler_stats:
        if st.kv_connector_stats:
            prom.observe(st.kv_connector_stats, 0)
            logging.observe(st.kv_connector_stats)
    lines: list[str] = []
    logging.log(log_fn=lambda fmt, *args: lines.append(fmt % args))
    return lines


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, {**ENGINE, **labels}) or 0.0


def test_stores_and_host_tier_hits_reach_vllms_metrics(tmp_path):
    d = file_dir(tmp_path)
    e = Engine(tmp_path, {"host_blocks": 32, "file": {"roots": [str(d)], "blocks": 1024}})
    try:
        p = prompt(7, 4 * BLOCK + 3)
        e.add("a", p)
        e.run()
        e.add("b", p)
        e.run()
        assert e.conn.stats()["host_hit_blocks"] == 4
        block_bytes = e.worker._worker.native.block_bytes()
        lines = observed(e)
        assert sample("vllm:kvx_stored_blocks_total", tier="host") == 4
        assert sample("vllm:kvx_stored_blocks_total", tier="file") == 4
        assert sample("vllm:kvx_stored_bytes_total", tier="file") == 4 * block_bytes
        assert sample("vllm:kvx_loaded_blocks_total", tier="host") == 4
        assert sample("vllm:kvx_loaded_bytes_total", tier="host") == 4 * block_bytes
        assert sample("vllm:kvx_loaded_blocks_total", tier="file") == 0
        assert sample("vllm:kvx_load_seconds_count") == 1
        assert 0 < sample("vllm:kvx_load_seconds_sum") < 5
        assert len(lines) == 1, lines
        assert "loaded_blocks[host]=4" in lines[0] and "stored_blocks[file]=4" in lines[0], lines
        assert "loads=1" in lines[0], lines
        # An idle engine hands vLLM nothing (no stats object each step).
        e.scheduler_stats.clear()
        e.step()
        assert all(st.kv_connector_stats is None for st in e.scheduler_stats)
    finally:
        e.close()
        unregister_vllm_metrics()


def test_a_corrupt_file_is_a_failed_block_by_tier_and_reason(tmp_path):
    d = file_dir(tmp_path)
    p = prompt(8, 5 * BLOCK + 1)
    corrupt_one_block(tmp_path, d, p, index=2)
    e = Engine(tmp_path, {"host_blocks": 32, "file": {"roots": [str(d)], "blocks": 16384}})
    try:
        e.add("r", p)
        e.run()
        observed(e)
        failed = sample("vllm:kvx_load_failed_blocks_total", tier="file", reason="corrupt")
        assert failed == 1
        assert sample("vllm:kvx_loaded_blocks_total", tier="file") + failed == 5
    finally:
        e.close()
        unregister_vllm_metrics()
