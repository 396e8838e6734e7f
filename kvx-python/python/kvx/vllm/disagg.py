"""Prefill/decode disaggregation on the scheduler side: a producer (P) exports a finished
prefill's blocks under a lease, a consumer (D) loads them from P, as vLLM drives its NIXL
connector (``kv_transfer_params``: ``do_remote_decode`` on P's request, ``do_remote_prefill``
on D's).

P: ``request_finished`` of a request that asks for a remote decode delays the free and returns
the params D needs (kvx's own under ``"kvx"``: the namespace, the export id, each P rank's
server, the block keys, the lease); P's worker exports the blocks at its next step and reports
the request in ``finished_sending`` once D said done, the lease expired, or it was aborted (with
a CUDA KV cache: once the blocks were copied into pinned host buffers, which the lease holds).

D: kvx-connector's ``disagg::Consumer`` (through the native scheduler side) checks the params
against this engine (namespace, parallel layout, the request's own prompt), keeps the lease
from the first lookup until the load ended, offers the remote blocks once P confirmed the lease
(at most the remote load deadline later), plans the load at ``update_state_after_alloc`` and
lets P go once it was reported; every block that did not arrive is reported invalid for vLLM's
``kv_load_failure_policy``. Params that do not fit are an error for that request only: it is
computed on D, with a warning. Here: vLLM's requests turned into plain data. Nothing here raises
out of a vLLM hook.
"""

from __future__ import annotations

import hashlib
import json
import secrets
from typing import Any

from kvx._native import KEY_BYTES
from kvx.vllm.log import logger

# vLLM's statuses of a request that ended normally (an aborted prefill is not sent).
_SENDABLE = ("FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED")


def namespace_id(namespace: bytes) -> str:
    """The short identity of a key namespace that P names and D checks."""
    return hashlib.sha256(namespace).hexdigest()[:32]


def _source(request: Any) -> str | None:
    """The producer's source a request came with (JSON, whatever it holds), ``None`` when the
    request asks for no remote prefill."""
    params = request.kv_transfer_params
    if not (isinstance(params, dict) and params.get("do_remote_prefill")):
        return None
    return json.dumps(params.get("kvx"), default=str)


class Disaggregation:
    """P's exports and D's remote loads for one ``SchedulerSide`` (see the module docs)."""

    def __init__(self, native: Any, block_size: int, namespace: bytes, producer: bool, consumer: bool):
        self.native = native
        self.block_size = block_size
        self.ns = namespace_id(namespace)
        self.producer = producer
        self.consumer = consumer
        self.exports = 0

    # -- D ---------------------------------------------------------------------------------
    def match(self, request: Any, num_computed: int) -> tuple[int | None, bool] | None:
        """``get_num_new_matched_tokens`` of a remote request: ``(None, False)`` while P has not
        confirmed the lease, the remote blocks beyond ``num_computed`` once it has, ``(0,
        False)`` when the request computes its prompt here; ``None`` for a request that is not
        (or no longer) a remote one."""
        if not self.consumer:
            return None
        got = self.native.remote_lookup(request.request_id, request.block_hashes, _source(request), num_computed)
        if got is None:
            return None
        tokens, is_async, why = got
        if why:
            logger.warning("kvx: request %s computes its prompt here: %s", request.request_id, why)
        return tokens, is_async

    def alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> bool | None:
        """``update_state_after_alloc`` of a remote request: True when its load was queued,
        False when its remote part ended without one, None when it is not a remote request
        offered blocks."""
        if not self.is_remote(request.request_id):
            return None
        got = self.native.remote_alloc(request.request_id, list(blocks.get_block_ids()[0]), num_external_tokens)
        if got is None:
            return None
        queued, why = got
        if why:
            logger.warning("kvx: request %s computes its prompt here: %s", request.request_id, why)
        return queued

    def is_remote(self, req_id: str) -> bool:
        """True once the request came to D as a remote one (until it finished)."""
        return self.consumer and self.native.remote_known(req_id)

    def loaded(self, recving: list[str]) -> None:
        """These requests' loads were reported (finished_recving): P may free their blocks."""
        if self.consumer:
            self.native.remote_loaded(recving)

    def finished(self, req_id: str) -> None:
        """D's request finished (or was aborted): stop renewing its lease and let P go."""
        if self.consumer:
            self.native.remote_finished(req_id)

    # -- P ---------------------------------------------------------------------------------
    def export(self, request: Any, number: int, keys: bytes, block_ids: list[int]) -> dict | None:
        """P's ``request_finished`` for a request that asks for a remote decode: export its full
        prompt blocks; the params D needs, or None (nothing exported: the engine frees the
        request as usual)."""
        params = request.kv_transfer_params
        if not (self.producer and isinstance(params, dict) and params.get("do_remote_decode")):
            return None
        if getattr(request.status, "name", str(request.status)) not in _SENDABLE:
            return None
        n = min(len(keys) // KEY_BYTES, len(block_ids), len(request.prompt_token_ids or ()) // self.block_size)
        if n == 0:
            return None
        export = secrets.randbits(63)
        try:
            source = self.native.export_finished(number, export, self.ns, keys[: n * KEY_BYTES], list(block_ids[:n]))
        except Exception as e:
            logger.warning("kvx: request %s is not sent to a remote decode: %s", request.request_id, e)
            return None
        self.exports += 1
        return {"do_remote_prefill": True, "do_remote_decode": False, "kvx": json.loads(source)}

    def state_counts(self) -> dict[str, int]:
        """Remote requests tracked and leases kept (zero when idle)."""
        remote, kept, _ = self.native.remote_counts()
        return {"remote_requests": remote, "kept_leases": kept}
