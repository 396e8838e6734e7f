"""Prefill/decode disaggregation between two real engine processes: P (``kv_producer``, kvx's
remote tier listening on 127.0.0.1) prefills each prompt with one output token; the test plays
the proxy, passing the ``kv_transfer_params`` P returned, unchanged, to D (``kv_consumer``),
which loads P's blocks over TCP and decodes. D's tokens equal a run without a connector, and
vLLM on D counts every full prompt block as a connector hit from P.

D's worker runs on the other core than P's. While its exported requests wait for D's reads, P's
engine steps without pause (vLLM's loop for requests awaiting ``finished_sending``), its worker
spinning on its core; vLLM binds every engine's worker to the first core, and on this kernel
(6.18, EEVDF, one autogroup per engine session) a thread pinned beside that spin can get no
CPU at all: D's worker got 0 ticks in 10 s while P's got 96%, and D never answered. On one
machine, as here, two engines need cores of their own; on two nodes they have them.

P's engine core runs in a process of its own, as in ``vllm serve``: a request's blocks are
exported to D by the engine step after the one that finished it, which an engine core in the
test's process (the suite's default) would not run once ``generate`` returned."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import prompts
from engine import Engine
from ports import free_port

STARTS_IN_A_ROW = 1


def scenario(tmp: Path, model_dir: str) -> dict[str, Any]:
    remote_p = {"listen": f"127.0.0.1:{free_port()}", "lease_ttl_ms": 60_000, "heartbeat_ms": 1000}
    p_cfg = {"role": "kv_producer", "extra": {"host_blocks": 64, "remote": remote_p}}
    d_cfg = {"role": "kv_consumer", "policy": "recompute", "extra": {"host_blocks": 64, "remote": {"load_ms": 5000}}}
    # Both start at once (each start is tens of seconds).
    P = Engine("P", tmp, {"model": model_dir, "kvx": p_cfg}, core_process=True)
    D = Engine("D", tmp, {"model": model_dir, "kvx": d_cfg}, cpu="1")
    out: dict[str, Any] = {}
    try:
        P.ready()
        D.ready()
        ps = prompts.prompts("pd")
        out["prefill"] = P.generate(ps, 1, params=[{"do_remote_decode": True}] * len(ps))
        out["decode"] = D.generate(ps, prompts.max_tokens("pd"), params=out["prefill"]["params"])
    finally:
        D.stop()
        P.stop()
    return out


def test_decode_engine_loads_the_prefill_engines_blocks(run: dict, reference: dict) -> None:
    pre, dec = run["prefill"], run["decode"]
    assert [t[:1] for t in reference["pd"]] == pre["tokens"]
    for p in pre["params"]:
        assert isinstance(p, dict) and p.get("do_remote_prefill") is True and "kvx" in p, p
    assert dec["finish"] == ["length"] * len(dec["finish"]), dec["finish"]
    assert dec["tokens"] == reference["pd"]
    want = prompts.hit_tokens("pd")
    assert dec["counts"]["external_hits"] == want, dec["counts"]
    assert dec["counts"].get("cached_p2p", 0) == want, dec["counts"]
    assert dec["counts"]["local_hits"] == 0, dec["counts"]
