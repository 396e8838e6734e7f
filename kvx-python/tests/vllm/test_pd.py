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

import pytest

import pd_netns
from harness import BLOCK, prompt
from pd_proc import EngineProc
from ports import free_port

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


def pair(
    spawn,
    *,
    ttl_ms=30_000,
    heartbeat_ms=50,
    load_ms=500,
    policy="recompute",
    p_blocks=128,
    d_blocks=128,
    d_batched=128,
    listen=None,
    p_prefix=(),
    d_prefix=(),
):
    """P (kv_producer, listening) and D (kv_consumer), started together."""
    listen = listen or f"127.0.0.1:{free_port()}"
    remote_p = {"listen": listen, "lease_ttl_ms": ttl_ms, "heartbeat_ms": heartbeat_ms}
    P = spawn(
        "P",
        {
            "kv_role": "kv_producer",
            "num_blocks": p_blocks,
            "prefix_caching": True,
            "extra": {"host_blocks": HOST_BLOCKS, "remote": remote_p},
        },
        p_prefix,
    )
    D = spawn(
        "D",
        {
            "kv_role": "kv_consumer",
            "num_blocks": d_blocks,
            "prefix_caching": True,
            "max_batched_tokens": d_batched,
            "policy": policy,
            "extra": {"host_blocks": HOST_BLOCKS, "remote": {"load_ms": load_ms}},
        },
        d_prefix,
    )
    return P.ready(), D.ready()


def prefill(P: EngineProc, rid: str, toks: list[int]) -> dict:
    """The proxy's first leg: prefill on P; its finished event, with the params for D."""
    P.add(rid, toks, max_tokens=1, params={"do_remote_decode": True})
    ev = P.wait("finished", rid)
    assert ev["status"] == DONE, ev
    params = ev["params"]
    assert isinstance(params, dict) and params.get("do_remote_prefill") is True and "kvx" in params, params
    return ev


def note(test: str, **numbers: float) -> None:
    """Print measured times (ms) for the record: shown with ``pytest -s``."""
    print(f"PD {test}: " + ", ".join(f"{k}={v * 1000:.1f}ms" for k, v in numbers.items()))


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
    # No fault here: a load deadline no busy 2-core machine misses (one 500 ms run saw a whole
    # load fail once, unexplained; see the report of issue 25's tests).
    P, D = pair(spawn, ttl_ms=30_000, load_ms=5_000, p_blocks=192, d_blocks=192)
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
    lag = []
    for rid, toks in reqs.items():
        D.add(rid, toks, max_tokens=3, params=params[rid])
    for rid, toks in reqs.items():
        ev = D.wait("finished", rid)
        recv = D.find("recving", rid)
        assert len(recv) == 1 and recv[0]["invalid"] == [], (rid, D.find("waiting", rid), recv)
        # Every full block came from P (or from D's prefix cache of an earlier one), exact.
        assert (ev["status"], ev["verified"]) == (DONE, full(toks)), (rid, ev)
        # P frees once D is done: within one step plus the tick (the TTL is 30 s away).
        sent = P.wait("sent", rid, timeout=5)
        assert sent["t"] <= recv[0]["t"] + MARGIN, (rid, sent["t"] - recv[0]["t"])
        lag.append(sent["t"] - recv[0]["t"])
    note("a", max_p_free_after_d_recv=max(lag), min_p_free_after_d_recv=min(lag))
    settle(P, D)


def test_b_lost_request_freed_at_ttl_and_late_read_fails_cleanly(spawn):
    ttl = 0.4
    P, D = pair(spawn, ttl_ms=int(ttl * 1000), p_blocks=10)
    toks = prompt(21, 6 * BLOCK + 5)  # 7 of P's 9 usable blocks
    fin = prefill(P, "lost", toks)
    sent = P.wait("sent", "lost", timeout=ttl + 5)
    assert fin["t"] + ttl - TICK <= sent["t"] <= fin["t"] + ttl + MARGIN, sent["t"] - fin["t"]
    note("b", p_free_after_ttl=sent["t"] - fin["t"] - ttl)
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
    print(f"PD b: late request: {len(D.find('recving', 'lost'))} load(s) from P, computed on D")
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
    note("c", queued_past_ttl=wait["t"] - fin["t"] - ttl, p_free_after_d_recv=sent["t"] - recv["t"])
    settle(P, D)


