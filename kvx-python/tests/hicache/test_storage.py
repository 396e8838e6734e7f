"""kvx as SGLang's HiCache storage backend, built by SGLang's own factory over SGLang's real
host pools on CPU: pages round-trip byte-exact through the host and file tiers in every MHA
layout, a fresh backend reads the files another one wrote, the namespace keeps other dtypes,
page sizes and ranks apart, a corrupt file fails its page (SGLang recomputes it), a frozen FUSE
mount costs one deadline and never blocks SGLang's I/O thread past it, SGLang's own fault
wrapper never gets wrong bytes, and no call raises into SGLang."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch

from kvx.testing import frozen_mount

from pools import (
    LAYOUTS,
    PAGE,
    backend,
    file_tier,
    host_pool,
    indices,
    mla_host_pool,
    page_bytes,
    storage_config,
)

# kvx's page store returns by its deadline plus a margin of 500 ms (PageStore::MARGIN); the
# tests hold it to one tick plus 50 ms, the bound of "on time" here.
ON_TIME_S = 0.051


def keys(n: int, prefix: str = "p") -> list[str]:
    return [f"{prefix}{i:04d}" for i in range(n)]


def stored(host: Any, first_page: int, n: int) -> list[torch.Tensor]:
    return [page_bytes(host, first_page + i) for i in range(n)]


def holds(host: Any, first_page: int, expect: list[torch.Tensor]) -> bool:
    return all(torch.equal(page_bytes(host, first_page + i), e) for i, e in enumerate(expect))


def block_files(root: Path) -> list[Path]:
    return sorted(root.rglob("*.kvb"))


@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_pages_round_trip_through_both_tiers_and_into_a_fresh_backend(tmp_path: Path, layout: str, mla: bool) -> None:
    root = tmp_path / "kvx"
    config = storage_config(file_tier(root, host_blocks=4), mla=mla)
    pool = mla_host_pool if mla else host_pool
    host = pool(layout)
    b = backend(config, host)
    ks = keys(8)
    expect = stored(host, 0, 8)
    assert b.batch_set_v1(ks, indices(0, 8)) == [True] * 8
    assert b.batch_exists([*ks, "absent"]) == 8
    assert b.batch_exists(["absent", *ks]) == 0
    # The host tier holds 4 blocks: this load mixes host- and file-tier hits.
    assert b.batch_get_v1(ks, indices(10, 8)) == [True] * 8
    assert holds(host, 10, expect)
    stats = b.kvx_stats()
    assert sum(stats["loaded_blocks"].values()) == 8, stats
    metrics = b.get_stats()
    assert metrics.prefetch_pgs == [8] and metrics.backup_pgs == [8]
    b.close()
    assert len(block_files(root)) == 8

    # A fresh backend (a restarted server) over another pool of the same shape: file hits.
    host2 = pool(layout)
    b2 = backend(config, host2)
    assert b2.batch_exists(ks) == 8
    assert b2.batch_get_v1(ks[:5], indices(3, 5)) == [True] * 5
    assert holds(host2, 3, expect[:5])
    b2.close()


def test_namespace_keeps_dtypes_page_sizes_models_and_ranks_apart(tmp_path: Path) -> None:
    root = tmp_path / "kvx"
    host = host_pool()
    b = backend(storage_config(file_tier(root)), host)
    ks = keys(4)
    assert b.batch_set_v1(ks, indices(0, 4)) == [True] * 4
    b.close()
    others = [
        (storage_config(file_tier(root)), host_pool(dtype=torch.float16)),
        (storage_config(file_tier(root)), host_pool(page=8)),
        (storage_config(file_tier(root), model="another-model"), host_pool()),
        (storage_config(file_tier(root), tp_rank=1, tp_size=2), host_pool()),
    ]
    for config, pool in others:
        other = backend(config, pool)
        assert other.batch_exists(ks) == 0
        assert other.batch_get_v1(ks, indices(0, 4, pool.page_size)) == [False] * 4
        other.close()
    same = backend(storage_config(file_tier(root)), host_pool())
    assert same.batch_exists(ks) == 4
    same.close()


def test_a_corrupt_file_fails_its_page_and_a_later_store_repairs_it(tmp_path: Path) -> None:
    root = tmp_path / "kvx"
    config = storage_config(file_tier(root))
    host = host_pool()
    b = backend(config, host)
    ks = keys(6)
    expect = stored(host, 0, 6)
    assert b.batch_set_v1(ks, indices(0, 6)) == [True] * 6
    name = b._keys([ks[2]]).hex()
    b.close()
    (path,) = [p for p in block_files(root) if p.name.startswith(name)]
    data = bytearray(path.read_bytes())
    data[4096 + 10] ^= 0xFF  # a payload byte, past the header's 4 KiB
    path.write_bytes(bytes(data))

    host2 = host_pool()
    b2 = backend(config, host2)
    got = b2.batch_get_v1(ks, indices(20, 6))
    # SGLang's prefetch ends at the first False: pages 0 and 1 count, page 2 is recomputed.
    assert got == [True, True, False, True, True, True]
    assert holds(host2, 20, expect[:2])
    failed = b2.kvx_stats()["load_failed_blocks"]
    assert sum(sum(r.values()) for r in failed.values()) == 1, failed
    # The corrupt block is forgotten (and its file removed); SGLang's next backup stores it.
    assert b2.batch_exists(ks) == 2
    assert b2.batch_set_v1([ks[2]], indices(2, 1)) == [True]
    assert b2.batch_exists(ks) == 6
    b2.close()


def test_a_frozen_mount_ends_each_call_by_its_deadline(tmp_path: Path) -> None:
    load_ms = 300
    with frozen_mount(tmp_path, "frozen-mount test") as (mount, mnt):
        kvx = file_tier(mnt, timeouts={"load_ms": load_ms, "store_ms": load_ms})
        kvx["file"]["breaker"] = {
            "failure_threshold": 3,
            "window_ms": 10000,
            "cool_down_ms": 300,
            "probe_deadline_ms": 300,
        }
        config = storage_config(kvx)
        host = host_pool()
        b = backend(config, host)
        ks = keys(6)
        expect = stored(host, 0, 6)
        assert b.batch_set_v1(ks, indices(0, 6)) == [True] * 6
        b.close()

        host2 = host_pool()
        b2 = backend(config, host2)
        mount.freeze()
        took = []
        for _ in range(3):
            t0 = time.monotonic()
            got = b2.batch_get_v1(ks, indices(10, 6))
            took.append(time.monotonic() - t0)
            assert got == [False] * 6
        t0 = time.monotonic()
        assert b2.batch_exists(ks) == 6  # the index answers; no file is touched
        fresh = keys(2, "fresh")
        assert b2.batch_set_v1(fresh, indices(30, 2)) == [True, True]  # the host tier takes it
        took.append(time.monotonic() - t0)
        print(f"frozen mount: calls took {[round(t, 4) for t in took]} s (load deadline {load_ms} ms)")
        for t in took[:3]:
            assert t <= load_ms / 1000 + ON_TIME_S
        assert took[3] <= ON_TIME_S
        mount.thaw()
        deadline = time.monotonic() + 20
        while b2.batch_get_v1(ks, indices(20, 6)) != [True] * 6:
            assert time.monotonic() < deadline, "loads resume after the thaw"
            time.sleep(0.1)
        assert holds(host2, 20, expect)
        b2.close()


def test_sglangs_fault_wrapper_never_gets_wrong_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageFailureInjector

    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE", "0.3")
    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_DELAY", "0.002")
    host = host_pool()
    b = backend(storage_config(file_tier(tmp_path / "kvx")), host)
    assert isinstance(b, HiCacheStorageFailureInjector)
    verdicts = {True: 0, False: 0}
    for r in range(12):
        ks = keys(4, f"r{r}-")
        expect = stored(host, 0, 4)
        set_ok = b.batch_set_v1(ks, indices(0, 4))
        got = b.batch_get_v1(ks, indices(20, 4))
        for i, ok in enumerate(got):
            verdicts[ok] += 1
            if ok:
                assert set_ok[i], "a page never stored cannot load"
                assert torch.equal(page_bytes(host, 20 + i), expect[i])
        host.kv_buffer[:, :].copy_(torch.randn(host.kv_buffer.shape).to(host.kv_buffer.dtype))
    assert verdicts[True] > 0 and verdicts[False] > 0, verdicts
    b.close()


def test_bad_config_is_refused_by_name(tmp_path: Path) -> None:
    host = host_pool()
    no_v1 = storage_config(file_tier(tmp_path / "a"), interface_v1=0)
    with pytest.raises(Exception, match="interface_v1"):
        backend(no_v1, host)
    with pytest.raises(ValueError, match="block_tokens"):
        backend(storage_config({"block_tokens": 4}), host)
    with pytest.raises(ValueError, match="host_blok"):
        backend(storage_config({"host_blok": 4}), host)
    with pytest.raises(ValueError, match=r"timeouts"):
        backend(storage_config({"timeouts": 5}), host)


def test_no_call_raises_into_sglang(tmp_path: Path) -> None:
    host = host_pool()
    b = backend(storage_config(file_tier(tmp_path / "kvx")), host)
    ks = keys(2)
    # Host indices that are not two whole pages: refused, not guessed.
    assert b.batch_set_v1(ks, indices(0, 1)) == [False, False]
    assert b.batch_set_v1(ks, torch.arange(1, 1 + 2 * PAGE)) == [False, False]
    # Beyond the pool.
    far = host.size // PAGE + 4
    assert b.batch_get_v1(ks, indices(far, 2)) == [False, False]
    # The legacy copying calls hand kvx memory it was not given: refused.
    assert b.get(ks[0], torch.zeros(8)) is None
    assert b.set(ks[0], torch.zeros(8)) is False
    assert b.exists(ks[0]) is False
    b.close()
    assert b.batch_exists(ks) == 0
    assert b.batch_get_v1(ks, indices(0, 2)) == [False, False]
    assert b.batch_set_v1(ks, indices(0, 2)) == [False, False]
    b.clear()
