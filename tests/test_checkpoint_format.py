"""The safetensors engine against the reference implementation (the `safetensors` library)
and against hostile inputs: every malformed file gives a named error, never a crash."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from fp4forge.checkpoint.reader import open_checkpoint
from fp4forge.checkpoint.safetensors_format import DTYPE_BITS, parse_header
from fp4forge.checkpoint.source import LocalSource
from fp4forge.checkpoint.writer import CheckpointWriter, TensorSpec
from fp4forge.errors import (
    CheckpointError,
    DtypeError,
    HeaderError,
    IndexFileError,
    LfsPointerError,
    OffsetError,
    WriteError,
)

TORCH_TO_ST = {
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float32: "F32",
    torch.uint8: "U8",
    torch.int64: "I64",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.float8_e8m0fnu: "F8_E8M0",
}


def sample_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "model.layers.0.mlp.experts.3.up_proj.weight_packed": torch.randint(0, 255, (8, 16), dtype=torch.uint8, generator=g),
        "model.layers.0.mlp.experts.3.up_proj.weight_scale": torch.randn(8, 2, generator=g).to(torch.float8_e4m3fn),
        "model.layers.0.mlp.experts.3.up_proj.weight_global_scale": torch.tensor([1234.5]),
        "model.embed_tokens.weight": torch.randn(10, 32, generator=g).to(torch.bfloat16),
        "a.half": torch.randn(3, generator=g).to(torch.float16),
        "b.e5m2": torch.randn(4, generator=g).to(torch.float8_e5m2),
        "c.e8m0": torch.rand(4, generator=g).to(torch.float8_e8m0fnu),
        "d.scalar": torch.tensor(3.0),
        "e.empty": torch.zeros(0, 4, dtype=torch.int64),
    }


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def write_with_fp4forge(path: Path, tensors: dict[str, torch.Tensor], **kw) -> Path:
    specs = [TensorSpec(n, TORCH_TO_ST[t.dtype], tuple(t.shape)) for n, t in tensors.items()]
    with CheckpointWriter(path, specs, **kw) as writer:
        for name, tensor in reversed(list(tensors.items())):  # any order
            writer.write(name, tensor)
    return path


def test_single_shard_is_byte_identical_to_safetensors_save_file(tmp_path):
    tensors = sample_tensors()
    save_file(tensors, tmp_path / "ref.safetensors", metadata={"format": "pt"})
    write_with_fp4forge(tmp_path / "ours", tensors)
    assert (tmp_path / "ours" / "model.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()


def test_sharded_output_reads_back_with_safetensors_and_index_is_consistent(tmp_path):
    tensors = sample_tensors()
    out = write_with_fp4forge(tmp_path / "ckpt", tensors, max_shard_bytes=300)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    seen = {}
    for shard in shards:
        with safe_open(out / shard, framework="pt") as fh:
            for name in fh.keys():
                seen[name] = fh.get_tensor(name)
                assert index["weight_map"][name] == shard
    assert set(seen) == set(tensors)
    for name, tensor in tensors.items():
        assert same_bits(seen[name], tensor)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())


def test_reader_matches_safetensors_headers_and_values(tmp_path):
    tensors = sample_tensors()
    out = write_with_fp4forge(tmp_path / "ckpt", tensors, max_shard_bytes=300)
    ckpt = open_checkpoint(out)
    for shard in ckpt.shard_names:
        with safe_open(out / shard, framework="pt") as fh:
            header = ckpt.headers[shard]
            assert set(header.tensors) == set(fh.keys())
            for name in fh.keys():
                ref = fh.get_slice(name)
                assert header.tensors[name].dtype == ref.get_dtype()
                assert list(header.tensors[name].shape) == list(ref.get_shape())
                ours = ckpt.read_tensor(name)
                assert same_bits(ours, tensors[name])


def test_every_safetensors_dtype_is_known():
    # Dtypes the reference library can write from torch must all parse.
    for dtype in ("BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0", "I16", "U16", "F16", "BF16", "I32", "U32", "F32", "F64", "I64", "U64", "F4"):
        assert dtype in DTYPE_BITS


def test_f4_dtype_counts_logical_elements():
    header = json.dumps({"w": {"dtype": "F4", "shape": [4, 32], "data_offsets": [0, 64]}}).encode()
    parsed = parse_header(header, source="x")
    assert parsed.tensors["w"].numel == 128 and parsed.tensors["w"].nbytes == 64


# -- hostile inputs ---------------------------------------------------------------------------
def raw_file(path: Path, header: bytes, data: bytes = b"", length: int | None = None) -> Path:
    path.write_bytes(struct.pack("<Q", len(header) if length is None else length) + header + data)
    return path


def entry(dtype="F32", shape=(2,), offsets=(0, 8)):
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


HOSTILE = {
    "too_short": (lambda p: p.write_bytes(b"\x01\x02"), HeaderError, "shorter than the 8-byte"),
    "length_past_file": (lambda p: raw_file(p, b"{}", length=10_000), HeaderError, "runs past the end"),
    "length_over_100mb": (lambda p: raw_file(p, b"{}", length=150_000_000), HeaderError, "exceeds"),
    "invalid_utf8": (lambda p: raw_file(p, b'{"\xff\xfe": 1}'), HeaderError, "UTF-8"),
    "bad_json": (lambda p: raw_file(p, b'{"a": '), HeaderError, "not valid JSON"),
    "not_object": (lambda p: raw_file(p, b"[1, 2]"), HeaderError, "not an object"),
    "unknown_dtype": (lambda p: raw_file(p, json.dumps({"a": entry(dtype="F7")}).encode(), b"\0" * 8), DtypeError, "unknown dtype"),
    "overlap": (
        lambda p: raw_file(p, json.dumps({"a": entry(offsets=(0, 8)), "b": entry(offsets=(4, 12))}).encode(), b"\0" * 12),
        OffsetError,
        None,
    ),
    "hole": (lambda p: raw_file(p, json.dumps({"a": entry(offsets=(8, 16))}).encode(), b"\0" * 16), OffsetError, "hole"),
    "size_mismatch": (lambda p: raw_file(p, json.dumps({"a": entry(offsets=(0, 12))}).encode(), b"\0" * 12), OffsetError, "needs 8"),
    "truncated_data": (lambda p: raw_file(p, json.dumps({"a": entry()}).encode(), b"\0" * 5), CheckpointError, "truncated"),
    "trailing_bytes": (lambda p: raw_file(p, json.dumps({"a": entry()}).encode(), b"\0" * 9), CheckpointError, "trailing"),
    "duplicate_key": (lambda p: raw_file(p, b'{"a": ' + json.dumps(entry()).encode() + b', "a": ' + json.dumps(entry()).encode() + b"}", b"\0" * 8), HeaderError, "duplicate"),
    "metadata_not_strings": (lambda p: raw_file(p, json.dumps({"__metadata__": {"x": 1}}).encode()), HeaderError, "__metadata__"),
    "extra_field": (lambda p: raw_file(p, json.dumps({"a": {**entry(), "x": 1}}).encode(), b"\0" * 8), HeaderError, "exactly"),
    "negative_dim": (lambda p: raw_file(p, json.dumps({"a": entry(shape=(-2,))}).encode(), b"\0" * 8), HeaderError, "non-negative"),
    "lfs_pointer": (
        lambda p: p.write_bytes(b"version https://git-lfs.github.com/spec/v1\noid sha256:" + b"a" * 64 + b"\nsize 12345\n"),
        LfsPointerError,
        "real size 12345 bytes",
    ),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_shard_gives_named_error(tmp_path, case):
    make, error_type, fragment = HOSTILE[case]
    path = tmp_path / "model.safetensors"
    make(path)
    with pytest.raises(error_type) as info:
        LocalSource(tmp_path).read_header("model.safetensors")
    assert str(path) in str(info.value)
    if fragment:
        assert fragment in str(info.value)


@pytest.mark.parametrize("case", ["length_over_100mb", "invalid_utf8", "overlap", "lfs_pointer", "truncated_data"])
def test_hostile_shard_cli_exit_2_with_message_not_traceback(tmp_path, case):
    make, _, _ = HOSTILE[case]
    make(tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LagunaForCausalLM"]}))
    proc = subprocess.run([sys.executable, "-m", "fp4forge.cli", "bytes", str(tmp_path)], capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.startswith("error:") and "Traceback" not in proc.stderr


@pytest.mark.parametrize("bad", ["../outside.safetensors", "/etc/passwd", "a/../../b.safetensors"])
def test_index_with_traversal_or_absolute_paths_is_refused(tmp_path, bad):
    write_with_fp4forge(tmp_path / "ckpt", {"x": torch.zeros(2)})
    (tmp_path / "ckpt" / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {"x": bad}}))
    with pytest.raises(IndexFileError):
        open_checkpoint(tmp_path / "ckpt")


def test_symlinked_shard_pointing_outside_is_refused(tmp_path):
    outside = write_with_fp4forge(tmp_path / "elsewhere", {"x": torch.zeros(2)}) / "model.safetensors"
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "model.safetensors").symlink_to(outside)
    with pytest.raises(CheckpointError, match="outside the checkpoint"):
        open_checkpoint(ckpt)


def test_missing_shard_referenced_by_index(tmp_path):
    out = write_with_fp4forge(tmp_path / "ckpt", sample_tensors(), max_shard_bytes=300)
    (out / "model-00001-of-00002.safetensors").unlink() if (out / "model-00001-of-00002.safetensors").exists() else next(out.glob("model-00001-*")).unlink()
    with pytest.raises(CheckpointError, match="missing"):
        open_checkpoint(out)
    lenient = open_checkpoint(out, strict=False)
    assert len(lenient.shard_errors) == 1


# -- writer atomicity ------------------------------------------------------------------------
def test_writer_leaves_nothing_when_interrupted(tmp_path):
    specs = [TensorSpec("a", "F32", (4,)), TensorSpec("b", "F32", (4,))]
    with pytest.raises(KeyboardInterrupt):
        with CheckpointWriter(tmp_path / "out", specs) as writer:
            writer.write("a", torch.zeros(4))
            raise KeyboardInterrupt
    assert list(tmp_path.iterdir()) == []


def test_writer_refuses_unwritten_wrong_sized_and_undeclared_tensors(tmp_path):
    specs = [TensorSpec("a", "F32", (4,)), TensorSpec("b", "F32", (4,))]
    with pytest.raises(WriteError, match="never written"):
        with CheckpointWriter(tmp_path / "out", specs) as writer:
            writer.write("a", torch.zeros(4))
    with pytest.raises(WriteError, match="needs 16"):
        with CheckpointWriter(tmp_path / "out", specs) as writer:
            writer.write("a", torch.zeros(3))
    with pytest.raises(WriteError, match="not declared"):
        with CheckpointWriter(tmp_path / "out", specs) as writer:
            writer.write("c", torch.zeros(4))
    assert list(tmp_path.iterdir()) == []


def test_writer_refuses_non_empty_destination(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("precious")
    with pytest.raises(WriteError, match="not empty"):
        with CheckpointWriter(tmp_path / "out", [TensorSpec("a", "F32", (1,))]) as writer:
            writer.write("a", torch.zeros(1))
    assert (tmp_path / "out" / "keep.txt").read_text() == "precious"


def test_sparse_writer_makes_valid_headers_with_holes(tmp_path):
    specs = [TensorSpec(f"t{i}", "BF16", (1024, 1024)) for i in range(4)]
    with CheckpointWriter(tmp_path / "out", specs, max_shard_bytes=2 * 2**21, sparse=True):
        pass
    ckpt = open_checkpoint(tmp_path / "out")  # strict: declared end == file size
    assert len(ckpt.shard_names) == 2
    for shard in ckpt.shard_names:
        stat = (tmp_path / "out" / shard).stat()
        assert stat.st_blocks * 512 < stat.st_size  # holes, not data
