"""What crosses vLLM's process boundary each step, kept compact for pickling."""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)


class KvxConnectorMetadata(KVConnectorMetadata):
    """Scheduler → worker, once per step: ``step``, the scheduler side's message in kvx's
    compact encoding (kvx-offload's instructions, and the requests they name by number and by
    vLLM's id; ``kvx._native.step_requests`` reads the numbers)."""

    __slots__ = ("step",)

    def __init__(self, step: bytes):
        self.step = step

    def __getstate__(self) -> tuple[bytes]:
        return (self.step,)

    def __setstate__(self, state: tuple[bytes]) -> None:
        (self.step,) = state


class KvxWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker → scheduler, once per step: encoded job outcomes for the scheduler side."""

    __slots__ = ("jobs",)

    def __init__(self, jobs: list[bytes]):
        self.jobs = jobs

    def __getstate__(self) -> tuple[Any, ...]:
        return (self.jobs,)

    def __setstate__(self, state: tuple[Any, ...]) -> None:
        (self.jobs,) = state

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        """Both workers' outcomes, in order."""
        assert isinstance(other, KvxWorkerMetadata)
        return KvxWorkerMetadata(self.jobs + other.jobs)
