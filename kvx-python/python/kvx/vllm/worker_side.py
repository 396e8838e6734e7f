"""The connector's worker side: vLLM's KV tensors and per-step calls, kvx's native ``WorkerSide``."""

from __future__ import annotations

import time
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

from kvx import _native
from kvx._native import KvxError
from kvx.vllm.log import logger
from kvx.vllm.meta import KvxConnectorMetadata, KvxWorkerMetadata
from kvx.vllm.settings import Settings


def describe_tensors(kv_caches: dict) -> list[tuple]:
    """(name, data pointer, shape, strides in elements, element size, device) of each tensor."""
    return [
        (name, t.data_ptr(), list(t.shape), list(t.stride()), t.element_size(), str(t.device))
        for name, t in kv_caches.items()
    ]


class WorkerSide:
    """Maps vLLM's worker calls onto kvx's native ``WorkerSide``, which keeps vLLM's id of each
    request a step names until kvx reported it, and starts each step once."""

    def __init__(self, settings: Settings, block_size: int, num_blocks: int,
                 shard: tuple[int, int, int, int] | None = None):
        self.config = settings.text
        self.block_size = block_size
        self.num_blocks = num_blocks
        # (tp rank, tp size, pp rank, pp size) with several workers: see kvx.vllm.parallel.
        self.shard = shard
        self.native: _native.WorkerSide | None = None
        # The registered tensors and their description; None between unregister and restore.
        self._kv_caches: dict = {}
        self._described: list[tuple] = []
        self.registered = False
        # The KV cache's CUDA device (None for a CPU cache), and the step last started.
        self._cuda: Any = None
        self._started: KvxConnectorMetadata | None = None
        timeouts = settings.values["timeouts"]
        self._fence_ms = int(max(timeouts["load_ms"], timeouts["store_ms"])) + 1000

    def register(self, kv_caches: dict) -> None:
        """Describe the KV tensors and start kvx over them (a bad layout raises ValueError)."""
        described = describe_tensors(kv_caches)
        self.native = _native.WorkerSide(
            self.config, self.block_size, described, list(kv_caches.values()), self.num_blocks,
            shard=self.shard,
        )
        self._kv_caches, self._described, self.registered = dict(kv_caches), described, True
        first = next(iter(kv_caches.values()), None)
        self._cuda = first.device if first is not None and first.is_cuda else None

    def unregister(self) -> None:
        """Before sleep: end every kvx copy into or out of the KV cache (queued stores are
        copied now, while the memory still holds their blocks; loads end by their deadline),
        then accept no step until ``restore``. kvx keeps no copy running and starts none on
        the KV cache's addresses meanwhile; the host and file tiers keep their blocks.
        Idempotent."""
        if self.native is None or not self.registered:
            return
        self._order_after_engine()
        if not self.native.fence_engine(self._fence_ms):
            logger.error("kvx: copies into the KV cache did not end within %d ms before sleep", self._fence_ms)
        self.registered = False

    def restore(self) -> None:
        """After wake: take the KV cache's addresses again from the tensors registered before
        and go on where kvx was (its host and file tiers kept their blocks). vLLM's sleep mode
        maps the cache back at the same virtual addresses; a cache that came back elsewhere is
        an error naming the tensor (the scheduler process's index of the host tier would no
        longer match a worker side built again). Idempotent."""
        if self.registered or self.native is None:
            return
        described = describe_tensors(self._kv_caches)
        for old, new in zip(self._described, described, strict=True):
            if old != new:
                raise KvxError(
                    f"KvxConnector: KV cache tensor {new[0]!r} moved during sleep (address {old[1]:#x}, "
                    f"shape {old[2]}, strides {old[3]} before; {new[1]:#x}, {new[2]}, {new[3]} after): "
                    "kvx follows a cache restored at the same addresses only"
                )
        self.registered = True

    def _order_after_engine(self) -> None:
        """Before a step's first call that may submit a copy: every kvx copy of a CUDA KV cache
        from now on comes, on the GPU, after the work queued so far on torch's current stream
        (the previous step's forward, also when vLLM's asynchronous scheduling runs the CPU a
        step ahead). Nothing waits on the CPU; a driver that refuses is logged and the stream
        synchronized instead."""
        if self._cuda is None or self.native is None:
            return
        import torch

        stream = torch.cuda.current_stream(self._cuda)
        try:
            self.native.order_after_engine_stream(stream.cuda_stream)
        except KvxError as e:
            logger.error("kvx: copies not ordered after the engine's stream (%s): synchronizing it", e)
            stream.synchronize()

    def start(self, meta: KvxConnectorMetadata) -> None:
        """Start this step (from whichever of vLLM's per-step calls comes first; kvx starts it
        once). A fence that does not hold (a copy stuck past its deadline) raises
        FenceNotHeldError out of the step: the forward would overwrite blocks a copy may still
        read or write, so the engine must not run it."""
        if self.native is None:
            raise KvxError("KvxConnector: register_kv_caches was not called before the first step")
        if not self.registered:
            raise KvxError("KvxConnector: a step between unregister_kv_caches and restore_kv_caches (sleep)")
        if self._started is meta:
            return  # vLLM hands each step over up to three times: decoded and started once
        self._started = meta
        self._order_after_engine()
        left = self.native.start_step(meta.step)
        if left:
            logger.error("kvx: loads of requests %s did not end before the forward (their deadline and a second)",
                         left)

    def get_finished(self) -> tuple[set[str] | None, set[str] | None]:
        """(finished_sending, finished_recving) as vLLM request ids; never blocks."""
        if self.native is None:
            return None, None
        sending, recving, _ = self.native.get_finished()
        return set(sending) or None, set(recving) or None

    def transfer_results(self) -> KVConnectorTransferResults:
        """finished_sending, finished_recving, and the requests whose load failed in a block
        (how a failed load is told with several KV cache groups: vLLM refuses block ids)."""
        if self.native is None:
            return KVConnectorTransferResults()
        sending, recving, failed = self.native.get_finished()
        self.native.take_invalid()
        return KVConnectorTransferResults(
            finished_sending=set(sending), finished_recving=set(recving), failed_recving=set(failed)
        )

    def take_invalid(self) -> set[int]:
        """Engine blocks whose load failed since the last call."""
        return set(self.native.take_invalid()) if self.native is not None else set()

    def take_worker_meta(self) -> KvxWorkerMetadata | None:
        """Job outcomes for the scheduler side, if any."""
        jobs = self.native.take_jobs() if self.native is not None else b""
        return KvxWorkerMetadata([jobs]) if jobs else None

    def state_counts(self) -> dict[str, int]:
        """Everything this side still tracks (all zero when idle)."""
        h = self.native
        names, loading, sending, abandoned = h.request_counts() if h else (0, 0, 0, 0)
        return {
            "names": names,
            "loading": loading,
            "sending": sending,
            "abandoned": abandoned,
            "kvx_in_flight": h.in_flight() if h else 0,
            "kvx_tracker_busy": 0 if (h is None or h.tracker_idle()) else 1,
        }

    def close(self) -> None:
        """vLLM's worker shutdown: stop kvx's driver and backends, without waiting for I/O (a
        copy still out ends with the process). Logged, so that an operator sees it ran."""
        native, self.native = self.native, None
        if native is None:
            return
        try:
            out = native.in_flight()
        except KvxError:
            out = 0
        began = time.monotonic()
        native.close()
        logger.info(
            "kvx: worker shutdown: driver and backends stopped in %.1f ms (%d copies were out)",
            (time.monotonic() - began) * 1000, out,
        )
