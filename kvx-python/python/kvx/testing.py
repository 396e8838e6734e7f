"""Test fixtures: ``FrozenMount``, a FUSE mount (kvx-fusefs) that freezes on demand, and
``frozen_mount``, one for a pytest test (skipped with one line where FUSE is unavailable).

Only in a wheel built with the cargo feature ``testing`` (``maturin build --features testing``,
as ci.sh does).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from kvx import _native

try:
    FrozenMount = _native.FrozenMount
except AttributeError as e:
    raise ImportError("kvx.testing needs a kvx wheel built with the cargo feature `testing`") from e


@contextlib.contextmanager
def frozen_mount(tmp_path: Path, test: str) -> Iterator[tuple[FrozenMount, Path]]:
    """A freezable mount at ``tmp_path / "mnt"`` over ``tmp_path / "backing"``, not frozen yet,
    and its mount point; skips ``test`` (one line naming it) where FUSE is unavailable. Closed
    afterwards, which releases any file operation still stuck in it."""
    import pytest

    reason = FrozenMount.unavailable()
    if reason is not None:
        print(f"skip: {test}: {reason}")
        pytest.skip(reason)
    backing, mnt = tmp_path / "backing", tmp_path / "mnt"
    backing.mkdir(exist_ok=True)
    mnt.mkdir(exist_ok=True)
    mount = FrozenMount(str(mnt), str(backing))
    try:
        yield mount, mnt
    finally:
        mount.close()


__all__ = ["FrozenMount", "frozen_mount"]
