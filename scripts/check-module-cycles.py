#!/usr/bin/env python3
"""Check that the top-level modules of a crate use each other without a cycle.

A module `a` uses `b` when code under `src/a` (or `src/a.rs`) names `crate::b` (comments and
doc comments are not code). Exits 1 naming each cycle found.

    python3 scripts/check-module-cycles.py kvx-posix [more crates...]
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def code_of(path: Path) -> str:
    """The file's text without `//` comments (line and doc comments) or string contents."""
    out = []
    for line in path.read_text().splitlines():
        line = re.sub(r'"(?:\\.|[^"\\])*"', '""', line)
        out.append(line.split("//", 1)[0])
    return "\n".join(out)


def graph(crate: Path) -> dict[str, set[str]]:
    src = crate / "src"
    mods = {p.stem if p.is_file() else p.name for p in src.iterdir()
            if (p.is_file() and p.suffix == ".rs" and p.stem not in ("lib", "main")) or (p.is_dir() and (p / "mod.rs").exists())}
    uses: dict[str, set[str]] = {m: set() for m in mods}
    for m in mods:
        files = [src / f"{m}.rs"] if (src / f"{m}.rs").exists() else sorted((src / m).rglob("*.rs"))
        for f in files:
            for other in re.findall(r"\bcrate::([a-z_][a-z0-9_]*)", code_of(f)):
                if other in mods and other != m:
                    uses[m].add(other)
    return uses


def cycles(uses: dict[str, set[str]]) -> list[list[str]]:
    """Every elementary cycle's smallest rotation, once (the graphs here are small)."""
    found: set[tuple[str, ...]] = set()

    def walk(start: str, node: str, path: list[str]) -> None:
        for nxt in sorted(uses[node]):
            if nxt == start:
                i = path.index(min(path))
                found.add(tuple(path[i:] + path[:i]))
            elif nxt not in path and nxt > start:
                walk(start, nxt, path + [nxt])

    for m in sorted(uses):
        walk(m, m, [m])
    return [list(c) for c in sorted(found)]


def main() -> int:
    bad = 0
    for name in sys.argv[1:] or ["kvx-posix"]:
        for c in cycles(graph(ROOT / name)):
            print(f"check-module-cycles: {name}: {' -> '.join(c + [c[0]])}")
            bad += 1
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
