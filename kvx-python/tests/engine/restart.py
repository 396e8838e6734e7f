"""A ``vllm serve`` with kvx stopped by a signal and started again on its file tier: what the
shutdown tests run and check. kvx runs with policy ``fail``, so that a block file that does not
load whole is an error the test sees, not a silent recompute.

``stop_and_restart``: a server answers a prompt set (token-id prompts over HTTP) and its stores
land; a second set follows and the signal is sent as soon as it is answered (stores may be in
flight); the server's exit is recorded; a second server on the same file tier runs both sets
again and is stopped the same way."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import prompts
from server import Server
from tier import block_files, unexpected_files, wait_files

# vLLM's own SIGINT/SIGTERM path ends its engine core at once (abort mode, no drain) and the
# server in about 2 s here; kvx's shutdown does not wait for I/O. 15 s covers process teardown
# on a loaded 2-core machine.
EXIT_BOUND_S = 15.0


def kvx_config(root: Path) -> dict:
    return {
        "role": "kv_both",
        "policy": "fail",
        "extra": {"host_blocks": 64, "file": {"roots": [str(root)], "blocks": 1024}},
    }


# vLLM's API server stops its engine client in an executor thread (launcher.py,
# run_in_executor(engine_client.shutdown)): the client's cleanup cancels the task reading the
# engine core's output socket from that thread (core_client.py, close_sockets_and_tasks), and
# only afterwards AsyncLLM.shutdown cancels output_handler. When the event loop runs in between,
# the cancelled reader queues an EngineDeadError and output_handler logs it. That race is
# vLLM's own, with or without a connector (seen here without one, and kvx runs no code in the
# API server process): it is told apart by its traceback, which holds only vLLM's output path.
SHUTDOWN_RACE = ("AsyncLLM output_handler failed.", "in get_output_async", "EngineDeadError")


def dead_errors(output: str) -> dict[str, int]:
    """EngineDeadErrors the server printed: those of vLLM's shutdown race, and any other."""
    lines = output.splitlines()
    handler, reader = (sum(1 for line in lines if mark in line) for mark in SHUTDOWN_RACE[:2])
    dead = sum(1 for line in lines if f"{SHUTDOWN_RACE[2]}:" in line)
    race = min(handler, reader, dead)
    return {"race": race, "other": dead - race}


def kvx_failures(output: str) -> list[str]:
    """Lines that say kvx failed: a traceback frame in kvx's package, an error of its logger, a
    fatal engine core or a worker that died."""
    marks = ("/kvx/", "kvx._native", "KvxError", "FenceNotHeldError", "encountered a fatal error",
             "died unexpectedly", "panicked")
    return [line for line in output.splitlines() if any(m in line for m in marks)]


# The line kvx's worker logs when vLLM's worker shutdown stopped its driver (worker_side.py).
KVX_SHUTDOWN = "kvx: worker shutdown: driver and backends stopped"


def stop(s: Server, root: Path, sig: signal.Signals, group: bool) -> dict[str, Any]:
    """Signal the server; how it exited, and what its file tier holds then."""
    before = len(block_files(root))
    r = s.stop(sig, group, timeout=60.0)
    return {
        "code": r["code"],
        "seconds": r["seconds"],
        "left": r["left"],
        "kvx_shutdowns": r["output"].count(KVX_SHUTDOWN),
        "dead_errors": dead_errors(r["output"]),
        "kvx_failures": kvx_failures(r["output"]),
        "tracebacks": r["output"].count("Traceback"),
        "files_at_signal": before,
        "files_after": len(block_files(root)),
        "unexpected": unexpected_files(root),
    }


def stop_and_restart(
    tmp: Path, model_dir: str, stored: str, late: str, sig: signal.Signals, group: bool,
    drain_s: int | None = None,
) -> dict[str, Any]:
    """``stored``: the set whose stores land before the signal; ``late``: the set answered
    just before it. ``group``: signal the server's process group (a terminal's Ctrl-C), else
    the server process alone (a container stop). ``drain_s``: the first server's
    ``--shutdown-timeout`` (drain mode); the restarted one stops in vLLM's default mode."""
    root = tmp / "root"
    root.mkdir()
    out: dict[str, Any] = {}

    def send(s: Server, key: str, name: str) -> None:
        out[key] = s.generate(prompts.prompts(name), prompts.max_tokens(name))

    s = Server("first", tmp, model_dir, kvx_config(root), drain_s=drain_s).ready()
    try:
        send(s, "stored", stored)
        wait_files(root, prompts.blocks(stored))
        send(s, "late", late)
    finally:
        out["stop"] = stop(s, root, sig, group)
    s = Server("restarted", tmp, model_dir, kvx_config(root)).ready()
    try:
        send(s, "stored_again", stored)
        send(s, "late_again", late)
    finally:
        out["stop_again"] = stop(s, root, sig, group)
    return out


def check_clean(stop: dict, what: str, drained: bool = False) -> None:
    """Exited within the bound, and no process of its group (the engine core and the worker,
    where kvx's driver runs) outlived it; no EngineDeadError but vLLM's own shutdown race,
    nothing of kvx failed, no temporary file visible. ``drained``: drain mode, where vLLM
    stops its worker, and the worker's shutdown stopped kvx's driver (its log line)."""
    print(f"{what}: {stop}")
    assert stop["code"] is not None and stop["seconds"] <= EXIT_BOUND_S, stop
    assert stop["left"] == [], stop
    if drained:
        assert stop["kvx_shutdowns"] == 1, stop
    assert stop["dead_errors"]["other"] == 0, stop
    assert stop["kvx_failures"] == [], stop
    assert stop["unexpected"] == [], stop


def check_full_hit(r: dict, name: str, reference: dict) -> None:
    """Every full block of every prompt of the set came from the file tier, and loaded (policy
    ``fail``: a failed load would be an error), with the same tokens."""
    check_no_error(r, name, reference)
    want = prompts.hit_tokens(name)
    assert r["counts"]["external_hits"] == want, (name, r["counts"])
    assert r["counts"].get("cached_disk", 0) == want, (name, r["counts"])
    # kvx's counters under vLLM's /metrics say the same: every block loaded, none failed.
    assert r["counts"].get("kvx_loaded_blocks", 0) == want // prompts.BLOCK, (name, r["counts"])
    assert r["counts"].get("kvx_load_failed_blocks", 0) == 0, (name, r["counts"])


def check_no_error(r: dict, name: str, reference: dict) -> None:
    assert r["finish"] == ["length"] * len(r["finish"]), (name, r["finish"])
    assert r["tokens"] == reference[name], name
