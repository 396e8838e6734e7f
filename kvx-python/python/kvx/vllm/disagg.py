"""Prefill/decode disaggregation on the scheduler side: a producer (P) exports a finished
prefill's blocks under a lease, a consumer (D) loads them from P, as vLLM drives its NIXL
connector (``kv_transfer_params``: ``do_remote_decode`` on P's request, ``do_remote_prefill``
on D's).

The lifecycle is kvx-connector's (Rust, ``_native.Disaggregation``): P's exports, D's remote
requests from their first lookup (waiting at most the load deadline for P to confirm the
lease) until their load ended, their leases, released exactly once, and the checks of P's
params (another namespace, parallel layout or prompt is that request's error only: it is
computed on D). This module turns vLLM's requests into plain data and logs what was refused.
Nothing here raises out of a vLLM hook.
"""

from __future__ import annotations

import hashlib
import json
import secrets
from typing import Any

from kvx import _native
from kvx.vllm.log import logger

# vLLM's statuses of a request that ended normally (an aborted prefill is not sent).
_SENDABLE = ("FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED")


def namespace_id(namespace: bytes) -> str:
    """The short identity of a key namespace that P names and D checks."""
    return hashlib.sha256(namespace).hexdigest()[:32]


def _params(request: Any) -> str | None:
    """The request's ``kv_transfer_params`` as JSON (None when it has none, or they are not
    JSON: then it asks for nothing)."""
    params = request.kv_transfer_params
    if not isinstance(params, dict) or not params:
        return None
    try:
        return json.dumps(params)
    except (TypeError, ValueError):
        return None


class Disaggregation:
    """P's exports and D's remote loads for one ``SchedulerSide`` (see the module docs)."""

    def __init__(self, native_side: Any, namespace: bytes, producer: bool, consumer: bool):
        self.native = _native.Disaggregation(native_side, namespace_id(namespace), producer, consumer,
                                             secrets.randbits(64))

    # -- D ---------------------------------------------------------------------------------
    def wants(self, request: Any) -> bool:
        """True for a request D should load from P (or already handles)."""
        return self.native.wants(request.request_id, _params(request))

    def match(self, request: Any, number: int, own_keys: bytes, num_computed: int) -> tuple[int | None, bool]:
        """``get_num_new_matched_tokens`` of a remote request: ``(None, False)`` while P has
        not confirmed the lease, the remote full blocks beyond ``num_computed`` once it has,
        ``(0, False)`` when the request computes its prompt here."""
        tokens, why = self.native.lookup(request.request_id, number, _params(request), own_keys, num_computed)
        if why is not None:
            logger.warning("kvx: request %s computes its prompt here: %s", request.request_id, why)
        return (None, False) if tokens is None else (tokens, tokens > 0)

    def alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> bool | None:
        """``update_state_after_alloc`` of a remote request: plan the load. True when a load
        was queued, False when the request's remote part ended without one, None when the
        request is not a remote one waiting for its blocks."""
        if not self.native.wants(request.request_id):
            return None
        ids = list(blocks.get_block_ids()[0])
        queued, why = self.native.allocated(request.request_id, ids, num_external_tokens)
        if why is not None:
            logger.warning("kvx: request %s computes its prompt here: %s", request.request_id, why)
        return queued

    def loaded(self, req_id: str) -> None:
        """The request's remote load was reported (finished_recving): P may free its blocks."""
        self.native.loaded(req_id)

    def is_remote(self, req_id: str) -> bool:
        """True when the request's external tokens come from P."""
        return self.native.is_remote(req_id)

    # -- P ---------------------------------------------------------------------------------
    def export(self, request: Any, number: int, keys: bytes, block_ids: list[int]) -> dict | None:
        """P's ``request_finished`` for a request that asks for a remote decode: export its full
        prompt blocks; the params D needs, or None (nothing exported: the engine frees the
        request as usual)."""
        sendable = getattr(request.status, "name", str(request.status)) in _SENDABLE
        prompt = len(request.prompt_token_ids or ())
        out, why = self.native.export(number, _params(request), sendable, prompt, keys, list(block_ids))
        if why is not None:
            logger.warning("kvx: request %s is not sent to a remote decode: %s", request.request_id, why)
        return None if out is None else json.loads(out)

    # -- both ------------------------------------------------------------------------------
    def finished(self, req_id: str) -> None:
        """The request finished (or was aborted): stop renewing its lease and let P go."""
        self.native.finished(req_id)

    def state_counts(self) -> dict[str, int]:
        """Remote requests tracked and leases kept (zero when idle)."""
        tracked, kept = self.native.state_counts()
        return {"remote_requests": tracked, "kept_leases": kept}