# Mid-transfer for sure: D queues the request with its lease confirmed (it offered the remote
# tokens) but no free blocks (a local "hog" request holds them; D steps slowly); the test breaks
# P (stop, kill, partition), then aborts the hog: D's load starts at its next step, against a P
# that cannot answer.
HOLD = {"d_blocks": 32, "d_batched": 512}  # 31 usable blocks; the hog's prefill in one step
HOG = prompt(99, 24 * BLOCK + 1)  # 25 blocks, the 25th with room for 15 tokens: 6 stay free


def hold(D: EngineProc, rid: str, toks: list[int], params: dict) -> None:
    """Queue ``rid`` on D behind the hog until D offered its remote tokens (more than 6 new
    blocks: it cannot be allocated)."""
    D.send("pace", ms=20)
    D.add("hog", HOG, max_tokens=200)
    D.state()
    D.state()  # a step ran: the hog holds its blocks
    D.add(rid, toks, max_tokens=3, params=params)
    D.wait("matched", rid, pred=lambda e: (e["tokens"] or 0) > 0 and e["load_async"])
    assert not D.find("waiting", rid), "the load started beside the hog"


def release(D: EngineProc) -> None:
    """End the hog: D's queued request gets its blocks and starts its load."""
    D.send("abort", id="hog")
    D.send("pace", ms=0)


def gave_up(D: EngineProc, rid: str, toks: list[int], load: float) -> None:
    """D's load of ``rid`` from a P that cannot answer ended at its deadline (not before, not
    much after) with every block invalid, and the request was computed on D."""
    wait = D.wait("waiting", rid)
    recv = D.wait("recving", rid)
    if not wait["t"] + load - SLACK <= recv["t"] <= wait["t"] + load + MARGIN:
        events = [e for e in list(D.events) if e.get("id") == rid]
        took = recv["t"] - wait["t"]
        raise AssertionError(f"{rid}: the load ended {took:.3f}s after it began; {D.state()}; {events}")
    assert recv["invalid"] == sorted(recv["blocks"][: full(toks)]), recv
    note(rid, load_end_after_deadline=recv["t"] - wait["t"] - load)
    ev = D.wait("finished", rid)
    assert (ev["status"], ev["verified"]) == (DONE, 0), ev


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_d_p_killed_mid_transfer_fails_exactly_the_missing_blocks(spawn, policy):
    load = 0.6
    P, D = pair(spawn, ttl_ms=30_000, load_ms=int(load * 1000), policy=policy, **HOLD)
    # d0 transfers whole; D's prefix cache then holds its blocks.
    d0 = prompt(41, 5 * BLOCK + 5)
    D.add("d0", d0, max_tokens=2, params=prefill(P, "d0", d0)["params"])
    assert D.wait("finished", "d0")["verified"] == 5
    # d1: 3 blocks D has (a local hit), 7 only P has.
    d1 = d0[: 3 * BLOCK] + prompt(42, 7 * BLOCK + 7)
    fin = prefill(P, "d1", d1)
    hold(D, "d1", d1, fin["params"])
    P.stop()
    release(D)
    wait = D.wait("waiting", "d1")
    time.sleep(0.1)
    killed = P.kill()
    recv = D.wait("recving", "d1")
    assert killed < recv["t"] <= wait["t"] + load + MARGIN, (recv["t"] - killed, recv["t"] - wait["t"])
    note(f"d[{policy}]", load_end_after_kill=recv["t"] - killed, load_end_after_start=recv["t"] - wait["t"])
    assert recv["invalid"] == sorted(recv["blocks"][3:10]), recv  # exactly what only P had
    ev = D.wait("finished", "d1")
    if policy == "recompute":
        assert (ev["status"], ev["verified"]) == (DONE, 3), ev
    else:
        assert (ev["status"], ev["verified"]) == ("FINISHED_ERROR", 0), ev
    settle(D)


def test_e_p_stopped_mid_transfer_then_continued_releases_at_once_after_its_ttl(spawn):
    ttl, load = 0.4, 0.3
    P, D = pair(spawn, ttl_ms=int(ttl * 1000), load_ms=int(load * 1000), **HOLD)
    toks = prompt(51, 8 * BLOCK + 9)
    fin = prefill(P, "e", toks)
    hold(D, "e", toks, fin["params"])
    stopped = P.stop()
    release(D)
    gave_up(D, "e", toks, load)
    # P continues after its lease's TTL passed while it was stopped: it frees at once, and not
    # while it was stopped (a read of it may have been in flight).
    time.sleep(max(0.0, stopped + ttl + 0.1 - time.monotonic()))
    cont = P.cont()
    sent = P.wait("sent", "e", timeout=5)
    assert cont <= sent["t"] <= cont + MARGIN, sent["t"] - cont
    note("e", p_free_after_cont=sent["t"] - cont)
    settle(P, D)


