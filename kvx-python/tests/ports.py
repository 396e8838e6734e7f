"""Ports for the servers the suite starts (``vllm serve``, a producer's kvx server), free when
chosen and bound by the server seconds later. Chosen below the kernel's ephemeral range, so no
socket the kernel numbers itself (a client connection, vLLM's own ``get_open_port`` in the
other scenario's engine) can take one in between; and never the same one twice in this run."""

from __future__ import annotations

import random
import socket
import threading

_LOCK = threading.Lock()
_GIVEN: set[int] = set()
_FIRST = 10_000


def _ephemeral_start() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768


def free_port() -> int:
    """A port of 127.0.0.1 nothing is bound to, below the ephemeral range, not handed out
    before in this process."""
    end = max(_ephemeral_start(), _FIRST + 1000)
    with _LOCK:
        for _ in range(1000):
            port = random.randrange(_FIRST, end)
            if port in _GIVEN:
                continue
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
            _GIVEN.add(port)
            return port
    raise RuntimeError(f"no free port in {_FIRST}..{end}")
