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
    self._preempted(so)
    for req_id, n in so.num_scheduled_tokens.items():
        request = self.requests.get(req_id)
        if request is None or n <= 0:
            continue
        done = request.num_computed_tokens
        keyed = self.native.extend_keys(req_id, request.block_hashes)
        first = done // self.block_size
        upto = min((done + n) // self.block_size, keyed)
        if upto <= first:
            continue
        ids = self.cache_manager.get_block_ids(req_id)[0]
        self.native.save_blocks(req_id, request.block_hashes, first, list(ids[first:upto]))
    return KvxConnectorMetadata(self.native.build_meta())


class KvxConnectorBefore(KvxConnector):
    """``KvxConnector`` with the pre-fix ``build_connector_meta`` on its scheduler side."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        if self._sched is not None:
            self._sched.build_connector_meta = types.MethodType(  # type: ignore[method-assign]
                build_connector_meta_before, self._sched
            )
