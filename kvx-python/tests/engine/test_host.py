"""One engine with kvx's host tier (no file tier) and a small engine KV cache (20 blocks of 32
tokens): host-tier hits, preemption, and a reset of the connector. The phases run in this
order in one engine process; each test asserts on its phases."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import prompts
from engine import Engine

ENGINE_BLOCKS = 20


def scenario(tmp: Path, model_dir: str) -> dict[str, Any]:
    cfg = {
        "model": model_dir,
        "num_blocks": ENGINE_BLOCKS,
        "kvx": {"role": "kv_both", "policy": "recompute", "extra": {"host_blocks": 256}},
    }
    e = Engine("host", tmp, cfg)
    out: dict[str, Any] = {}
    try:

        def gen(key: str, name: str) -> None:
            out[key] = e.generate(prompts.prompts(name), prompts.max_tokens(name))

        gen("host_first", "host")
        assert e.send("reset")["reset"] is True  # vLLM's own prefix cache only
        gen("host_again", "host")
        gen("preempt_first", "preempt")
        assert e.send("reset")["reset"] is True
        gen("preempt_again", "preempt")
        out["reset_connector"] = e.send("reset", connector=True)
        gen("host_after_reset", "host")
    finally:
        e.stop()
    return out


def test_host_tier_hits(run: dict, reference: dict) -> None:
    """A prompt set run twice (vLLM's own prefix cache reset in between): the second run gets
    every full block of every prompt from kvx's host tier, and the same tokens."""
    first, again = run["host_first"], run["host_again"]
    assert first["tokens"] == reference["host"]
    assert first["counts"]["external_hits"] == 0, first["counts"]
    assert again["tokens"] == reference["host"]
    want = prompts.hit_tokens("host")
    c = again["counts"]
    assert c["external_hits"] == want, c
    assert c.get("cached_host", 0) == want and c.get("cached_disk", 0) == 0, c
    assert c["local_hits"] == 0, c


def test_preemption_same_tokens_with_hits(run: dict, reference: dict) -> None:
    """Six requests that outgrow a 20-block KV cache are preempted and resumed: same tokens,
    with and without their prompts in kvx; on the second run every prompt's full blocks are
    kvx hits, and requests resumed after a preemption load from kvx too (vLLM's scheduler
    counts those apart)."""
    first, again = run["preempt_first"], run["preempt_again"]
    assert first["tokens"] == reference["preempt"]
    assert again["tokens"] == reference["preempt"]
    assert first["counts"]["preemptions"] > 0 and again["counts"]["preemptions"] > 0, (
        first["counts"],
        again["counts"],
    )
    assert again["counts"]["external_hits"] == prompts.hit_tokens("preempt"), again["counts"]
    resumed = first["resumed_hits"] + again["resumed_hits"]
    print(
        f"preemptions {first['counts']['preemptions']:.0f} + {again['counts']['preemptions']:.0f}; "
        f"resumed requests {first['resumed_requests']} + {again['resumed_requests']} with "
        f"{first['resumed_hits']} + {again['resumed_hits']} kvx tokens"
    )
    assert resumed > 0, (first, again)


def test_reset_connector_serves_nothing_stored_before(run: dict, reference: dict) -> None:
    """``LLM.reset_prefix_cache(reset_connector=True)``: afterwards kvx serves none of the
    blocks it held before (no external hits for a prompt set stored before), same tokens."""
    assert run["reset_connector"]["reset"] is True, run["reset_connector"]
    after = run["host_after_reset"]
    assert after["tokens"] == reference["host"]
    assert after["counts"]["external_hits"] == 0, after["counts"]
