"""What crosses vLLM's process boundary each step, kept compact for pickling."""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)


class KvxConnectorMetadata(KVConnectorMetadata):
    """Scheduler → worker, once per step.

    ``step``: kvx-offload's step instructions in kvx's compact encoding (block keys, engine block
    ids, request numbers); ``loads`` and ``delayed``: vLLM's request id of each request number
    whose load starts, and whose freeing waits for its stores, this step; ``abandoned``: request
    numbers that finished while their load was in flight (vLLM frees their blocks once the load
    is reported in ``finished_recving``); ``in_step``: request numbers whose load this step's
    forward reads (``host_loads_in_step``: never in ``loads``, never in ``finished_recving``).
    """

    __slots__ = ("abandoned", "delayed", "in_step", "loads", "step")

    def __init__(self, step: bytes, loads: dict[int, str], delayed: dict[int, str], abandoned: list[int],
                 in_step: list[int] | None = None):
        self.step = step
        self.loads = loads
        self.delayed = delayed
        self.abandoned = abandoned
        self.in_step = in_step or []

    def __getstate__(self) -> tuple[Any, ...]:
        return (self.step, self.loads, self.delayed, self.abandoned, self.in_step)

    def __setstate__(self, state: tuple[Any, ...]) -> None:
        self.step, self.loads, self.delayed, self.abandoned, self.in_step = state


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
