"""Prefill/decode disaggregation through KvxConnector (issue 25, scenarios a-h): a producer engine
P and a consumer engine D, each vLLM's real v1 scheduler with its worker-side connector and the
harness's fake model, in two processes (pd_engine.py) talking over real TCP. The proxy's part is
played by the test: it sends the prompt to P with ``{"do_remote_decode": True}`` and one output
token, and passes the kv_transfer_params P returns, unchanged, to D.

Every block D did not compute itself is checked byte for byte when the request first runs on D
(``verified``); every time is a monotonic time an engine process reported; every bound is a
configured deadline or TTL plus one tick (1 ms) plus at most 50 ms; every test ends with both
engines idle (schedulers empty, every block free, no kvx state left).
"""

from __future__ import annotations

import copy
import json
import time

import pd_netns
import pytest
from pd_proc import EngineProc, free_port

from harness import BLOCK, prompt

TICK = 0.001
SLACK = 0.050
MARGIN = TICK + SLACK
DONE = "FINISHED_LENGTH_CAPPED"
HOST_BLOCKS = 32


@pytest.fixture
def spawn(tmp_path):
    """Start engine processes; every one is ended at teardown, whatever happened."""
    made: list[EngineProc] = []

    def start(name: str, cfg: dict, prefix=()) -> EngineProc:
        p = EngineProc(name, tmp_path, cfg, prefix)
        made.append(p)
        return p

    yield start
    for p in made:
        p.close()


@pytest.fixture
def netns():
    """P's and D's network namespaces (requested before ``spawn``: removed after the engines
    ended); skipped where namespaces cannot be made."""
    why = pd_netns.unavailable()
    if why is not None:
        pytest.skip(f"network namespaces unavailable: {why}")
    ns = pd_netns.Pair()
    yield ns
    ns.close()


def pair(spawn, *, ttl_ms=30_000, heartbeat_ms=50, load_ms=500, policy="recompute", p_blocks=128,
         d_blocks=128, listen=None, p_prefix=(), d_prefix=()):
    """P (kv_producer, listening) and D (kv_consumer), started together."""
    listen = listen or f"127.0.0.1:{free_port()}"
    remote_p = {"listen": listen, "lease_ttl_ms": ttl_ms, "heartbeat_ms": heartbeat_ms}
    P = spawn("P", {"kv_role": "kv_producer", "num_blocks": p_blocks, "prefix_caching": True,
                    "extra": {"host_blocks": HOST_BLOCKS, "remote": remote_p}}, p_prefix)
    D = spawn("D", {"kv_role": "kv_consumer", "num_blocks": d_blocks, "prefix_caching": True,
                    "policy": policy, "extra": {"host_blocks": HOST_BLOCKS, "remote": {"load_ms": load_ms}}},
              d_prefix)
    return P.ready(), D.ready()


def prefill(P: EngineProc, rid: str, toks: list[int]) -> dict:
    """The proxy's first leg: prefill on P; its finished event, with the params for D."""
    P.add(rid, toks, max_tokens=1, params={"do_remote_decode": True})
    ev = P.wait("finished", rid)
    assert ev["status"] == DONE, ev
    params = ev["params"]
    assert isinstance(params, dict) and params.get("do_remote_prefill") is True and "kvx" in params, params
    return ev


def full(toks: list[int]) -> int:
    """Full blocks of a prompt: what P computed and D can load."""
    return len(toks) // BLOCK


def settle(*engines: EngineProc, timeout: float = 10.0) -> None:
    """Both schedulers empty, every block free, no kvx state left."""
    for e in engines:
        st = e.wait_idle(timeout)
        assert st["state"]["vllm_used_blocks"] == 0 and st["state"]["vllm_requests"] == 0, st


def test_engine_process_runs_requests_and_goes_idle(spawn):
    """The process driver on its own (no remote tier): requests finish, verified, idle."""
    e = spawn("E", {"extra": {"host_blocks": HOST_BLOCKS}, "prefix_caching": False}).ready()
    toks = prompt(1, 4 * BLOCK + 6)
    e.add("a", toks)
    assert e.wait("finished", "a")["status"] == DONE
    e.add("b", toks)  # a host-tier hit: 4 blocks loaded by kvx and checked
    ev = e.wait("finished", "b")
    assert (ev["status"], ev["verified"]) == (DONE, 4), ev
    assert e.find("recving", "b")[0]["invalid"] == []
    settle(e)
    assert e.close() == 0


