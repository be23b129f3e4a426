"""Coalesced reads (checkpoint.ranges): tensors' byte ranges merged into runs per shard, runs cut
into requests, and the bytes read equal to safetensors' own load of the same tensors."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from fp4forge.checkpoint import ranges
from fp4forge.checkpoint.ranges import ByteRun, Extent, coalesce, split_run
from fp4forge.checkpoint.reader import open_checkpoint
from fp4forge.checkpoint.source import LocalSource
from fp4forge.errors import CheckpointError, ConfigError


def test_coalesce_merges_small_gaps_per_shard_in_file_order() -> None:
    extents = [
        Extent("c", "b.safetensors", 300, 400),
        Extent("x", "a.safetensors", 1000, 1100),  # gap 900 after "b": over max_gap -> new run
        Extent("b", "a.safetensors", 40, 100),  # gap 40 after "a": merged
        Extent("a", "a.safetensors", 0, 0),  # empty tensor at the start
        Extent("a2", "a.safetensors", 0, 0),
        Extent("d", "b.safetensors", 400, 500),  # adjacent to "c"
    ]
    runs = coalesce(extents, max_gap=64)
    assert [(r.shard, r.start, r.end, [e.key for e in r.extents]) for r in runs] == [
        ("a.safetensors", 0, 100, ["a", "a2", "b"]),
        ("a.safetensors", 1000, 1100, ["x"]),
        ("b.safetensors", 300, 500, ["c", "d"]),
    ]
    # a gap of exactly max_gap still merges, one byte more does not
    assert len(coalesce([Extent(1, "s", 0, 10), Extent(2, "s", 74, 80)], max_gap=64)) == 1
    assert len(coalesce([Extent(1, "s", 0, 10), Extent(2, "s", 75, 80)], max_gap=64)) == 2
    assert len(coalesce([Extent(1, "s", 0, 10), Extent(2, "s", 10, 20)], max_gap=0)) == 1


def test_coalesce_refuses_overlaps_and_bad_ranges() -> None:
    with pytest.raises(CheckpointError, match="overlap"):
        coalesce([Extent("a", "s", 0, 100), Extent("b", "s", 50, 150)])
    with pytest.raises(CheckpointError, match="overlap"):
        coalesce([Extent("a", "s", 0, 100), Extent("a", "s", 0, 100)])  # one tensor asked for twice
    with pytest.raises(CheckpointError, match="no byte range"):
        coalesce([Extent("a", "s", 10, 5)])


def test_split_run_cuts_requests_and_straddles_tensors() -> None:
    run = ByteRun("s", 100, 400, (Extent("a", "s", 100, 230), Extent("b", "s", 250, 400)))
    requests = split_run(run, request_bytes=100)
    assert [(r.offset, r.nbytes) for r in requests] == [(100, 100), (200, 100), (300, 100)]
    assert [r.targets for r in requests] == [
        (("a", 0, 100),),
        (("a", 100, 30), (None, 0, 20), ("b", 0, 50)),
        (("b", 50, 100),),
    ]
    assert [r.keys for r in requests] == [["a"], ["a", "b"], ["b"]]
    # one request for the whole run when it is large enough; lengths always add up to the run
    (whole,) = split_run(run, request_bytes=1 << 20)
    assert (whole.offset, whole.nbytes, sum(n for _, _, n in whole.targets)) == (100, 300, 300)
    with pytest.raises(ConfigError):
        split_run(run, request_bytes=0)


def _write_shards(root: Path) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    first = {
        "layer.0.a": torch.randn(33, 17, generator=g).to(torch.bfloat16),
        "layer.0.b": torch.randn(5, generator=g),  # F32
        "layer.0.c": torch.randint(-100, 100, (7, 3), generator=g, dtype=torch.int8),
        "layer.0.d": torch.randn(64, 48, generator=g).to(torch.float16),
        "layer.0.e": torch.empty(0, 4, dtype=torch.bfloat16),
    }
    second = {f"layer.1.w{i}": torch.randn(40 + i, 24, generator=g).to(torch.bfloat16) for i in range(6)}
    root.mkdir()
    save_file(first, str(root / "model-00001-of-00002.safetensors"))
    save_file(second, str(root / "model-00002-of-00002.safetensors"))
    return {**first, **second}


@pytest.mark.parametrize("request_bytes,max_gap", [(1 << 20, 1 << 20), (1000, 1 << 20), (333, 0), (7, 16)])
def test_coalesced_reads_equal_safetensors_load(tmp_path: Path, request_bytes: int, max_gap: int) -> None:
    tensors = _write_shards(tmp_path / "ck")
    ckpt = open_checkpoint(tmp_path / "ck")
    wanted = ["layer.1.w4", "layer.0.a", "layer.0.d", "layer.1.w0", "layer.1.w1", "layer.1.w2", "layer.0.e"]  # gaps: b, c, w3, w5
    outs = {name: torch.full_like(tensors[name], 7) for name in wanted}  # poisoned: every byte must be written
    buffers = {name: memoryview(out.reshape(-1).view(torch.uint8).numpy()) for name, out in outs.items()}
    assert ranges.read_into(ckpt, buffers, request_bytes=request_bytes, max_gap=max_gap)
    for path in sorted((tmp_path / "ck").glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as fh:
            for name in fh.keys():
                if name in outs:
                    assert torch.equal(outs.pop(name), fh.get_tensor(name)), name
    assert outs == {}
    requests = ranges.plan_reads(ckpt, wanted, request_bytes=request_bytes, max_gap=max_gap)
    if request_bytes == max_gap == 1 << 20:  # the small gaps are bridged: one run, one request per shard
        assert [r.shard for r in requests] == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert all(r.nbytes <= request_bytes for r in requests)


def test_coalesced_reads_survive_short_reads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel may fill fewer bytes than asked (signals, some file systems): the rest is read."""
    tensors = _write_shards(tmp_path / "ck")
    ckpt = open_checkpoint(tmp_path / "ck")
    plain = os.preadv
    calls = []

    def short(fd, views, offset):
        calls.append(offset)
        budget, clipped = 29, []
        for view in views:  # at most 29 bytes per call, split inside a buffer too
            if budget == 0:
                break
            clipped.append(view[: min(budget, view.nbytes)])
            budget -= clipped[-1].nbytes
        return plain(fd, clipped, offset)

    monkeypatch.setattr(os, "preadv", short)
    out = torch.zeros_like(tensors["layer.1.w2"])
    assert ranges.read_into(ckpt, {"layer.1.w2": memoryview(out.reshape(-1).view(torch.uint8).numpy())})
    assert torch.equal(out, tensors["layer.1.w2"]) and len(calls) > 10


