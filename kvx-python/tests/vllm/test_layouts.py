"""Every KV cache layout vLLM accepts, allocated by vLLM's own ``resolve_kv_cache_layout`` and
``allocate_kv_cache``: kvx registers each, serves prefix hits and reports load failures byte for
byte, and keeps blocks of different layouts apart (the layout is part of the key namespace)."""

from __future__ import annotations

import pytest
import vllm.config.cache as vllm_cache
from vllm.v1.attention.backends.utils import _DEFAULT_LAYOUT_PREFERENCE
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.request import RequestStatus

from kvx.vllm import KvxConnector
from kvx.vllm.compat import PREFERRED_LAYOUT, canonical_layout

from harness import BLOCK, HEAD, KV_HEADS, LAYERS, Engine, prompt

DONE = RequestStatus.FINISHED_LENGTH_CAPPED
# Every name vLLM's layout resolution accepts: the members and the legacy aliases.
NAMES = [m.name for m in KVCacheLayout] + sorted(getattr(vllm_cache, "_LAYOUT_COMPAT_ALIASES", {}))
PAGE = 2 * BLOCK * KV_HEADS * HEAD * 2  # bytes of one layer's block (K and V, float16)


def file_dir(tmp_path, name="files"):
    d = tmp_path / name
    d.mkdir(exist_ok=True)
    return d


def test_every_layout_name_is_covered():
    assert len(NAMES) >= 6, NAMES
    assert {canonical_layout(n) for n in NAMES} == {m.name for m in KVCacheLayout}


@pytest.mark.parametrize("name", NAMES)
def test_prefix_hit_in_every_layout(tmp_path, name):
    e = Engine(tmp_path, {"host_blocks": 32}, layouts=[name])
    try:
        assert e.layout == canonical_layout(name)
        native = e.worker._worker.native
        assert native.block_bytes() == LAYERS * PAGE
        if KVCacheLayout[e.layout].is_block_compact and KVCacheLayout[e.layout].is_block_outermost:
            # Every layer of a block in one run: one region, one copy per block.
            assert native.regions() == [(e.kv["layer0"].data_ptr(), LAYERS * PAGE, LAYERS * PAGE)]
        p = prompt(60, 4 * BLOCK + 6)
        e.add("a", p)
        e.run()
        before = {b: e.block_content(b) for b in range(1, e.num_blocks)}
        t = e.add("b", p)
        e.run()
        st = e.conn.stats()
        assert (st["host_hit_blocks"], st["hit_tokens"]) == (4, 4 * BLOCK)
        assert t.finished_status == DONE
        assert e.verified_blocks == 4  # b's 4 loaded blocks, byte for byte through the views
        assert e.invalid_reported == []
        # kvx wrote nothing outside the blocks vLLM gave b.
        assert len(t.load_blocks) == 1
        for b, content in before.items():
            if b not in t.blocks:
                assert e.block_content(b).equal(content), f"{e.layout}: engine block {b} changed"
        assert e.idle(), e.state()
    finally:
        e.close()


@pytest.mark.parametrize("name", [m.name for m in KVCacheLayout])
def test_load_failure_in_every_layout(tmp_path, name):
    d = file_dir(tmp_path)
    extra = {"host_blocks": 32, "file": {"roots": [str(d)], "blocks": 1024}}
    p = prompt(61, 5 * BLOCK + 1)
    e = Engine(tmp_path, extra, layouts=[name])
    try:
        e.add("writer", p)
        e.run()
        keys = e.keys_of("writer")
        path = e.worker._worker.native.file_block_path(keys[2 * 16 : 3 * 16])
    finally:
        e.close()
    raw = bytearray(path.read_bytes())
    raw[4096 + 100] ^= 0xFF
    path.write_bytes(bytes(raw))
    e = Engine(tmp_path, extra, layouts=[name])
    try:
        t = e.add("r", p)
        e.run()
        assert e.invalid_reported == [{t.load_blocks[0][2]}]  # exactly the corrupt block
        assert t.finished_status == DONE
        assert e.verified_blocks == 2  # blocks 0 and 1 loaded; 2.. recomputed and stored again
        e.add("again", p)
        e.run()
        assert e.verified_blocks == 2 + 5
        assert e.idle(), e.state()
    finally:
        e.close()


def test_a_block_stored_under_one_layout_is_a_miss_under_another(tmp_path):
    d = file_dir(tmp_path)
    extra = {"host_blocks": 32, "file": {"roots": [str(d)], "blocks": 1024}}
    p = prompt(62, 5 * BLOCK + 3)
    e = Engine(tmp_path, extra, layouts=["LBNHC"])
    try:
        e.add("w", p)
        e.run()
        stored = e.keys_of("w")
        assert e.worker._worker.native.file_blocks() == 5
    finally:
        e.close()
    # BLHNC: the same tokens, other bytes per block; nothing of LBNHC's may be offered.
    e = Engine(tmp_path, extra, layouts=["BLHNC"])
    try:
        t = e.add("r", p)
        e.run()
        assert set(stored[i : i + 16] for i in range(0, 80, 16)).isdisjoint(
            e.keys_of("r")[i : i + 16] for i in range(0, 80, 16)
        )
        st = e.conn.stats()
        assert (st["host_hit_blocks"], st["file_hit_blocks"], st["loads"]) == (0, 0, 0)
        assert t.finished_status == DONE and t.waits == []
    finally:
        e.close()
    # The legacy alias NHD is LBNHC: the same namespace, a hit from the file tier.
    e = Engine(tmp_path, extra, layouts=["NHD"])
    try:
        e.add("r", p)
        e.run()
        assert e.conn.stats()["file_hit_blocks"] == 5
        assert e.verified_blocks == 5
    finally:
        e.close()


def test_the_connector_states_a_block_outermost_layout(tmp_path):
    # Backends that accept any layout (vLLM's default preference order): kvx's preference wins.
    default = [m.name for m in _DEFAULT_LAYOUT_PREFERENCE]
    e = Engine(tmp_path, {"host_blocks": 16}, layouts=default)
    try:
        assert KvxConnector.get_required_kvcache_layout(e.vllm_config) == PREFERRED_LAYOUT
        assert e.layout == PREFERRED_LAYOUT != default[0]
        native = e.worker._worker.native
        assert native.regions() == [(e.kv["layer0"].data_ptr(), LAYERS * PAGE, LAYERS * PAGE)]
        p = prompt(63, 3 * BLOCK + 1)
        e.add("a", p)
        e.run()
        e.add("b", p)
        e.run()
        assert e.conn.stats()["host_hit_blocks"] == 3
        assert e.verified_blocks == 3
    finally:
        e.close()
    # Backends that support only LBHNC (vLLM's CPU attention): vLLM drops the preference.
    e = Engine(tmp_path, {"host_blocks": 16}, layouts=["LBHNC"])
    try:
        assert e.layout == "LBHNC"
        assert len(e.worker._worker.native.regions()) == LAYERS
    finally:
        e.close()
