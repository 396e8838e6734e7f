"""Tensor- and pipeline-parallel workers: where a worker sits in vLLM's parallel layout.

Every worker holds a shard of each KV block: tensor-parallel ranks some heads of every layer,
pipeline-parallel ranks some layers. kvx keeps one index of logical blocks in the scheduler
process and lets each worker store and load its own shard:

- the scheduler side counts a job once every worker reported it (kvx-offload merges the ranks'
  results: a block is stored only if every rank stored it, and fails if any rank failed it);
- each worker's file tier lives in its shard's directory under each root
  (``root/shard-tp<t>of<T>-pp<p>of<P>/``), the file named by the logical block's key, so a block
  is complete when every shard directory holds its file (``kvx verify`` and ``kvx gc`` check and
  collect whole blocks);
- each worker has its own host tier, kept identical to the others by the scheduler's evictions;
- ``finished_sending`` / ``finished_recving``: every rank reports each request once, and vLLM's
  ``KVOutputAggregator`` passes it on when all ranks did; invalid blocks are the union.

Block keys also carry the tensor- and pipeline-parallel sizes in their namespace, so an engine of
another layout never reads these blocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Place:
    """A worker's place: tensor- and pipeline-parallel rank and size."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1

    @property
    def world(self) -> int:
        """Workers in the layout."""
        return self.tp_size * self.pp_size

    @property
    def rank(self) -> int:
        """The global rank, as vLLM numbers workers: ``pp_rank * tp_size + tp_rank``."""
        return self.pp_rank * self.tp_size + self.tp_rank

    def shard(self) -> tuple[int, int, int, int] | None:
        """What kvx's native worker side takes as ``shard`` (``None`` for a single worker)."""
        if self.world == 1:
            return None
        return (self.tp_rank, self.tp_size, self.pp_rank, self.pp_size)


def sizes(vllm_config: Any) -> tuple[int, int]:
    """(tensor-parallel size, pipeline-parallel size) of the engine; a layout kvx cannot shard
    (context parallelism splits blocks by token) is a ValueError naming the setting."""
    par = vllm_config.parallel_config
    for key in ("prefill_context_parallel_size", "decode_context_parallel_size"):
        n = int(getattr(par, key, 1) or 1)
        if n != 1:
            raise ValueError(
                f"KvxConnector: parallel_config.{key} = {n}; kvx shards blocks by tensor- and "
                "pipeline-parallel rank only"
            )
    return int(par.tensor_parallel_size), int(par.pipeline_parallel_size)


def worker_place(vllm_config: Any) -> Place:
    """This worker's place, read from vLLM's parallel state (initialised before the worker's
    connector is created, as vLLM's executors do). A single-worker engine needs no parallel
    state."""
    tp, pp = sizes(vllm_config)
    if tp * pp == 1:
        return Place()
    from vllm.distributed import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        raise ValueError(
            f"KvxConnector: tensor_parallel_size {tp} x pipeline_parallel_size {pp}, but vLLM's "
            "parallel state is not initialised in this worker: create the worker connector after "
            "init_worker_distributed_environment"
        )
    place = Place(
        tp_rank=ps.get_tensor_model_parallel_rank(),
        tp_size=tp,
        pp_rank=ps.get_pp_group().rank_in_group,
        pp_size=pp,
    )
    if ps.get_tensor_model_parallel_world_size() != tp or ps.get_pp_group().world_size != pp:
        raise ValueError(
            f"KvxConnector: vLLM's parallel state has tensor size "
            f"{ps.get_tensor_model_parallel_world_size()} and pipeline size "
            f"{ps.get_pp_group().world_size}; the config says {tp} and {pp}"
        )
    return place