def test_a_transfer_16_requests_byte_exact_and_p_frees_when_d_is_done(spawn):
    P, D = pair(spawn, ttl_ms=30_000, p_blocks=192, d_blocks=192)
    shared = [prompt(11, 3 * BLOCK), prompt(12, 2 * BLOCK)]
    reqs = {}
    for i in range(16):
        if i < 6:
            toks = shared[0] + prompt(100 + i, (1 + i % 3) * BLOCK + 5)
        elif i < 10:
            toks = shared[1] + prompt(100 + i, (2 + i % 2) * BLOCK + 9)
        else:
            toks = prompt(100 + i, (2 + i % 5) * BLOCK + i % 7 + 1)
        reqs[f"r{i}"] = toks
    params = {rid: prefill(P, rid, toks)["params"] for rid, toks in reqs.items()}
    for rid, toks in reqs.items():
        D.add(rid, toks, max_tokens=3, params=params[rid])
    for rid, toks in reqs.items():
        ev = D.wait("finished", rid)
        # Every full block came from P (or from D's prefix cache of an earlier one), exact.
        assert (ev["status"], ev["verified"]) == (DONE, full(toks)), (rid, ev)
        recv = D.find("recving", rid)
        assert len(recv) == 1 and recv[0]["invalid"] == [], (rid, recv)
        # P frees once D is done: within one step plus the tick (the TTL is 30 s away).
        sent = P.wait("sent", rid, timeout=5)
        assert sent["t"] <= recv[0]["t"] + MARGIN, (rid, sent["t"] - recv[0]["t"])
    settle(P, D)


def test_b_lost_request_freed_at_ttl_and_late_read_fails_cleanly(spawn):
    ttl = 0.4
    P, D = pair(spawn, ttl_ms=int(ttl * 1000), p_blocks=10)
    toks = prompt(21, 6 * BLOCK + 5)  # 7 of P's 9 usable blocks
    fin = prefill(P, "lost", toks)
    sent = P.wait("sent", "lost", timeout=ttl + 5)
    assert fin["t"] + ttl - TICK <= sent["t"] <= fin["t"] + ttl + MARGIN, sent["t"] - fin["t"]
    # P reuses every block the lease held: a read that still succeeded would bring wrong bytes.
    other = prompt(22, 8 * BLOCK + 3)
    P.add("other", other, max_tokens=1)
    assert P.wait("finished", "other")["status"] == DONE
    D.add("lost", toks, max_tokens=3, params=fin["params"])
    ev = D.wait("finished", "lost")
    assert (ev["status"], ev["verified"]) == (DONE, 0), ev  # recomputed, nothing stale kept
    # D asks P for the lease before it reads: P answers it is gone and D reads nothing; a read
    # that went out anyway fails every block it asked for.
    for recv in D.find("recving", "lost"):
        assert recv["invalid"] == sorted(recv["blocks"][: full(toks)]), recv
    settle(P, D)


