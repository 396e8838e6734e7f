"""``KvxConnector`` with its scheduler side's ``build_connector_meta`` as it was before the
per-step cost fix (kept here only so that the benchmark shows before and after in one run:
``--connectors kvx-before,kvx``). Before: every scheduled request's keys were brought up to date
every step, and a store job took the request's whole block table (``get_block_ids``, O(context))
to slice its blocks from."""

from __future__ import annotations

import types
from typing import Any

from kvx.vllm import KvxConnector
from kvx.vllm.meta import KvxConnectorMetadata
from kvx.vllm.scheduler_side import SchedulerSide


def build_connector_meta_before(self: SchedulerSide, so: Any) -> KvxConnectorMetadata:
    """The pre-fix body (the preemption loop and metadata are unchanged by the fix)."""
    for req_id in so.preempted_req_ids or ():
        r = self.reqs.get(req_id)
        if r is not None:
            self.native.request_preempted(r.number)
            self.stats.preemptions += 1
    for req_id, n in so.num_scheduled_tokens.items():
        r = self.reqs.get(req_id)
        if r is None or n <= 0:
            continue
        done = r.request.num_computed_tokens
        keys = self._keys(r)
        first = done // self.block_size
        upto = min((done + n) // self.block_size, len(keys) // 16)
        if upto <= first:
            continue
        ids = self.cache_manager.get_block_ids(req_id)[0]
        if self.native.save_blocks(r.number, keys[first * 16 : upto * 16], ids[first:upto]):
            self.stats.store_jobs += 1
    abandoned, self._abandoned = self._abandoned, []
    step, loads, delayed = self.native.build_meta(abandoned)
    return KvxConnectorMetadata(
        step, {n: self.names[n] for n in loads}, {n: self.names[n] for n in delayed}, abandoned
    )


class KvxConnectorBefore(KvxConnector):
    """``KvxConnector`` with the pre-fix ``build_connector_meta`` on its scheduler side."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        if self._sched is not None:
            self._sched.build_connector_meta = types.MethodType(  # type: ignore[method-assign]
                build_connector_meta_before, self._sched
            )
