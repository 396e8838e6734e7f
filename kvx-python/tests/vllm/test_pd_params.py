"""Whatever a prefill engine (or anything pretending to be one) puts in ``kv_transfer_params``,
the decode side's scheduler hooks answer without raising: the request is computed on D.
Driven on the connector's scheduler side directly (no P process: the parameters never reach
the network), with garbage, truncated, foreign and mismatched sources."""

from __future__ import annotations

import json
import random
from types import SimpleNamespace
from typing import Any

from kvx.vllm.disagg import namespace_id
from kvx.vllm.scheduler_side import SchedulerSide

BLOCK = 16
NAMESPACE = b"kvx-test-namespace"
CONFIG = json.dumps({"host_blocks": 64, "remote": {"load_ms": 50, "export_grace_ms": 50}})


class Blocks:
    """What vLLM's ``KVCacheBlocks`` offers the connector: one block id list per group."""

    def __init__(self, ids: list[int]):
        self.ids = ids

    def get_block_ids(self) -> tuple[list[int], ...]:
        return (self.ids,)


def consumer() -> SchedulerSide:
    return SchedulerSide(CONFIG, BLOCK, BLOCK, [NAMESPACE], roles=(False, True))


def request(i: int, params: Any, blocks: int = 4) -> SimpleNamespace:
    hashes = [f"req{i % 3}-block{b}".encode() for b in range(blocks)]
    return SimpleNamespace(
        request_id=f"r{i}",
        kv_transfer_params=params,
        block_hashes=hashes,
        prompt_token_ids=list(range(blocks * BLOCK + 3)),
        num_tokens=blocks * BLOCK + 3,
        num_computed_tokens=0,
        status=SimpleNamespace(name="WAITING"),
    )


def valid_source(side: SchedulerSide, req: SimpleNamespace) -> dict:
    """A well-formed source for ``req``'s own blocks, at a port nothing listens on."""
    keys = side.keys_of(req)
    return {
        "namespace": namespace_id(NAMESPACE),
        "export": 7,
        "producers": ["127.0.0.1:9"],
        "keys": [keys[i : i + 16].hex() for i in range(0, len(keys), 16)],
        "ttl_ms": 1000,
        "heartbeat_ms": 100,
    }


def mutations(rng: random.Random, good: dict) -> list[Any]:
    text = json.dumps(good)
    out: list[Any] = [
        None, "x", 3, [], {}, {"do_remote_prefill": True}, {"do_remote_prefill": True, "kvx": None},
        {"do_remote_prefill": True, "kvx": "not an object"}, {"do_remote_prefill": True, "kvx": [1, 2]},
        {"do_remote_prefill": True, "kvx": {**good, "namespace": "another model"}},
        {"do_remote_prefill": True, "kvx": {**good, "producers": []}},
        {"do_remote_prefill": True, "kvx": {**good, "producers": ["127.0.0.1:9", "127.0.0.1:10"]}},
        {"do_remote_prefill": True, "kvx": {**good, "keys": [1, 2, 3, 4]}},
        {"do_remote_prefill": True, "kvx": {**good, "keys": ["0" * 32] * 4}},
        {"do_remote_prefill": True, "kvx": {**good, "keys": []}},
        {"do_remote_prefill": True, "kvx": {**good, "keys": ["a"] * 4}},
        {"do_remote_prefill": True, "kvx": {**good, "export": -1}},
        {"do_remote_prefill": True, "kvx": {**good, "export": 2**70}},
        {"do_remote_prefill": True, "kvx": {**good, "heartbeat_ms": good["ttl_ms"]}},
        {"do_remote_prefill": True, "kvx": {**good, "extra": 1}},
    ]
    for _ in range(60):
        cut = text[: rng.randrange(len(text))]
        i = rng.randrange(len(text))
        flipped = text[:i] + chr(rng.randrange(32, 127)) + text[i + 1 :]
        for t in (cut, flipped):
            try:
                kvx = json.loads(t)
            except ValueError:
                kvx = t  # not JSON any more: the string itself
            out.append({"do_remote_prefill": True, "kvx": kvx})
    return out


def test_garbage_params_are_a_per_request_error_and_never_raise() -> None:
    rng = random.Random(25)
    side = consumer()
    probe = request(0, None)
    good = valid_source(side, probe)
    refused = 0
    for i, params in enumerate(mutations(rng, good), start=1):
        req = request(i, params)
        tokens, is_async = side.get_num_new_matched_tokens(req, 0)
        # A source kvx accepts (a byte flip in a place that keeps it valid) waits for the
        # lease at an address nothing answers; every other one is computed here at once.
        assert (tokens, is_async) in ((0, False), (None, False)), (params, tokens)
        if tokens == 0:
            refused += 1
        side.update_state_after_alloc(req, Blocks([]), 0)
        delay, out = side.request_finished(req, [])
        assert (delay, out) == (False, None)
    assert refused >= len(mutations(rng, good)) - 40, refused
    assert side.disagg is not None and side.disagg.state_counts() == {"remote_requests": 0, "kept_leases": 0}


def test_a_source_whose_producer_never_answers_is_given_up_after_the_load_deadline() -> None:
    side = consumer()
    req = request(1, None)
    req.kv_transfer_params = {"do_remote_prefill": True, "kvx": valid_source(side, req)}
    assert side.get_num_new_matched_tokens(req, 0) == (None, False)
    # Nothing listens on port 9: the keeper's heartbeat fails, the lease stays unconfirmed,
    # and after load_ms (50) the request is computed here.
    import time

    end = time.monotonic() + 2.0
    while True:
        got = side.get_num_new_matched_tokens(req, 0)
        if got != (None, False):
            break
        assert time.monotonic() < end, "never gave up"
        time.sleep(0.005)
    assert got == (0, False)
    assert side.disagg is not None and side.disagg.state_counts()["kept_leases"] == 0
    side.request_finished(req, [])
    assert side.state_counts()["remote_requests"] == 0
