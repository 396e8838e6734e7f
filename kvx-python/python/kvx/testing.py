"""Test fixtures: ``FrozenMount``, a FUSE mount (kvx-fusefs) that freezes on demand."""

from kvx._native import FrozenMount

__all__ = ["FrozenMount"]
