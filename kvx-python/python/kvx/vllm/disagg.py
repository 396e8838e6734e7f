"""Prefill/decode disaggregation on the scheduler side: a producer (P) exports a finished
prefill's blocks under a lease, a consumer (D) loads them from P, as vLLM drives its NIXL
connector (``kv_transfer_params``: ``do_remote_decode`` on P's request, ``do_remote_prefill``
on D's).

P: ``request_finished`` of a request that asks for a remote decode delays the free and returns
the params D needs (kvx's own under ``"kvx"``: the namespace, the export id, each P rank's
server, the block keys, the lease); P's worker exports the blocks at its next step and reports
the request in ``finished_sending`` once D said done, the lease expired, or it was aborted (with
a CUDA KV cache: once the blocks were copied into pinned host buffers, which the lease holds).

D: a request carrying those params is offered its remote full blocks as an asynchronous load
once P confirmed the lease (kvx-rdma's lease keeper renews it from the first lookup until the
load ended, however long the request waits); ``update_state_after_alloc`` plans the load,
the worker reads the blocks with the load deadline, and every block that did not arrive is
reported invalid for vLLM's ``kv_load_failure_policy``. Params that do not parse, name another
namespace, another parallel layout or other blocks than D's own prompt are an error for that
request only: it is computed on D. Nothing here raises out of a vLLM hook.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import time
from dataclasses import dataclass
from typing import Any

from kvx import _native
from kvx._native import KEY_BYTES
from kvx.vllm.log import logger
from kvx.vllm.settings import Settings

# vLLM's statuses of a request that ended normally (an aborted prefill is not sent).
_SENDABLE = ("FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED")


def namespace_id(namespace: bytes) -> str:
    """The short identity of a key namespace that P names and D checks."""
    return hashlib.sha256(namespace).hexdigest()[:32]


@dataclass
class _Remote:
    """A consumer's remote request, from its first lookup until its load ended."""

    number: int
    source: str
    keys: bytes
    seen: float
    # "waiting" (lease not confirmed), "offered" (tokens offered), "loading", "done" (load
    # ended or given up: the request goes on as any other).
    state: str = "waiting"
    first: int = 0


