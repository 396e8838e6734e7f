"""Bad extra configs and words their error must name, for the unit and the vLLM tests."""

BAD_EXTRA = [
    ({"host_blocks": 8, "hots_blocks": 8}, ["unknown field", "hots_blocks"]),
    ({"host_blocks": "8"}, ["host_blocks", "invalid type", '"8"']),
    ({"host_blocks": 0}, ["host_blocks", "must be"]),
    ({"host_blocks": True}, ["host_blocks", "invalid type"]),
    ({"timeouts": {"load_ms": -5}}, ["timeouts.load_ms", "-5"]),
    ({"timeouts": {"store_ms": 1.5}}, ["timeouts.store_ms", "1.5"]),
    ({"file": {"roots": ["/tmp"], "blocks": 8, "io_engine": "aio"}}, ["file.io_engine", "`uring` or `psync`", "aio"]),
    ({"eviction": "fifo"}, ["eviction", "`lru` or `arc`", "fifo"]),
    ({"file": {"roots": "/tmp", "blocks": 8}}, ["file.roots", "sequence"]),
    ({"file": {"roots": [], "blocks": 8}}, ["file.roots", "names no directory"]),
    (
        {"file": {"roots": ["/nonexistent/kvx-dir"], "blocks": 8}},
        ["file.roots", "/nonexistent/kvx-dir", "does not exist"],
    ),
    ({"block_tokens": 32}, ["block_tokens", "vLLM's KV block size"]),
    ({"load_failure": "fail"}, ["load_failure", "kv_load_failure_policy"]),
    ({"file": {"roots": ["/tmp"], "blocks": 8, "shared": {}}}, ["file.shared", "no shared mount"]),
    ({"remote": {"heartbeat_ms": 600000}}, ["remote.heartbeat_ms", "below remote.lease_ttl_ms"]),
    ({"remote": {"listen": "127.0.0.1:0"}}, ["remote.listen", "fixed port"]),
    ({"remote": {"listen": "kvx-p:7400"}}, ["remote.listen", "socket address"]),
    ({"remote": {"lease_ttl": 5}}, ["unknown field", "lease_ttl"]),
]
