"""``vllm serve`` with kvx: SIGTERM to the server process alone (a container stop), the first
server in drain mode (``--shutdown-timeout``: vLLM stops its worker, whose shutdown stops kvx's
driver), and a restart on the same file tier stopped in vLLM's default mode (restart.py)."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

from restart import check_clean, check_full_hit, check_no_error, stop_and_restart

STARTS_IN_A_ROW = 2
# Drain mode's bound on the requests still running; none are at the signal.
DRAIN_S = 10


def scenario(tmp: Path, model_dir: str) -> dict[str, Any]:
    return stop_and_restart(tmp, model_dir, "serve2", "serve2_late", signal.SIGTERM, group=False, drain_s=DRAIN_S)


def test_sigterm_shutdown_is_clean_and_the_restart_adopts_the_files(run: dict, reference: dict) -> None:
    """The drained exit is clean and the worker's shutdown stopped kvx's driver; after the
    restart every prompt whose stores landed before the signal is a full hit from the files,
    and the set answered just before it runs without an error; the restarted server's own
    SIGTERM (abort mode) is clean too."""
    check_no_error(run["stored"], "serve2", reference)
    check_clean(run["stop"], "SIGTERM to the server in drain mode", drained=True)
    check_full_hit(run["stored_again"], "serve2", reference)
    check_no_error(run["late_again"], "serve2_late", reference)
    check_clean(run["stop_again"], "SIGTERM to the restarted server")
