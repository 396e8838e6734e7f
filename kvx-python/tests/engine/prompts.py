"""The prompts the engine tests send, as token ids, made from fixed seeds: each scenario's set
is a few prompts spanning several 32-token blocks. Each length leaves the last block partial
and stays within its block count while the output is generated, so the blocks a run stores are
exactly the prompt's full blocks, and a second run of the prompt hits all of them."""

from __future__ import annotations

import numpy as np

BLOCK = 32
FIRST_TOKEN = 3  # 0, 1, 2: bos, eos, unk
VOCAB = 4096


def _make(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(FIRST_TOKEN, VOCAB, n)] for n in lengths]


# name: (prompts, output tokens)
SETS: dict[str, tuple[list[list[int]], int]] = {
    "host": (_make(11, [100, 140, 75]), 16),
    "preempt": (_make(12, [100, 101, 102, 103, 104, 105]), 60),
    "file": (_make(13, [140, 135, 110, 105]), 16),
    "frozen": (_make(14, [140, 135, 110, 105]), 16),
    "corrupt": (_make(15, [140, 135, 110, 105]), 16),
    "pd": (_make(16, [140, 100, 75]), 16),
    "serve": (_make(17, [140, 100, 75]), 16),
    "serve_late": (_make(19, [140, 100]), 16),
    "serve2": (_make(18, [135, 105, 70]), 16),
    "serve2_late": (_make(20, [135, 105]), 16),
    "capacity": (_make(21, [470, 450, 400, 370, 330, 300, 260, 230]), 8),
}


def prompts(name: str) -> list[list[int]]:
    return SETS[name][0]


def max_tokens(name: str) -> int:
    return SETS[name][1]


def full_blocks(prompt: list[int]) -> int:
    return len(prompt) // BLOCK


def blocks(*names: str) -> int:
    """Full blocks of every prompt of these sets: what running them stores."""
    return sum(full_blocks(p) for name in names for p in prompts(name))


def hit_tokens(name: str) -> int:
    """Tokens a connector holding every full block of the set's prompts supplies for them."""
    return sum(full_blocks(p) * BLOCK for p in prompts(name))
