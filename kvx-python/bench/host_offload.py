"""A host-memory stand-in for the worker half of vLLM's ``CPUOffloadingSpec`` (the benchmark's
machines have no GPU): vLLM's own spec, manager and connector unchanged, except that
``get_worker`` returns ``HostOffloadingWorker``, which copies whole blocks between the (CPU) KV
cache tensors and a host tensor per KV tensor with ``index_select``/``index_copy_``, synchronously
inside ``submit_store``/``submit_load``; a job is reported finished at the next ``get_finished``.
vLLM's ``CPUOffloadingWorker`` does the same copies with CUDA streams and pinned memory."""

from __future__ import annotations

import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec


class HostOffloadingWorker(OffloadingWorker):
    """Block copies between KV cache tensors and host tensors, done at submit time."""

    def __init__(self, kv_caches: CanonicalKVCaches, num_chunks: int, blocks_per_chunk: int) -> None:
        assert blocks_per_chunk == 1, "the stand-in copies whole blocks (offloaded block = engine block)"
        self.engine = [t.tensor.view(torch.int8).view(t.tensor.shape[0], -1) for t in kv_caches.tensors]
        self.host = [torch.zeros((num_chunks, e.shape[1]), dtype=torch.int8) for e in self.engine]
        self.done: list[TransferResult] = []

    @staticmethod
    def _ids(spec: LoadStoreSpec) -> torch.Tensor:
        return torch.from_numpy(spec.block_ids.astype("int64"))

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        """Engine blocks -> host chunks."""
        src, dst = self._ids(src_spec), self._ids(dst_spec)
        for e, h in zip(self.engine, self.host, strict=True):
            h.index_copy_(0, dst, e.index_select(0, src))
        self.done.append(TransferResult(job_id, True))
        return True

    def submit_load(
        self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec, expedited: bool = False
    ) -> bool:
        """Host chunks -> engine blocks."""
        src, dst = self._ids(src_spec), self._ids(dst_spec)
        for e, h in zip(self.engine, self.host, strict=True):
            e.index_copy_(0, dst, h.index_select(0, src))
        self.done.append(TransferResult(job_id, True))
        return True

    def get_finished(self) -> list[TransferResult]:
        """Every job submitted since the last call."""
        done, self.done = self.done, []
        return done

    def wait(self, job_ids: set[int]) -> None:
        """Jobs finish at submit: nothing to wait for."""


class HostCPUOffloadingSpec(CPUOffloadingSpec):
    """vLLM's CPU offloading spec with the host-memory worker above."""

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        """The stand-in worker (vLLM's refuses a platform without CUDA)."""
        worker = getattr(self, "_worker", None)
        if worker is None:
            worker = HostOffloadingWorker(kv_caches, self.num_chunks, self.blocks_per_chunk)
            self._worker = worker
        return worker
