"""Ports for the servers the tests start (``vllm serve``, a producer's kvx server, torch's
rendezvous), free when chosen and bound by the server later, often seconds later. Chosen below
the kernel's ephemeral range, so no socket the kernel numbers itself (a client connection,
vLLM's own ``get_open_port`` in another engine) can take one in between; and never the same
one twice in this process."""

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


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(n: int = 1) -> int:
    """A port of 127.0.0.1 with the ``n - 1`` after it (tensor-parallel rank r listens on
    port + r), nothing bound to any of them, below the ephemeral range, none handed out before
    in this process."""
    end = max(_ephemeral_start(), _FIRST + 1000) - n
    with _LOCK:
        for _ in range(1000):
            port = random.randrange(_FIRST, end)
            ports = range(port, port + n)
            if any(p in _GIVEN for p in ports) or not all(_bindable(p) for p in ports):
                continue
            _GIVEN.update(ports)
            return port
    raise RuntimeError(f"no {n} free ports in {_FIRST}..{end}")
