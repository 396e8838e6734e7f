"""``host_blocks`` and the batch: a host tier smaller than one store job is refused at
construction (it could never hold a whole job); one of exactly that size works, and in front of
a file tier it stores every block of many requests at once there."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvx.vllm.compat import check_host_blocks

from harness import BLOCK, Engine, prompt


@pytest.mark.parametrize("file_tier", [False, True])
def test_host_tier_smaller_than_one_store_job_is_refused(tmp_path, file_tier):
    # 128 tokens a step: one request computes up to 8 blocks in one step.
    extra: dict = {"host_blocks": 7}
    if file_tier:
        d = tmp_path / "files"
        d.mkdir()
        extra["file"] = {"roots": [str(d)], "blocks": 1024}
    with pytest.raises(ValueError) as e:
        Engine(tmp_path, extra, max_batched_tokens=128)
    msg = str(e.value)
    assert "host_blocks = 7" in msg and "at least 8" in msg and "max_num_batched_tokens 128" in msg, msg


def test_host_tier_of_exactly_one_store_job_stores_and_serves_it(tmp_path):
    e = Engine(tmp_path, {"host_blocks": 8}, max_batched_tokens=128)
    try:
        p = prompt(70, 8 * BLOCK + 3)  # the first step computes 8 full blocks: one 8-block job
        e.add("a", p)
        e.run()
        assert e.worker.stats()["host_blocks"] == 8
        e.add("b", p)
        e.run()
        assert e.conn.stats()["host_hit_blocks"] == 8
        assert e.verified_blocks == 8
    finally:
        e.close()


def test_a_host_tier_of_one_store_job_stores_every_block_of_many_requests_in_files(tmp_path):
    """Six requests at once through a host tier of exactly one store job (8 blocks) in front of
    a file tier with room for all: their jobs find the host tier's places taken by blocks still
    being stored, yet every full block reaches the file tier, none is skipped, and the next
    pass hits every one, byte-exact."""
    files = tmp_path / "files"
    files.mkdir()
    e = Engine(tmp_path, {"host_blocks": 8, "file": {"roots": [str(files)], "blocks": 1024}}, max_batched_tokens=128)
    try:
        prompts = [prompt(90 + i, (4 + i) * BLOCK + 3) for i in range(6)]
        full = sum(len(p) // BLOCK for p in prompts)
        for i, p in enumerate(prompts):
            e.add(f"a{i}", p)
        e.run()
        assert e.worker.stats()["file_blocks"] == full
        assert e.conn.stats().get("store_skipped_no_room", 0) == 0, e.conn.stats()
        for i, p in enumerate(prompts):
            e.add(f"b{i}", p)
        e.run()
        s = e.conn.stats()
        assert s["host_hit_blocks"] + s["file_hit_blocks"] == full, s
        assert e.verified_blocks == full
    finally:
        e.close()


def test_a_hybrid_store_job_holds_every_groups_blocks() -> None:
    # 128 tokens a step, 16-token blocks: 8 blocks of each full-attention group; a 32-token
    # sliding window keeps at most ceil(32 / 16) + 1 = 3 blocks of its group.
    vllm_config = SimpleNamespace(
        scheduler_config=SimpleNamespace(max_num_batched_tokens=128),
        model_config=SimpleNamespace(max_model_len=4096),
    )
    groups: list[tuple[int | None, int]] = [(None, 0), (32, 0), (32, 0)]
    check_host_blocks(14, 16, vllm_config, groups)
    with pytest.raises(ValueError) as e:
        check_host_blocks(13, 16, vllm_config, groups)
    assert "host_blocks = 13" in str(e.value) and "at least 14" in str(e.value), str(e.value)
    # One group: the job is one request's blocks of one step.
    check_host_blocks(8, 16, vllm_config)
    with pytest.raises(ValueError):
        check_host_blocks(7, 16, vllm_config)
