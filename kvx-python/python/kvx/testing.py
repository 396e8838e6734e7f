"""Test fixtures: ``FrozenMount``, a FUSE mount (kvx-fusefs) that freezes on demand.

Only in a wheel built with the cargo feature ``testing`` (``maturin build --features testing``,
as ci.sh does).
"""

from kvx import _native

try:
    FrozenMount = _native.FrozenMount
except AttributeError as e:
    raise ImportError("kvx.testing needs a kvx wheel built with the cargo feature `testing`") from e

__all__ = ["FrozenMount"]