def test_c_d_queues_longer_than_ttl_and_heartbeats_keep_the_lease(spawn):
    ttl = 0.3
    P, D = pair(spawn, ttl_ms=int(ttl * 1000), heartbeat_ms=50, d_blocks=24)
    D.send("pace", ms=10)  # a slow decode: the hog below holds D's blocks for over 3 TTLs
    hog = prompt(31, 12 * BLOCK + 8)  # 13 blocks, 19 at its end: never 13 free beside it
    D.add("hog", hog, max_tokens=100)
    toks = prompt(32, 12 * BLOCK + 3)
    fin = prefill(P, "c", toks)
    D.add("c", toks, max_tokens=3, params=fin["params"])
    wait = D.wait("waiting", "c", timeout=20)
    assert D.find("finished", "hog"), "c's load started before the hog freed D's blocks"
    assert wait["t"] - fin["t"] > 2 * ttl, wait["t"] - fin["t"]
    assert not P.find("sent", "c"), "P freed c's blocks while D still queued it"
    recv = D.wait("recving", "c")
    assert recv["invalid"] == [], recv
    ev = D.wait("finished", "c")
    assert (ev["status"], ev["verified"]) == (DONE, full(toks)), ev
    sent = P.wait("sent", "c", timeout=5)
    assert wait["t"] < sent["t"] <= recv["t"] + MARGIN, (sent["t"] - wait["t"], sent["t"] - recv["t"])
    settle(P, D)


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_d_p_killed_mid_transfer_fails_exactly_the_missing_blocks(spawn, policy):
    load = 0.6
    P, D = pair(spawn, ttl_ms=30_000, load_ms=int(load * 1000), policy=policy)
    # d0 transfers whole; D's prefix cache then holds its blocks.
    d0 = prompt(41, 5 * BLOCK + 5)
    D.add("d0", d0, max_tokens=2, params=prefill(P, "d0", d0)["params"])
    assert D.wait("finished", "d0")["verified"] == 5
    # d1: 3 blocks D has (a local hit), 4 only P has.
    d1 = d0[: 3 * BLOCK] + prompt(42, 4 * BLOCK + 7)
    fin = prefill(P, "d1", d1)
    # Mid-transfer for sure: P stopped, D's read of d1 in flight against it, then P killed.
    P.stop()
    D.add("d1", d1, max_tokens=3, params=fin["params"])
    wait = D.wait("waiting", "d1")
    time.sleep(0.1)
    killed = P.kill()
    recv = D.wait("recving", "d1")
    assert killed < recv["t"] <= wait["t"] + load + MARGIN, (recv["t"] - killed, recv["t"] - wait["t"])
    assert recv["invalid"] == sorted(recv["blocks"][3:7]), recv  # exactly what only P had
    ev = D.wait("finished", "d1")
    if policy == "recompute":
        assert (ev["status"], ev["verified"]) == (DONE, 3), ev
    else:
        assert (ev["status"], ev["verified"]) == ("FINISHED_ERROR", 0), ev
    settle(D)


def test_e_p_stopped_mid_transfer_then_continued_releases_at_once_after_its_ttl(spawn):
    ttl, load = 0.4, 0.3
    P, D = pair(spawn, ttl_ms=int(ttl * 1000), load_ms=int(load * 1000))
    toks = prompt(51, 5 * BLOCK + 9)
    fin = prefill(P, "e", toks)
    stopped = P.stop()
    D.add("e", toks, max_tokens=3, params=fin["params"])
    wait = D.wait("waiting", "e")
    recv = D.wait("recving", "e")
    # D gave up at its deadline, not before (P only stopped) and not much after.
    assert wait["t"] + load - SLACK <= recv["t"] <= wait["t"] + load + MARGIN, recv["t"] - wait["t"]
    assert recv["invalid"] == sorted(recv["blocks"][: full(toks)]), recv
    ev = D.wait("finished", "e")
    assert (ev["status"], ev["verified"]) == (DONE, 0), ev
    # P continues after its lease's TTL passed while it was stopped: it frees at once, and not
    # while it was stopped (a read of it may have been in flight).
    time.sleep(max(0.0, fin["t"] + ttl + 0.1 - time.monotonic()))
    cont = P.cont()
    assert cont - stopped > ttl
    sent = P.wait("sent", "e", timeout=5)
    assert cont <= sent["t"] <= cont + MARGIN, sent["t"] - cont
    settle(P, D)


def test_f_partition_fails_the_load_by_its_deadline_and_p_frees_at_ttl(netns, spawn):
    ttl, load = 1.0, 0.3
    P, D = pair(spawn, ttl_ms=int(ttl * 1000), load_ms=int(load * 1000),
                listen=f"{pd_netns.ADDR_P}:{free_port()}",
                p_prefix=netns.exec(netns.p), d_prefix=netns.exec(netns.d))
    # f0 over the link: it works, and D is connected to P.
    f0 = prompt(61, 4 * BLOCK + 2)
    D.add("f0", f0, max_tokens=2, params=prefill(P, "f0", f0)["params"])
    assert D.wait("finished", "f0")["verified"] == 4
    f1 = prompt(62, 5 * BLOCK + 11)
    fin = prefill(P, "f1", f1)
    netns.cut()
    D.add("f1", f1, max_tokens=3, params=fin["params"])
    wait = D.wait("waiting", "f1")
    recv = D.wait("recving", "f1")
    assert wait["t"] + load - SLACK <= recv["t"] <= wait["t"] + load + MARGIN, recv["t"] - wait["t"]
    assert recv["invalid"] == sorted(recv["blocks"][: full(f1)]), recv
    ev = D.wait("finished", "f1")
    assert (ev["status"], ev["verified"]) == (DONE, 0), ev
    # No heartbeat crosses the cut: P frees at the TTL.
    sent = P.wait("sent", "f1", timeout=ttl + 5)
    assert fin["t"] + ttl - TICK <= sent["t"] <= fin["t"] + ttl + MARGIN, sent["t"] - fin["t"]
    settle(P, D)