class Disaggregation:
    """P's exports and D's remote loads for one ``SchedulerSide`` (see the module docs)."""

    def __init__(self, native: Any, settings: Settings, block_size: int, namespace: bytes,
                 producer: bool, consumer: bool, world: int):
        self.native = native
        self.block_size = block_size
        self.ns = namespace_id(namespace)
        self.producer = producer
        self.world = world
        # A P/D role always has a `remote` section (the connector refuses one without).
        self.load_ms = int(settings.values["remote"]["load_ms"])
        self.keeper: Any = _native.LeaseKeeper(settings.text, block_size) if consumer else None
        self.remote: dict[str, _Remote] = {}
        self.exports = 0
        self.refused = 0

    # -- D ---------------------------------------------------------------------------------
    def wants(self, request: Any) -> bool:
        """True for a request D should load from P (or already handles)."""
        if self.keeper is None:
            return False
        if request.request_id in self.remote:
            return self.remote[request.request_id].state != "done"
        params = request.kv_transfer_params
        return bool(isinstance(params, dict) and params.get("do_remote_prefill"))

    def _start(self, request: Any, number: int, own_keys: bytes) -> _Remote | None:
        """Check P's params against this engine and start keeping the lease; None (and the
        request is computed here) when they do not fit."""
        try:
            kvx = request.kv_transfer_params.get("kvx")
            if not isinstance(kvx, dict):
                raise ValueError(f"no kvx source in kv_transfer_params (keys: {sorted(request.kv_transfer_params)})")
            source = json.dumps(kvx)
            ns, keys, producers = _native.remote_source(source)
            if ns != self.ns:
                raise ValueError(f"the blocks belong to namespace {ns}, this engine's is {self.ns}")
            if producers != self.world:
                raise ValueError(f"{producers} producer ranks, this engine has {self.world} workers")
            n = min(len(keys), len(own_keys)) // KEY_BYTES
            if n == 0 or keys[: n * KEY_BYTES] != own_keys[: n * KEY_BYTES]:
                raise ValueError("the source's blocks are not this request's prompt")
            self.keeper.keep(number, source)
        except Exception as e:  # a peer's bytes: never out of a vLLM hook
            self.refused += 1
            logger.warning("kvx: request %s computes its prompt here: kv_transfer_params: %s",
                           request.request_id, e)
            return None
        return _Remote(number=number, source=source, keys=keys[: n * KEY_BYTES], seen=time.monotonic())

    def match(self, request: Any, number: int, own_keys: bytes, num_computed: int) -> tuple[int | None, bool]:
        """``get_num_new_matched_tokens`` of a remote request: ``(None, False)`` while P has
        not confirmed the lease (at most the load deadline), the remote full blocks beyond
        ``num_computed`` once it has, ``(0, False)`` when the request computes its prompt here."""
        rid = request.request_id
        r = self.remote.get(rid)
        if r is None:
            r = self._start(request, number, own_keys)
            if r is None:
                self.remote[rid] = _Remote(number=number, source="", keys=b"", seen=0.0, state="done")
                return 0, False
            self.remote[rid] = r
        if r.state in ("done", "loading"):
            return 0, False
        status = self.keeper.status(r.number) or "lost: not kept"
        if status == "pending":
            if (time.monotonic() - r.seen) * 1000 < self.load_ms:
                return None, False
            status = f"lost: no answer from the producer within {self.load_ms} ms"
        if status.startswith("lost"):
            logger.warning("kvx: request %s computes its prompt here: the producer's lease: %s", rid, status)
            self._end(rid, done=False)
            return 0, False
        tokens = len(r.keys) // KEY_BYTES * self.block_size - num_computed
        if tokens <= 0:
            # A full local hit: nothing to read, P may free the blocks now.
            self._end(rid, done=True)
            return 0, False
        r.state, r.first = "offered", num_computed // self.block_size
        return tokens, True

    def alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> bool | None:
        """``update_state_after_alloc`` of a remote request: plan the load. True when a load
        was queued, False when the request's remote part ended without one, None when the
        request is not a remote one waiting for its blocks."""
        r = self.remote.get(request.request_id)
        if r is None or r.state != "offered":
            return None
        if num_external_tokens == 0:
            self._end(request.request_id, done=True)
            return False
        n = num_external_tokens // self.block_size
        ids = blocks.get_block_ids()[0][r.first : r.first + n]
        try:
            self.native.remote_load(r.number, r.source, r.first, list(ids))
        except Exception as e:
            logger.warning("kvx: request %s computes its prompt here: %s", request.request_id, e)
            self._end(request.request_id, done=False)
            return False
        r.state = "loading"
        return True

    def loaded(self, req_id: str) -> None:
        """The request's remote load was reported (finished_recving): P may free its blocks."""
        r = self.remote.get(req_id)
        if r is not None and r.state == "loading":
            self._end(req_id, done=True)

    def _end(self, req_id: str, done: bool) -> None:
        r = self.remote.get(req_id)
        if r is None:
            return
        if r.state != "done" and self.keeper is not None:
            self.keeper.release(r.number, done)
        r.state = "done"

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

    # -- both ------------------------------------------------------------------------------
    def finished(self, req_id: str) -> None:
        """D's request finished (or was aborted): stop renewing its lease and let P go."""
        self._end(req_id, done=True)
        self.remote.pop(req_id, None)

    def state_counts(self) -> dict[str, int]:
        """Remote requests tracked and leases kept (zero when idle)."""
        return {
            "remote_requests": len(self.remote),
            "kept_leases": len(self.keeper) if self.keeper is not None else 0,
        }
