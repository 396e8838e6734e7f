"""kvx's host tier with ``host_loads_in_step`` (what a CPU engine is configured with): a hit
wholly in the host tier loads before the forward of the step that schedules its request. The
same prompt sets and small engine KV cache as test_host.py (whose engine keeps the default,
asynchronous loads): same tokens, every full block a kvx hit, preemption included."""

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
        "kvx": {"role": "kv_both", "policy": "recompute",
                "extra": {"host_blocks": 256, "host_loads_in_step": True}},
    }
    e = Engine("host-in-step", tmp, cfg)
    out: dict[str, Any] = {}
    try:
        for name in ("host", "preempt"):
            out[f"{name}_first"] = e.generate(prompts.prompts(name), prompts.max_tokens(name))
            assert e.send("reset")["reset"] is True  # vLLM's own prefix cache only
            out[f"{name}_again"] = e.generate(prompts.prompts(name), prompts.max_tokens(name))
    finally:
        e.stop()
    return out


def test_host_tier_hits_in_step_same_tokens(run: dict, reference: dict) -> None:
    """Each prompt set run twice (vLLM's own prefix cache reset in between): the second run
    gets every full block of every prompt from kvx's host tier, loaded in step, and the same
    tokens as without kvx; the preempted and resumed requests too."""
    for name in ("host", "preempt"):
        first, again = run[f"{name}_first"], run[f"{name}_again"]
        assert first["tokens"] == reference[name], name
        assert again["tokens"] == reference[name], name
        c = again["counts"]
        assert c["external_hits"] == prompts.hit_tokens(name), (name, c)
        assert c.get("cached_host", 0) == prompts.hit_tokens(name) and c.get("cached_disk", 0) == 0, (name, c)
    assert run["preempt_first"]["counts"]["preemptions"] > 0, run["preempt_first"]["counts"]
