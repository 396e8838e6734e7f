#!/usr/bin/env python3
"""Check that every type ARCHITECTURE.md names exists in the code.

Each backticked CamelCase name (`PosixStore`, `Tracker::submit`, `Event::TaskFinished`,
`TaskSpec.route`) must be declared in a Rust or Python source of the workspace (struct, enum,
trait, type alias, enum variant, class), and each `::`/`.` member after it must be declared
too (a fn, def, field or variant of that name). Exits 1 naming what is missing.

    python3 scripts/check-architecture.py [ARCHITECTURE.md]
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def sources() -> str:
    files = subprocess.run(
        ["git", "ls-files", "*.rs", "*.py", "*.pyi"], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout.split()
    return "\n".join((ROOT / f).read_text(errors="replace") for f in files if (ROOT / f).is_file())


def declared_type(code: str, name: str) -> bool:
    n = re.escape(name)
    patterns = [
        rf"\b(?:struct|enum|trait|type|union)\s+{n}\b",
        rf"\bclass\s+{n}\b",
        rf"#\[pyclass[^\]]*name\s*=\s*\"{n}\"",
        rf"^\s*{n}\s*[,({{]",  # an enum variant
        rf"\bconst\s+{n}\b",
    ]
    return any(re.search(p, code, re.M) for p in patterns)


def declared_member(code: str, name: str) -> bool:
    n = re.escape(name)
    patterns = [
        rf"\bfn\s+{n}\b",
        rf"\bdef\s+{n}\b",
        rf"\bpub(?:\([a-z]+\))?\s+{n}\s*:",  # a field
        rf"^\s*{n}\s*[,({{]",  # a variant
        rf"^\s*{n}\s*:",  # a Python attribute or a struct field
    ]
    return any(re.search(p, code, re.M) for p in patterns)


def main() -> int:
    doc = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "ARCHITECTURE.md"
    code = sources()
    missing: list[str] = []
    checked = 0
    for token in sorted(set(re.findall(r"`([^`\s]+)`", doc.read_text()))):
        parts = re.split(r"::|\.", token)
        head = parts[0]
        if not re.fullmatch(r"[A-Z][a-z0-9]+[A-Za-z0-9]*", head) or head.isupper():
            continue  # not a type name (a path, a crate, a command, a constant like TICK)
        checked += 1
        if not declared_type(code, head):
            missing.append(f"{token}: no type {head}")
            continue
        for member in parts[1:]:
            if member and not declared_member(code, member):
                missing.append(f"{token}: no member {member}")
    for m in missing:
        print(f"check-architecture: {m}")
    print(f"check-architecture: {checked} names checked, {len(missing)} missing")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
