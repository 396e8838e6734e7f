"""``vllm serve`` with kvx (host and file tiers) on vLLM's CPU build: OpenAI completions with
token-id prompts over HTTP on 127.0.0.1, then SIGINT to the server's process group (a
terminal's Ctrl-C) and a restart on the same file tier (restart.py)."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

from restart import check_clean, check_full_hit, check_no_error, stop_and_restart

STARTS_IN_A_ROW = 2


def scenario(tmp: Path, model_dir: str) -> dict[str, Any]:
    return stop_and_restart(tmp, model_dir, "serve", "serve_late", signal.SIGINT, group=True)


def test_serve_completions_with_token_id_prompts(run: dict, reference: dict) -> None:
    check_no_error(run["stored"], "serve", reference)
    check_no_error(run["late"], "serve_late", reference)


def test_sigint_shutdown_is_clean_and_the_restart_adopts_the_files(run: dict, reference: dict) -> None:
    """The exit is clean; after the restart every prompt whose stores landed before the signal
    is a full hit from the files, and the set answered just before it runs without an error;
    the restarted server's own SIGINT is clean too."""
    check_clean(run["stop"], "SIGINT to the process group")
    check_full_hit(run["stored_again"], "serve", reference)
    check_no_error(run["late_again"], "serve_late", reference)
    check_clean(run["stop_again"], "SIGINT to the restarted server's process group")
