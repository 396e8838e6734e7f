"""Bad input is a clear error at construction, naming the problem — never a crash in a step."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch

from kvx import KvxError, WorkerSide

from cases import BAD_EXTRA
from harness import BLOCK, HEAD, KV_HEADS, LAYERS, Engine, prompt


@pytest.mark.parametrize("extra, words", BAD_EXTRA)
def test_bad_extra_config_fails_at_construction(tmp_path, extra, words):
    with pytest.raises(ValueError) as e:
        Engine(tmp_path, extra)
    for w in words:
        assert w in str(e.value), str(e.value)


def test_read_only_file_dir_fails_at_construction(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ro)], capture_output=True, check=False)
    if r.returncode != 0:
        reason = f"cannot mount a read-only tmpfs here: {r.stderr.decode().strip()}"
        print(f"skip: test_read_only_file_dir_fails_at_construction: {reason}")
        pytest.skip(reason)
    extra = {"host_blocks": 8, "file": {"roots": [str(ro)], "blocks": 16, "io_engine": "psync"}}
    try:
        with pytest.raises(ValueError) as e:
            Engine(tmp_path, extra)
        assert "file tier" in str(e.value) and str(ro) in str(e.value), str(e.value)
        # The native worker side checks for itself too (the store's write probe), naming the root.
        with pytest.raises(ValueError) as e:
            t = torch.zeros((2, 8, BLOCK, KV_HEADS, HEAD), dtype=torch.float16)
            WorkerSide(
                json.dumps(extra), BLOCK, [("layer0", t.data_ptr(), list(t.shape), list(t.stride()), 2, "cpu")], [t], 8
            )
        assert str(ro) in str(e.value)
    finally:
        subprocess.run(["umount", str(ro)], check=True)


def layers(make):
    return {f"layer{i}": make() for i in range(LAYERS)}


@pytest.mark.parametrize(
    "make, words",
    [
        # No dimension holds the blocks (vLLM's num_blocks is 64 here).
        (
            lambda: torch.zeros((2, 63, BLOCK, KV_HEADS, HEAD), dtype=torch.float16),
            ["no dimension of size num_blocks=64"],
        ),
        # Two dimensions over the same bytes (a broadcast): no block is a set of runs.
        (
            lambda: torch.zeros((2, 64, BLOCK, 1, HEAD), dtype=torch.float16).expand(2, 64, BLOCK, KV_HEADS, HEAD),
            ["overlaps", "layer0"],
        ),
        (
            lambda: torch.zeros((2, 64, BLOCK, KV_HEADS, HEAD), dtype=torch.float16, device="meta"),
            ["unsupported device", "meta"],
        ),
    ],
)
def test_undescribable_tensor_layout_fails_at_registration(tmp_path, make, words):
    with pytest.raises(ValueError) as e:
        Engine(tmp_path, {"host_blocks": 8}, kv_caches=layers(make))
    for w in words:
        assert w in str(e.value), str(e.value)


def test_cross_layer_tensor_is_one_contiguous_region_and_round_trips(tmp_path):
    e = Engine(tmp_path, {"host_blocks": 16}, cross_layer=True)
    try:
        native = e.worker._worker.native
        block_bytes = LAYERS * 2 * BLOCK * KV_HEADS * HEAD * 2
        assert native.block_bytes() == block_bytes
        (base, stride, seg), = native.regions()
        assert (base, stride, seg) == (e.kv["layer0"].data_ptr(), block_bytes, block_bytes)
        p = prompt(40, 3 * BLOCK + 1)
        e.add("a", p)
        e.run()
        e.add("b", p)
        e.run()
        assert e.conn.stats()["host_hit_blocks"] == 3
        assert e.verified_blocks == 3
    finally:
        e.close()


def test_per_layer_tensors_are_strided_regions_in_layer_then_kv_order(tmp_path):
    e = Engine(tmp_path, {"host_blocks": 8})
    try:
        regions = e.worker._worker.native.regions()
        seg = BLOCK * KV_HEADS * HEAD * 2
        want = []
        for i in range(LAYERS):
            t = e.kv[f"layer{i}"]
            for plane in range(2):
                want.append((t[plane].data_ptr(), seg, seg))
        assert regions == want
    finally:
        e.close()


def test_connector_worker_does_not_swallow_a_bad_step(tmp_path):
    from kvx.vllm import KvxConnectorMetadata

    e = Engine(tmp_path, {"host_blocks": 8})
    try:
        with pytest.raises(KvxError) as err:
            e.worker.handle_preemptions(KvxConnectorMetadata(b"\x07"))
        assert "encoding version 7" in str(err.value)
    finally:
        e.close()
