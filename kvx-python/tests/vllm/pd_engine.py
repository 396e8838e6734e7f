"""One P/D engine in a process of its own: the harness's ``Engine`` (vLLM's real scheduler, its
worker-side connector, the fake model) stepping continuously, driven by JSON lines on stdin and
reporting JSON lines on stdout (``pd_proc.EngineProc`` is the other end).

Run as ``python pd_engine.py CONFIG_JSON``; CONFIG_JSON: ``tmp`` (a directory), ``extra`` (the
connector's extra config), and optional ``kv_role``, ``policy``, ``num_blocks``,
``prefix_caching``, ``max_num_seqs``, ``max_batched_tokens``.

Commands (one JSON object a line): ``{"cmd": "add", "id", "prompt", "max_tokens", "params"}``,
``{"cmd": "abort", "id"}``, ``{"cmd": "verify", "id"}`` (check every full block a running
request computed so far holds its tokens' bytes), ``{"cmd": "pace", "ms"}`` (sleep that long after each step: a slow
model), ``{"cmd": "state"}``, ``{"cmd": "stop"}`` (also on end of input).

Events (``ev``; every time is ``time.monotonic()``, one clock for every process of the machine):
``ready`` (pid), ``matched`` (the connector's get_num_new_matched_tokens answer changed:
t, tokens, load_async), ``waiting`` (entered WAITING_FOR_REMOTE_KVS: t, blocks), ``recving`` (in
finished_recving: t, invalid blocks, blocks of the load), ``finished`` (t, status, params,
verified blocks, preemptions), ``aborted`` (t), ``verify`` (t, blocks checked), ``sent`` (in
finished_sending: t), ``state`` (state, idle, verified, full_collections: the garbage
collector's full collections since the start), ``error`` (a traceback; the process then exits 1).
"""

from __future__ import annotations

import gc
import json
import os
import queue
import sys
import threading
import time
import traceback
from pathlib import Path

# Events go to the original stdout; anything else written to fd 1 (vLLM's and torch's logs)
# goes to stderr, so the event stream holds only events.
_EVENTS = os.fdopen(os.dup(1), "w", buffering=1)
os.dup2(2, 1)
sys.stdout = sys.stderr

sys.path.insert(0, str(Path(__file__).parent))

from vllm.utils.gc_utils import freeze_gc_heap  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

from harness import Engine, Tracked  # noqa: E402


def emit(ev: str, **kw) -> None:
    """Write one event line."""
    _EVENTS.write(json.dumps({"ev": ev, **kw}) + "\n")


def _stdin_reader(q: queue.Queue) -> None:
    for raw in sys.stdin:
        if raw.strip():
            q.put(json.loads(raw))
    q.put({"cmd": "stop"})


class Reporter:
    """Turns what the harness tracked into events, each once."""

    def __init__(self, engine: Engine):
        self.e = engine
        self.waiting: dict[str, int] = {}  # loads reported per request
        self.recving: dict[str, int] = {}
        self.finished: set[str] = set()
        self.sent: set[str] = set()

    def spy_matches(self) -> None:
        """Report what the connector's ``get_num_new_matched_tokens`` answers for each request
        (``matched`` events, each time the answer changes): when D offers a remote load."""
        conn = self.e.conn
        inner = conn.get_num_new_matched_tokens
        last: dict[str, object] = {}

        def spy(request, num_computed_tokens):
            out = inner(request, num_computed_tokens)
            rid = request.request_id
            if last.get(rid) != out:
                last[rid] = out
                emit("matched", id=rid, t=time.monotonic(), tokens=out[0], load_async=out[1])
            return out

        conn.get_num_new_matched_tokens = spy

    def flush(self) -> None:
        for rid, t in self.e.tracked.items():
            self._request(rid, t)

    def _request(self, rid: str, t: Tracked) -> None:
        n = len(t.load_blocks)
        if n > self.waiting.get(rid, 0):
            self.waiting[rid] = n
            # The wait's start, kept: a load reported in the step it began in ended its wait
            # (entered_wait is None again) before this flush.
            emit("waiting", id=rid, t=t.wait_started[n - 1], blocks=t.load_blocks[-1])
        n = len(t.recv_at)
        if n > self.recving.get(rid, 0):
            self.recving[rid] = n
            emit(
                "recving",
                id=rid,
                t=t.recv_at[-1],
                invalid=sorted(t.invalid),
                blocks=t.load_blocks[-1] if t.load_blocks else [],
            )
        if t.finished_at is not None and rid not in self.finished:
            self.finished.add(rid)
            status = t.finished_status.name if t.finished_status is not None else None
            emit(
                "finished",
                id=rid,
                t=t.finished_at,
                status=status,
                params=t.params,
                verified=t.verified,
                preemptions=t.request.num_preemptions,
            )
        if t.sent_at is not None and rid not in self.sent:
            self.sent.add(rid)
            emit("sent", id=rid, t=t.sent_at)


def main() -> int:
    cfg = json.loads(sys.argv[1])
    e = Engine(
        Path(cfg["tmp"]),
        cfg["extra"],
        kv_role=cfg.get("kv_role", "kv_both"),
        policy=cfg.get("policy", "recompute"),
        num_blocks=cfg.get("num_blocks", 64),
        prefix_caching=cfg.get("prefix_caching", False),
        max_num_seqs=cfg.get("max_num_seqs", 8),
        max_batched_tokens=cfg.get("max_batched_tokens", 128),
    )
    q: queue.Queue = queue.Queue()
    threading.Thread(target=_stdin_reader, args=(q,), daemon=True).start()
    rep = Reporter(e)
    rep.spy_matches()
    # As vLLM's engine core does once it started: the startup heap (vLLM, torch: ~650 000
    # objects) is left out of every later collection. A full collection of it took 0.2-0.35 s
    # here, a pause of this loop that a test bounding a load by its deadline (0.3 s) + 51 ms
    # would count against kvx: CI once saw two loads end 0.30 and 0.31 s late.
    freeze_gc_heap()
    frozen_at = gc.get_stats()[2]["collections"]
    pace = 0.0
    emit("ready", pid=os.getpid())
    try:
        while True:
            while not q.empty():
                c = q.get()
                cmd = c["cmd"]
                if cmd == "stop":
                    return 0
                if cmd == "add":
                    e.add(c["id"], c["prompt"], c.get("max_tokens", 2), c.get("params"))
                elif cmd == "abort":
                    e.scheduler.finish_requests(c["id"], RequestStatus.FINISHED_ABORTED)
                    emit("aborted", id=c["id"], t=time.monotonic())
                elif cmd == "verify":
                    t = e.tracked[c["id"]]
                    before = t.verified
                    e._check(t, t.request.num_computed_tokens)
                    emit("verify", id=c["id"], t=time.monotonic(), blocks=t.verified - before)
                elif cmd == "pace":
                    pace = c["ms"] / 1000
                elif cmd == "state":
                    emit(
                        "state",
                        state=e.state(),
                        idle=e.idle(),
                        verified=e.verified_blocks,
                        full_collections=gc.get_stats()[2]["collections"] - frozen_at,
                    )
                else:
                    raise ValueError(f"unknown command {c!r}")
            e.step()
            rep.flush()
            if pace:
                time.sleep(pace)
            elif e.scheduler.get_num_unfinished_requests() == 0:
                time.sleep(0.001)
    except BaseException:
        emit("error", trace=traceback.format_exc())
        return 1
    finally:
        e.close()


if __name__ == "__main__":
    code = main()
    _EVENTS.flush()
    os._exit(code)