def test_f_partition_fails_the_load_by_its_deadline_and_p_frees_at_ttl(netns, spawn):
    ttl, load, heartbeat = 1.0, 0.3, 0.05
    P, D = pair(
        spawn,
        ttl_ms=int(ttl * 1000),
        load_ms=int(load * 1000),
        heartbeat_ms=int(heartbeat * 1000),
        listen=f"{pd_netns.ADDR_P}:{free_port()}",
        p_prefix=netns.exec(netns.p),
        d_prefix=netns.exec(netns.d),
        **HOLD,
    )
    # f0 over the link: it works.
    f0 = prompt(61, 4 * BLOCK + 2)
    D.add("f0", f0, max_tokens=2, params=prefill(P, "f0", f0)["params"])
    assert D.wait("finished", "f0")["verified"] == 4
    f1 = prompt(62, 8 * BLOCK + 11)
    hold(D, "f1", f1, prefill(P, "f1", f1)["params"])
    cut_from = time.monotonic()
    netns.cut()
    cut = time.monotonic()
    release(D)
    gave_up(D, "f1", f1, load)
    # No renewal crosses the cut: P frees at the TTL after the last one (at most a heartbeat
    # before the cut).
    sent = P.wait("sent", "f1", timeout=ttl + 5)
    assert cut_from - heartbeat + ttl - TICK <= sent["t"] <= cut + ttl + MARGIN, sent["t"] - cut
    note("f", p_free_after_cut_plus_ttl=sent["t"] - cut - ttl)
    settle(P, D)


