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


def stop(s: Server, root: Path, sig: signal.Signals, group: bool) -> dict[str, Any]:
    """Signal the server; how it exited, and what its file tier holds then."""
    before = len(block_files(root))
    r = s.stop(sig, group, timeout=60.0)
    return {
        "code": r["code"],
        "seconds": r["seconds"],
        "dead_error": "EngineDeadError" in r["output"],
        "tracebacks": r["output"].count("Traceback"),
        "files_at_signal": before,
        "files_after": len(block_files(root)),
        "unexpected": unexpected_files(root),
    }


def stop_and_restart(
    tmp: Path, model_dir: str, stored: str, late: str, sig: signal.Signals, group: bool
) -> dict[str, Any]:
    """``stored``: the set whose stores land before the signal; ``late``: the set answered
    just before it. ``group``: signal the server's process group (a terminal's Ctrl-C), else
    the server process alone (a container stop)."""
    root = tmp / "root"
    root.mkdir()
    out: dict[str, Any] = {}

    def send(s: Server, key: str, name: str) -> None:
        out[key] = s.generate(prompts.prompts(name), prompts.max_tokens(name))

    s = Server("first", tmp, model_dir, kvx_config(root)).ready()
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


def check_clean(stop: dict, what: str) -> None:
    """Exited within the bound, no EngineDeadError printed, no temporary file visible."""
    print(f"{what}: {stop}")
    assert stop["code"] is not None and stop["seconds"] <= EXIT_BOUND_S, stop
    assert not stop["dead_error"], stop
    assert stop["unexpected"] == [], stop


def check_full_hit(r: dict, name: str, reference: dict) -> None:
    """Every full block of every prompt of the set came from the file tier, and loaded (policy
    ``fail``: a failed load would be an error), with the same tokens."""
    check_no_error(r, name, reference)
    want = prompts.hit_tokens(name)
    assert r["counts"]["external_hits"] == want, (name, r["counts"])
    assert r["counts"].get("cached_disk", 0) == want, (name, r["counts"])


def check_no_error(r: dict, name: str, reference: dict) -> None:
    assert r["finish"] == ["length"] * len(r["finish"]), (name, r["finish"])
    assert r["tokens"] == reference[name], name
