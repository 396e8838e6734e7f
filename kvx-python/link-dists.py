"""Hard-link, from one venv's site-packages into another's, the distributions pip would install.

    python link-dists.py SEED_SITE TARGET_SITE REPORT

REPORT is the JSON of `pip install --dry-run --report` for the target venv's requirements.
engine-venv.sh runs this before the real install: every distribution of the report that the
seed holds at the very version pip chose (the CUDA libraries torch links are most of the bytes)
is then installed already, and pip neither downloads nor writes it. Only files inside
site-packages are linked (a console script in bin/ names its own venv's interpreter). Nothing
is linked, and the reason is printed, when the two folders are on different filesystems.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import re
import sys
from pathlib import Path


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def link(dist: md.Distribution, seed: Path, target: Path) -> int:
    linked = 0
    for file in dist.files or []:
        source = Path(str(file.locate())).resolve()
        try:
            relative = source.relative_to(seed)
        except ValueError:
            continue
        destination = target / relative
        if destination.exists() or not source.is_file():
            continue
        destination.parent.mkdir(parents=True, exist_ok=True)
        os.link(source, destination)
        linked += 1
    return linked


def main() -> int:
    seed, target = Path(sys.argv[1]).resolve(), Path(sys.argv[2]).resolve()
    with open(sys.argv[3]) as report:
        install = json.load(report)["install"]
    chosen = {canonical(item["metadata"]["name"]): item["metadata"]["version"] for item in install}
    if seed.stat().st_dev != target.stat().st_dev:
        print(f"link-dists.py: {seed} and {target} are on different filesystems: nothing linked", file=sys.stderr)
        return 0
    held = [d for d in md.distributions(path=[str(seed)]) if chosen.get(canonical(d.metadata["Name"])) == d.version]
    files = sum(link(dist, seed, target) for dist in held)
    linked = f"{len(held)} of {len(chosen)} distributions ({files} files)"
    print(f"link-dists.py: {linked} linked from {seed}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