def _corrupt(name: str, good: dict, other: dict) -> dict:
    """P's params ``good`` as a broken proxy or a foreign peer could pass them to D: ``name``
    says how (``other``: P's params of another prompt)."""
    kvx = good["kvx"]
    text = json.dumps(kvx)
    keys = list(kvx) if isinstance(kvx, dict) else ["a"]
    bad = copy.deepcopy(good)
    if name == "garbage":
        bad["kvx"] = "\x00garbage\xff"
    elif name == "not_a_dict":
        bad["kvx"] = [1, 2, 3]
    elif name == "wrong_types":
        bad["kvx"] = {key: [None, -1, "x"] for key in keys}
    elif name == "truncated":
        bad["kvx"] = {key: kvx[key] for key in keys[: len(keys) // 2]}
    elif name == "json_cut":
        bad["kvx"] = text[: len(text) // 2]
    elif name == "foreign":  # NIXL's params, no kvx
        bad = {
            "do_remote_prefill": True,
            "remote_engine_id": "nixl-0",
            "remote_block_ids": [1, 2, 3],
            "remote_host": "127.0.0.1",
            "remote_port": 1,
        }
    elif name == "unknown_export":  # an export P never had
        bad["kvx"]["export"] = (kvx["export"] + 1) % 2**63
    elif name == "dead_producer":
        bad["kvx"]["producers"] = [f"127.0.0.1:{free_port()}"]
    elif name == "other_prompt":  # blocks P has, but not this prompt's
        bad = copy.deepcopy(other)
    else:
        raise ValueError(name)
    return bad


BAD = [
    "garbage",
    "not_a_dict",
    "wrong_types",
    "truncated",
    "json_cut",
    "foreign",
    "unknown_export",
    "dead_producer",
    "other_prompt",
]


def test_g_bad_params_are_a_per_request_error_and_recompute(spawn):
    ttl = 1.5
    P, D = pair(spawn, ttl_ms=int(ttl * 1000), load_ms=300)
    # Each case its own prompt (no local hit on D from another case), prefilled on P.
    prompts = {name: prompt(700 + k, 4 * BLOCK + 4) for k, name in enumerate([*BAD, "good"])}
    good = {name: prefill(P, name, toks)["params"] for name, toks in prompts.items()}
    for name in BAD:
        D.add(name, prompts[name], max_tokens=2, params=_corrupt(name, good[name], good["good"]))
    for name in BAD:
        ev = D.wait("finished", name)
        # Computed on D: nothing loaded, nothing crashed, the request completes.
        assert (ev["status"], ev["verified"]) == (DONE, 0), (name, ev)
    # The consumer still works: the good params load byte-exact.
    D.add("good", prompts["good"], max_tokens=2, params=good["good"])
    ev = D.wait("finished", "good")
    assert (ev["status"], ev["verified"]) == (DONE, 4), ev
    assert D.find("recving", "good")[-1]["invalid"] == []
    # P frees what D never read at the TTL.
    settle(P, D, timeout=ttl + 5)


def test_h_abort_while_remote_load_runs_fences_blocks_then_reload_or_recompute(spawn):
    """vLLM never preempts a request in WAITING_FOR_REMOTE_KVS (it is not running); what ends
    it while its load runs is an abort (``finish_requests``), and vLLM frees its blocks when the
    worker reports the load finished: from then on nothing may write them (the fence). P is
    stopped so the read is surely in flight; D aborts the request; a victim request takes the
    freed blocks and computes its own bytes into them; P continues and answers the stale read;
    every block the victim computed must still hold its bytes. Then the proxy retries the same
    params: the retry loads byte-exact if P still holds the lease, or computes the prompt on D if
    D's abort released it."""
    ttl, load = 2.0, 0.4
    P, D = pair(spawn, ttl_ms=int(ttl * 1000), load_ms=int(load * 1000), **HOLD)
    toks = prompt(81, 8 * BLOCK + 1)
    fin = prefill(P, "h", toks)
    hold(D, "h", toks, fin["params"])
    P.stop()
    release(D)
    wait = D.wait("waiting", "h")
    D.send("abort", id="h")
    aborted = D.wait("aborted", "h")
    recv = D.wait("recving", "h")
    assert aborted["t"] < recv["t"] <= wait["t"] + load + MARGIN, recv["t"] - wait["t"]
    note("h", load_reported_after_abort=recv["t"] - aborted["t"])
    settle(D)
    # The victim: 28 of D's 31 blocks, at least 5 of them h's; D steps slowly so it still runs.
    D.send("pace", ms=20)
    victim = prompt(82, 27 * BLOCK + 1)
    D.add("victim", victim, max_tokens=200)
    D.state()
    D.state()  # its prefill ran
    cont = P.cont()
    time.sleep(0.2)  # P answers the read it holds (if D still listens)
    assert D.state()["state"]["vllm_used_blocks"] >= 28
    D.send("verify", id="victim")
    assert D.wait("verify", "victim")["blocks"] == 27
    D.send("abort", id="victim")
    D.send("pace", ms=0)
    D.add("h2", toks, max_tokens=3, params=fin["params"])
    ev = D.wait("finished", "h2")
    assert ev["status"] == DONE, ev
    recv2 = D.find("recving", "h2")
    if ev["verified"]:
        assert ev["verified"] == full(toks) and recv2[-1]["invalid"] == [], (ev, recv2)
    else:
        assert all(r["invalid"] == sorted(r["blocks"][: full(toks)]) for r in recv2), recv2
    print(f"PD h: the retry {'reloaded from P' if ev['verified'] else 'computed on D'}")
    sent = P.wait("sent", "h", timeout=ttl + 5)
    assert cont <= sent["t"] <= cont + ttl + MARGIN, sent["t"] - cont
    settle(P, D)


def test_h_preempted_after_its_remote_load_resumes_byte_exact(spawn):
    """The other preemption vLLM allows: a request that loaded its prompt from P and is running
    is preempted on D (out of blocks) and comes back with 0 computed tokens; the connector is
    asked again and must not read from P twice (P was told done): D's own tiers or recompute,
    every block it did not compute checked when it resumes."""
    P, D = pair(spawn, ttl_ms=30_000, d_blocks=32, d_batched=512)
    reqs = {f"p{i}": prompt(90 + i, 12 * BLOCK + 1) for i in range(2)}  # 13 blocks, 19 at the end
    params = {rid: prefill(P, rid, toks)["params"] for rid, toks in reqs.items()}
    for rid, toks in reqs.items():
        D.add(rid, toks, max_tokens=100, params=params[rid])
    evs = {rid: D.wait("finished", rid) for rid in reqs}
    assert all(ev["status"] == DONE for ev in evs.values()), evs
    assert sum(ev["preemptions"] for ev in evs.values()) >= 1, evs
    for rid in reqs:
        recv = D.find("recving", rid)
        assert recv[0]["invalid"] == [] and evs[rid]["verified"] >= full(reqs[rid]), (rid, recv, evs[rid])
        sent = P.wait("sent", rid, timeout=5)
        assert sent["t"] <= recv[0]["t"] + MARGIN, (rid, sent["t"] - recv[0]["t"])
    settle(P, D)
