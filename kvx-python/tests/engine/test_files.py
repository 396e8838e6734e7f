"""kvx's file tier under real engines, with a host tier of 16 blocks (a prompt set's stores fit,
a set is 14 blocks; three sets are stored), so most blocks live in files only.

A first engine ("files") stores three prompt sets behind a FUSE mount this test can freeze,
serves one set back from its files, then freezes the mount under the loads of another. Two
more engine processes start on copies of its file tier, made before anything was frozen: one
("second", policy ``recompute``) serves a set from the first engine's files, then loads a set
from files it corrupted; one ("fail", policy ``fail``) loads from corrupted files, its requests
end with an error, and the same prompts run right next."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import prompts
from engine import Engine, skip_or_fail
from quiet import QUIET

HOST_BLOCKS = 16
LOAD_MS = 2000
# Allowed beyond a generate's unfrozen time plus the load deadline: its forward passes are timed
# twice (both runs alone, quiet.py: beside another engine's a run took 2-4 times as long), and
# the frozen run also recomputes the prompts the unfrozen one loaded; 1 s plus half the unfrozen
# time covers that, and a load that waits for the stuck mount past its deadline still exceeds
# the bound by a whole deadline, 2 s.
MARGIN_S = 1.0
MARGIN_FRACTION = 0.5
STORED = ("file", "frozen", "corrupt")
STARTS_IN_A_ROW = 2


def _kvx(root: str, policy: str = "recompute") -> dict:
    return {
        "role": "kv_both",
        "policy": policy,
        "extra": {
            "host_blocks": HOST_BLOCKS,
            "timeouts": {"load_ms": LOAD_MS},
            "file": {"roots": [root], "blocks": 1024},
        },
    }


def _mount_unavailable() -> str | None:
    from kvx.testing import FrozenMount

    return FrozenMount.unavailable()


def _pairs(name: str) -> list[list[list[int]]]:
    p = prompts.prompts(name)
    return [p[:2], p[2:]]


def scenario(tmp: Path, model_dir: str) -> dict[str, Any]:
    out: dict[str, Any] = {"mount_unavailable": _mount_unavailable()}
    backing, mnt = tmp / "files-backing", tmp / "files-mnt"
    backing.mkdir()
    mnt.mkdir()
    frozen = out["mount_unavailable"] is None
    cfg: dict[str, Any] = {"model": model_dir}
    if frozen:
        cfg.update(kvx=_kvx(str(mnt)), mount={"mnt": str(mnt), "backing": str(backing)})
    else:
        cfg.update(kvx=_kvx(str(backing)))
    e = Engine("files", tmp, cfg)
    try:
        n = prompts.max_tokens("file")
        # Each set's stores end before the next set runs: a store job that finds the host
        # tier full is skipped (by design), which would make what is stored depend on timing.
        count = 0

        def stored_so_far(name: str) -> int:
            nonlocal count
            count += prompts.blocks(name)
            return int(e.send("wait_files", root=str(backing), count=count)["files"])

        out["file_first"] = e.generate(prompts.prompts("file"), n)
        stored_so_far("file")
        # The unfrozen and frozen runs of these pairs are timed against each other: alone.
        with QUIET.alone():
            out["frozen_unfrozen"] = [e.generate(p, n) for p in _pairs("frozen")]
        stored_so_far("frozen")
        out["corrupt_first"] = e.generate(prompts.prompts("corrupt"), n)
        out["stored_files"] = stored_so_far("corrupt")
        for copy in ("second", "fail"):
            e.send("copy", src=str(backing), dst=str(tmp / f"files-{copy}"))
        e.send("reset")
        out["file_again"] = e.generate(prompts.prompts("file"), n)
        if frozen:
            e.send("reset")
            with QUIET.alone():
                e.send("freeze")
                out["frozen_frozen"] = [e.generate(p, n) for p in _pairs("frozen")]
                e.send("thaw")
    finally:
        e.stop()

    def second() -> None:
        root = tmp / "files-second"
        s = Engine("second", tmp, {"model": model_dir, "kvx": _kvx(str(root))})
        try:
            out["second_file"] = s.generate(prompts.prompts("file"), n)
            out["second_corrupted"] = s.send("corrupt", root=str(root))["files"]
            out["second_corrupt"] = s.generate(prompts.prompts("corrupt"), n)
        finally:
            s.stop()

    def fail() -> None:
        root = tmp / "files-fail"
        f = Engine("fail", tmp, {"model": model_dir, "kvx": _kvx(str(root), "fail")})
        try:
            out["fail_corrupted"] = f.send("corrupt", root=str(root))["files"]
            out["fail_first"] = f.generate(prompts.prompts("corrupt"), n)
            out["fail_next"] = f.generate(prompts.prompts("corrupt"), n)
        finally:
            f.stop()

    errors: list[BaseException] = []

    def guarded(fn: Any) -> None:
        try:
            fn()
        except BaseException as ex:
            errors.append(ex)

    threads = [threading.Thread(target=guarded, args=(fn,)) for fn in (second, fail)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out


def test_file_tier_hits_with_a_small_host_tier(run: dict, reference: dict) -> None:
    """Three prompt sets (42 blocks) stored through a 16-block host tier: the first set comes
    back from the file tier, every full block of it, with the same tokens."""
    assert run["stored_files"] == prompts.blocks(*STORED)
    assert run["file_first"]["tokens"] == reference["file"]
    again = run["file_again"]
    assert again["tokens"] == reference["file"]
    c = again["counts"]
    want = prompts.hit_tokens("file")
    assert c["external_hits"] == want, c
    assert c.get("cached_disk", 0) == want, c


def test_frozen_mount_under_loads(run: dict, reference: dict) -> None:
    """The mount frozen while two generate() calls load from it: same tokens; each returns
    within its unfrozen time + the load deadline + the margin; the first waited out the
    deadline (its loads were stuck in the mount, which still holds them)."""
    if run["mount_unavailable"] is not None:
        skip_or_fail(f"frozen mount: {run['mount_unavailable']}")
    frozen, unfrozen = run["frozen_frozen"], run["frozen_unfrozen"]
    for i, (f, u) in enumerate(zip(frozen, unfrozen, strict=True)):
        assert f["tokens"] == reference["frozen"][2 * i : 2 * i + 2]
        bound = u["seconds"] + LOAD_MS / 1000 + MARGIN_S + MARGIN_FRACTION * u["seconds"]
        print(
            f"frozen generate {i}: {f['seconds']:.2f}s (unfrozen {u['seconds']:.2f}s, bound "
            f"{bound:.2f}s), {f['blocked']} requests blocked in the mount, hits {f['counts']}"
        )
        assert f["seconds"] <= bound, (f["seconds"], bound)
    first = frozen[0]
    assert first["counts"].get("cached_disk", 0) > 0, first["counts"]
    assert first["seconds"] >= LOAD_MS / 1000, first["seconds"]
    assert first["blocked"] > 0, first


def test_second_engine_reads_the_first_ones_files(run: dict, reference: dict) -> None:
    """A second engine process on the first one's file tier: every full block of a set the
    first stored is a hit from the files, with the same tokens."""
    r = run["second_file"]
    assert r["tokens"] == reference["file"]
    want = prompts.hit_tokens("file")
    assert r["counts"]["external_hits"] == want, r["counts"]
    assert r["counts"].get("cached_disk", 0) == want, r["counts"]


def test_corrupt_files_recompute(run: dict, reference: dict) -> None:
    """Every block file corrupted under a running engine (policy ``recompute``): the loads of a
    set from those files fail their checksum and the requests recompute: same tokens."""
    stored = prompts.blocks(*STORED)
    assert run["second_corrupted"] == stored
    r = run["second_corrupt"]
    assert r["counts"].get("cached_disk", 0) > 0, r["counts"]  # kvx planned loads from files
    assert r["finish"] == ["length"] * len(r["finish"]), r["finish"]
    assert r["tokens"] == reference["corrupt"]


def test_corrupt_files_fail(run: dict, reference: dict) -> None:
    """Policy ``fail``: the requests whose blocks come from corrupted files end with an error;
    the engine stays up, and the same prompts run right next (same tokens as no connector)."""
    stored = prompts.blocks(*STORED)
    assert run["fail_corrupted"] == stored
    first, nxt = run["fail_first"], run["fail_next"]
    assert first["counts"].get("cached_disk", 0) > 0, first["counts"]
    assert first["finish"] == ["error"] * len(first["finish"]), first["finish"]
    assert nxt["finish"] == ["length"] * len(nxt["finish"]), nxt["finish"]
    assert nxt["tokens"] == reference["corrupt"]
