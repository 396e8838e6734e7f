"""``vllm serve`` with kvx (host and file tiers, policy ``fail``, so that a block file that
does not load whole is an error the test sees), three starts on one file tier:

1. answers OpenAI completions requests with token-id prompts over HTTP on 127.0.0.1 (the
   same tokens as no connector); its stores land; then a second set, and SIGINT to the
   server's process group (a terminal's Ctrl-C) as soon as that set is answered;
2. restarts on the file tier: every prompt of the first set is a full hit from the files; a
   third set is stored, then a fourth, and SIGTERM to the server process (a container stop);
3. restarts: every prompt whose stores landed before the second stop is a full hit.

Each stop: the server exits within ``EXIT_BOUND_S``, prints no ``EngineDeadError``, and the file
tier holds nothing but finished block files and spare files (no temporary visible). The sets
sent just before a stop may have stores in flight at the signal: after the restart they run
without an error and with the same tokens (a file cut short would fail its load), with
whatever hits they have."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import prompts
from server import Server
from tier import block_files, unexpected_files, wait_files

STARTS_IN_A_ROW = 3
# vLLM's own SIGINT/SIGTERM path ends its engine core at once (abort mode, no drain) and the
# server in about 2 s here; kvx's shutdown does not wait for I/O. 15 s covers process teardown
# on a loaded 2-core machine.
EXIT_BOUND_S = 15.0


def _kvx(root: Path) -> dict:
    return {
        "role": "kv_both",
        "policy": "fail",
        "extra": {"host_blocks": 64, "file": {"roots": [str(root)], "blocks": 1024}},
    }


def _stop(s: Server, root: Path, sig: signal.Signals, group: bool) -> dict[str, Any]:
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


def scenario(tmp: Path, model_dir: str) -> dict[str, Any]:
    root = tmp / "serve-root"
    root.mkdir()
    out: dict[str, Any] = {}

    def send(s: Server, key: str, name: str) -> None:
        out[key] = s.generate(prompts.prompts(name), prompts.max_tokens(name))

    s = Server("serve1", tmp, model_dir, _kvx(root)).ready()
    try:
        send(s, "first", "serve")
        wait_files(root, prompts.blocks("serve"))
        send(s, "first_late", "serve_late")
    finally:
        out["stop1"] = _stop(s, root, signal.SIGINT, group=True)

    s = Server("serve2", tmp, model_dir, _kvx(root)).ready()
    try:
        send(s, "second", "serve")
        # Whatever of this set's blocks did not land before the stop is stored now.
        send(s, "second_late1", "serve_late")
        wait_files(root, prompts.blocks("serve", "serve_late"))
        send(s, "second_new", "serve2")
        wait_files(root, prompts.blocks("serve", "serve_late", "serve2"))
        send(s, "second_late", "serve2_late")
    finally:
        out["stop2"] = _stop(s, root, signal.SIGTERM, group=False)

    s = Server("serve3", tmp, model_dir, _kvx(root)).ready()
    try:
        for name in ("serve", "serve_late", "serve2", "serve2_late"):
            send(s, f"third_{name}", name)
    finally:
        out["stop3"] = _stop(s, root, signal.SIGTERM, group=False)
    return out


def test_serve_completions_with_token_id_prompts(run: dict, reference: dict) -> None:
    r = run["first"]
    assert r["finish"] == ["length"] * len(r["finish"]), r["finish"]
    assert r["tokens"] == reference["serve"]
    assert run["first_late"]["tokens"] == reference["serve_late"]


def _clean(stop: dict, what: str) -> None:
    print(f"{what}: {stop}")
    assert stop["code"] is not None and stop["seconds"] <= EXIT_BOUND_S, stop
    assert not stop["dead_error"], stop
    assert stop["unexpected"] == [], stop


def _full_hit(r: dict, name: str, reference: dict) -> None:
    assert r["finish"] == ["length"] * len(r["finish"]), (name, r["finish"])
    assert r["tokens"] == reference[name], name
    want = prompts.hit_tokens(name)
    assert r["counts"]["external_hits"] == want, (name, r["counts"])
    assert r["counts"].get("cached_disk", 0) == want, (name, r["counts"])


def _no_error(r: dict, name: str, reference: dict) -> None:
    assert r["finish"] == ["length"] * len(r["finish"]), (name, r["finish"])
    assert r["tokens"] == reference[name], name


def test_sigint_shutdown_is_clean_and_the_restart_adopts_the_files(run: dict, reference: dict) -> None:
    _clean(run["stop1"], "SIGINT to the process group")
    _full_hit(run["second"], "serve", reference)
    _no_error(run["second_late1"], "serve_late", reference)


def test_sigterm_shutdown_is_clean_and_the_restart_adopts_the_files(run: dict, reference: dict) -> None:
    _clean(run["stop2"], "SIGTERM to the server")
    _clean(run["stop3"], "SIGTERM to the server (third start)")
    _full_hit(run["third_serve"], "serve", reference)
    _full_hit(run["third_serve_late"], "serve_late", reference)
    _full_hit(run["third_serve2"], "serve2", reference)
    _no_error(run["third_serve2_late"], "serve2_late", reference)
