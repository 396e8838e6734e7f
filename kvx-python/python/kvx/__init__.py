"""kvx: move LLM KV-cache blocks between engine memory, host memory and files on a deadline.

``kvx.SchedulerSide`` and ``kvx.WorkerSide`` are kvx-offload's two connector sides (native);
``kvx.vllm.KvxConnector`` is a vLLM KV connector built on them; ``kvx.parse_config`` reads its
settings (vLLM's ``kv_connector_extra_config``, as JSON; keys and defaults: kvx-python/README.md).
"""

from kvx._native import (
    FenceNotHeldError,
    KvxError,
    SchedulerSide,
    WorkerSide,
    block_keys,
    offload_config,
    parse_config,
    step_requests,
)

__all__ = [
    "FenceNotHeldError",
    "KvxError",
    "SchedulerSide",
    "WorkerSide",
    "block_keys",
    "offload_config",
    "parse_config",
    "step_requests",
]