def test_reads_that_cannot_be_plain_file_reads(tmp_path: Path) -> None:
    tensors = _write_shards(tmp_path / "ck")
    ckpt = open_checkpoint(tmp_path / "ck")
    out = torch.zeros_like(tensors["layer.0.a"])
    with pytest.raises(CheckpointError, match="buffer of"):  # the wrong size is refused before any read
        ranges.read_into(ckpt, {"layer.0.a": memoryview(out[:-1].reshape(-1).view(torch.uint8).numpy())})

    class Converting(type(ckpt)):
        def reads_as_stored(self, name: str) -> bool:
            return name != "layer.0.a"

    converting = Converting(ckpt.source, ckpt.shard_names, ckpt.headers, ckpt.index, ckpt.config)
    assert ranges.plan_reads(converting, ["layer.0.d", "layer.0.a"]) is None
    assert ranges.plan_reads(converting, ["layer.0.d"]) is not None

    class NoFiles:  # an HTTP source has no scatter read
        pass

    ckpt.source = NoFiles()
    assert ranges.plan_reads(ckpt, ["layer.0.a"]) is None
    assert not ranges.read_into(ckpt, {"layer.0.a": memoryview(out.reshape(-1).view(torch.uint8).numpy())})


def test_scatter_read_past_the_end_is_a_named_error(tmp_path: Path) -> None:
    (tmp_path / "f.bin").write_bytes(bytes(range(100)))
    source = LocalSource(tmp_path)
    first, second = bytearray(60), bytearray(30)
    source.read_scatter("f.bin", 5, [memoryview(first), memoryview(second)])
    assert bytes(first + second) == bytes(range(5, 95))
    with pytest.raises(CheckpointError, match="10 bytes early"):
        source.read_scatter("f.bin", 20, [memoryview(bytearray(90))])