def _bad_params(good: dict) -> dict[str, object]:
    """kv_transfer_params a proxy or a peer could send D: garbage, truncated, foreign."""
    kvx = good["kvx"]
    keys = list(kvx) if isinstance(kvx, dict) else ["a"]
    text = json.dumps(kvx)
    truncated = copy.deepcopy(kvx)
    if isinstance(truncated, dict) and truncated:
        truncated.pop(sorted(truncated)[-1])
    else:
        truncated = text[: len(text) // 2]
    return {
        "garbage_kvx": {"do_remote_prefill": True, "kvx": "\x00garbage\xff"},
        "wrong_types": {"do_remote_prefill": True, "kvx": {key: [None, -1, "x"] for key in keys}},
        "truncated": {"do_remote_prefill": True, "kvx": truncated},
        "json_cut": {"do_remote_prefill": True, "kvx": text[: len(text) // 2]},
        "foreign": {"do_remote_prefill": True, "remote_engine_id": "nixl-0", "remote_block_ids": [1, 2, 3],
                    "remote_host": "127.0.0.1", "remote_port": 1},
        "not_a_dict": {"do_remote_prefill": True, "kvx": [1, 2, 3]},
    }


def test_g_bad_params_are_a_per_request_error_and_recompute(spawn):
    P, D = pair(spawn, ttl_ms=30_000)
    toks = prompt(71, 4 * BLOCK + 4)
    good = prefill(P, "g", toks)["params"]
    bad = _bad_params(good)
    # A descriptor naming blocks P never had: P's real params, for a prompt P never saw.
    bad["blocks_p_never_had"] = good
    for name, params in bad.items():
        other = prompt(72, 4 * BLOCK + 4) if name == "blocks_p_never_had" else toks
        D.add(name, other, max_tokens=2, params=params)
        ev = D.wait("finished", name)
        assert (ev["status"], ev["verified"]) == (DONE, 0), (name, ev)
    # Nothing crashed, nothing leaked: the good params still load byte-exact.
    D.add("g", toks, max_tokens=2, params=good)
    ev = D.wait("finished", "g")
    assert (ev["status"], ev["verified"]) == (DONE, full(toks)), ev
    assert D.find("recving", "g")[-1]["invalid"] == []
    settle(P, D)


def test_h_abort_while_remote_load_runs_fences_blocks_then_reload_or_recompute(spawn):
    """vLLM never preempts a request in WAITING_FOR_REMOTE_KVS (it is not running); what can end
    it while its load runs is an abort (``finish_requests``), which vLLM answers by delaying the
    free of its blocks until the worker reports the load finished: the fence. P is stopped so
    the load is surely in flight; D's blocks must stay allocated until D's worker reports the
    load, which ends at its deadline. Then the proxy retries the same params: the lease is still
    valid, so the retry loads byte-exact (or, if D's abort released P, recomputes)."""
    load = 0.4
    P, D = pair(spawn, ttl_ms=30_000, load_ms=int(load * 1000))
    toks = prompt(81, 6 * BLOCK + 1)
    fin = prefill(P, "h", toks)
    P.stop()
    D.add("h", toks, max_tokens=3, params=fin["params"])
    wait = D.wait("waiting", "h")
    D.send("abort", id="h")
    aborted = D.wait("aborted", "h")
    st = D.state()["state"]
    assert st["vllm_used_blocks"] >= full(toks), st  # the fence: a read may still write them
    recv = D.wait("recving", "h")
    assert aborted["t"] < recv["t"] <= wait["t"] + load + MARGIN, recv["t"] - wait["t"]
    settle(D)
    P.cont()
    D.add("h2", toks, max_tokens=3, params=fin["params"])
    ev = D.wait("finished", "h2")
    recv2 = D.wait("recving", "h2")
    if recv2["invalid"]:
        assert recv2["invalid"] == sorted(recv2["blocks"][: full(toks)]) and ev["verified"] == 0, (recv2, ev)
    else:
        assert ev["verified"] == full(toks), ev
    assert ev["status"] == DONE, ev
    P.wait("sent", "h", timeout=5)
    settle(P, D)
