"""kvx as SGLang's HiCache storage backend (``--hicache-storage-backend dynamic``).

``KvxStorage`` puts the pages of SGLang's host cache in kvx's tiers (a host tier, a file tier on
local disk or a shared mount) with kvx's deadline on every call, a verdict per page and a
checksum on every block. See kvx-python/README.md, "SGLang".
"""

from kvx.sglang.storage import KvxStorage

__all__ = ["KvxStorage"]
