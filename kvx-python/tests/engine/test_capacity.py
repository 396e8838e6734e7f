"""The file tier as the capacity tier: a host tier at the smallest size the connector accepts
for the engine's batch (one prefill chunk of blocks: 256 tokens / 32 = 8 blocks) in front of a
file tier with room for all. Eight prompts run at once, their store jobs competing for the host
tier's few places, yet every full block of every prompt reaches the file tier, and the next
pass hits every one of them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import prompts
import settings
from engine import Engine

SET = "capacity"
# The connector's minimum: ceil(min(max_num_batched_tokens, max_model_len) / block_size).
HOST_BLOCKS = -(-min(settings.SHARED["max_num_batched_tokens"], settings.SHARED["max_model_len"]) // settings.BLOCK)


def scenario(tmp: Path, model_dir: str) -> dict[str, Any]:
    root = tmp / "capacity-files"
    root.mkdir()
    extra = {"host_blocks": HOST_BLOCKS, "file": {"roots": [str(root)], "blocks": 4096}}
    e = Engine("capacity", tmp, {"model": model_dir, "kvx": {"role": "kv_both", "policy": "recompute", "extra": extra}})
    try:
        n = prompts.max_tokens(SET)
        out: dict[str, Any] = {"first": e.generate(prompts.prompts(SET), n)}
        out["files"] = e.send("wait_files", root=str(root), count=prompts.blocks(SET))["files"]
        e.send("reset")  # vLLM's own prefix cache: the next pass's hits come from kvx
        out["again"] = e.generate(prompts.prompts(SET), n)
        return out
    finally:
        e.stop()


def test_every_full_block_reaches_the_file_tier_through_the_smallest_host_tier(run: dict, reference: dict) -> None:
    """Every full block of the eight prompts is a block file after the first pass, and every one
    is a hit of the second, mostly from the file tier, with the same tokens as no connector."""
    assert run["first"]["tokens"] == reference[SET]
    assert run["files"] == prompts.blocks(SET)
    again = run["again"]
    assert again["tokens"] == reference[SET]
    c = again["counts"]
    want = prompts.hit_tokens(SET)
    assert c["external_hits"] == want, c
    assert c.get("cached_disk", 0) >= want - HOST_BLOCKS * settings.BLOCK, c
