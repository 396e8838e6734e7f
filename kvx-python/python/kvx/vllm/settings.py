"""The connector's settings, read once per connector: vLLM's ``kv_connector_extra_config`` as
JSON (what kvx's native sides take) and every key kvx-offload reads from it, its defaults filled
in (``kvx._native.parse_config``: a bad or unknown key is a ``ValueError`` naming it)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kvx import _native


@dataclass(frozen=True)
class Settings:
    """``text``: the extra config as JSON; ``values``: every key, with kvx's defaults."""

    text: str
    values: dict[str, Any]

    @classmethod
    def parse(cls, text: str, block_size: int) -> Settings:
        """The settings of ``text`` (JSON) for vLLM's KV block size ``block_size``."""
        return cls(text, json.loads(_native.parse_config(text, block_size)))
