"""A file tier behind a mount the test can freeze (kvx.testing.FrozenMount, in the test wheel),
already holding some prompts' blocks: what the stuck-mount tests start from."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from harness import Engine


@contextlib.contextmanager
def stored_behind_frozen_mount(
    tmp_path: Path, test: str, extra: dict, prompts: list[list[int]]
) -> Iterator[tuple[Any, dict]]:
    """Skip ``test`` (one line) where FUSE is unavailable; else mount a freezable directory,
    make it the file tier of ``extra`` (its other keys kept), let a first engine store
    ``prompts`` there and go, and yield (the mount, not frozen yet; the engine config). The
    mount is closed afterwards, releasing any file operation still stuck in it."""
    from kvx.testing import frozen_mount

    with frozen_mount(tmp_path, test) as (mount, mnt):
        config = {**extra, "file": {"roots": [str(mnt)], "blocks": 16384}}
        e = Engine(tmp_path, config)
        try:
            for i, p in enumerate(prompts):
                e.add(f"w{i}", p)
            e.run()
        finally:
            e.close()
        assert any((tmp_path / "backing").rglob("*.kvb")), "the first engine stored blocks in the file tier"
        yield mount, config


def loads_and_stores_stuck(e: Any) -> bool:
    """Loads of stored prompts are in flight, and more kvx ops than those: new prompts' stores
    (the kvx jobs beyond the loading requests are store jobs)."""
    s = e.state()
    return (
        s["worker_loading"] > 0
        and s["sched_kvx_jobs"] > s["sched_loading"]
        and s["worker_kvx_in_flight"] > s["worker_loading"]
    )
