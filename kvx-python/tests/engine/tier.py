"""A kvx file tier as the tests see it from outside: its block files (``ROOT/ab/<hex>.kvb``),
its temporaries (``*.kvb.tmp``) and spare files (``ROOT/.kvx-spare/``), corrupting every block,
waiting for stores to land."""

from __future__ import annotations

import time
from pathlib import Path

HEADER = 4096
SPARE_DIR = ".kvx-spare"


def block_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.kvb") if p.is_file())


def corrupt(root: Path) -> int:
    """Overwrite 64 bytes in the middle of the payload of every block file (past the 4 KiB
    header): each file's payload checksum no longer matches."""
    files = block_files(root)
    for f in files:
        size = f.stat().st_size
        at = HEADER + (size - HEADER) // 2
        with open(f, "r+b") as fh:
            fh.seek(at)
            old = fh.read(64)
            fh.seek(at)
            fh.write(bytes(b ^ 0x5A for b in old))
    return len(files)


def wait_files(root: Path, count: int, timeout: float = 60.0) -> int:
    """Until exactly ``count`` block files are under ``root`` (the stores of the runs before
    finished); more than ``count`` is an error at once."""
    end = time.monotonic() + timeout
    while True:
        n = len(block_files(root))
        if n > count:
            raise AssertionError(f"{n} block files under {root}, expected {count}")
        if n == count:
            return n
        if time.monotonic() > end:
            raise AssertionError(f"{n} block files under {root} after {timeout}s, expected {count}")
        time.sleep(0.05)


def unexpected_files(root: Path) -> list[str]:
    """Files under ``root`` that are neither a finished block file (``ab/<32 hex>.kvb``, ``ab``
    its first two digits) nor a spare file: temporaries above all."""
    out = []
    for p in sorted(root.rglob("*")):
        if not p.is_file():
            continue
        rel = p.relative_to(root)
        if rel.parts[0] == SPARE_DIR and len(rel.parts) == 2:
            continue
        name = rel.parts[-1]
        block = (
            len(rel.parts) == 2
            and name.endswith(".kvb")
            and len(name) == 36
            and all(c in "0123456789abcdef" for c in name[:32])
            and name[:2] == rel.parts[0]
        )
        if not block:
            out.append(str(rel))
    return out
