"""kvx: move LLM KV-cache blocks between engine memory, host memory and files on a deadline.

``kvx.SchedulerSide`` and ``kvx.WorkerSide`` are kvx-offload's two connector sides (native);
``kvx.vllm.KvxConnector`` is a vLLM KV connector built on them; ``kvx.KvxConfig`` parses its
settings.
"""

from kvx._native import FenceNotHeldError, KvxError, SchedulerSide, WorkerSide, block_keys
from kvx.config import KvxConfig

__all__ = ["FenceNotHeldError", "KvxConfig", "KvxError", "SchedulerSide", "WorkerSide", "block_keys"]
