"""kvx's logger in a vLLM process. It is named under ``vllm`` so that its lines go through
vLLM's own handler, format and level (``VLLM_LOGGING_LEVEL``), beside vLLM's lines: vLLM gives
only its ``vllm`` logger a handler, so a logger outside it would show no INFO line at all."""

from __future__ import annotations

import logging

logger = logging.getLogger("vllm.kvx")
