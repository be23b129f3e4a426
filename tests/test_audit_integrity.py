"""`fp4forge audit`, integrity rules: each defect is planted in a copy of the real tiny Laguna
testbed (3 shards + index, as save_pretrained wrote it) and must give exactly its finding.
Hostile inputs must give an error finding or exit 2, never a crash, never a read outside the
checkpoint. The helpers here are shared by the other audit test modules."""

from __future__ import annotations

import builtins
import json
import os
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from fp4forge.audit.engine import audit_checkpoint
from fp4forge.audit.options import AuditOptions
from fp4forge.audit.findings import AuditReport
from fp4forge.checkpoint.reader import open_checkpoint
from fp4forge.checkpoint.names import INDEX_JSON
from fp4forge.checkpoint.writer import CheckpointWriter, TensorSpec
from fp4forge.errors import Fp4forgeError

TORCH_TO_SAFETENSORS = {
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float32: "F32",
    torch.uint8: "U8",
    torch.float8_e4m3fn: "F8_E4M3",
}
TINY_SHARD_BYTES = 6 * 10**6  # what the testbed uses: three shards and an index
# Findings a clean tiny Laguna always has under the default target vLLM 0.32.
LAGUNA_BASELINE = {"serving-blind-spot"}


# -- helpers shared by the audit tests ----------------------------------------------------------
def copy_checkpoint(src: Path, dst: Path) -> Path:
    """A private copy to plant one defect in. Files are made readable by all: llm-compressor writes
    its exports owner-only (its own finding, tested once on the raw export), which would otherwise
    add a warning to every planted-defect test built on them."""
    shutil.copytree(src, dst)
    for path in dst.rglob("*"):
        if path.is_file():
            path.chmod(path.stat().st_mode | 0o444)
    return dst


def load_tensors(path: Path) -> dict[str, torch.Tensor]:
    ckpt = open_checkpoint(path)
    return {info.name: ckpt.read_tensor(info.name).clone() for _, info in ckpt.tensors()}


def rebuild(src: Path, dst: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> Path:
    """Rewrite a checkpoint with tensors added, removed, renamed or changed by ``edit``; every
    other file (config, tokenizer, hf_quant_config.json) is copied; the index is regenerated."""
    tensors = load_tensors(src)
    edit(tensors)
    sharded = (src / INDEX_JSON).exists()
    specs = [TensorSpec(name, TORCH_TO_SAFETENSORS[t.dtype], tuple(t.shape)) for name, t in tensors.items()]
    with CheckpointWriter(dst, specs, max_shard_bytes=TINY_SHARD_BYTES if sharded else 2**40) as writer:
        for name, tensor in tensors.items():
            writer.write(name, tensor.contiguous())
        for path in sorted(src.iterdir()):
            if path.is_file() and not path.name.endswith(".safetensors") and path.name != INDEX_JSON:
                writer.copy_file(path)
    return dst


def patch_json(path: Path, edit: Callable[[dict], None]) -> None:
    doc = json.loads(path.read_text())
    edit(doc)
    path.write_text(json.dumps(doc, indent=2))


def audit(path: Path | str, **kwargs) -> AuditReport:
    return audit_checkpoint(str(path), AuditOptions(**kwargs))


def rules(report: AuditReport, severity: str | None = None) -> set[str]:
    return {f.rule for f in report.findings if severity is None or f.severity == severity}


def finding(report: AuditReport, rule: str):
    matches = [f for f in report.findings if f.rule == rule]
    assert matches, f"no {rule} finding; got {sorted(rules(report))}"
    return matches[0]


def assert_exactly(report: AuditReport, *errors: str, warnings: set[str] = frozenset(), baseline: set[str] = LAGUNA_BASELINE) -> None:
    """The planted defect's rules are the only errors; warnings are the baseline plus ``warnings``."""
    assert rules(report, "error") == set(errors), [f.message for f in report.findings if f.severity == "error"]
    assert rules(report, "warning") <= set(baseline) | set(warnings) | set(errors)
    assert set(warnings) <= rules(report, "warning")


def shard_names(path: Path) -> list[str]:
    return sorted(set(json.loads((path / INDEX_JSON).read_text())["weight_map"].values()))


# -- fixtures -----------------------------------------------------------------------------------
@pytest.fixture()
def tiny(lc_source_dir: Path, tmp_path: Path) -> Path:
    """A private copy of the BF16 tiny Laguna, free to damage."""
    return copy_checkpoint(lc_source_dir, tmp_path / "tiny")


# -- clean ------------------------------------------------------------------------------------------
def test_clean_testbed_passes(lc_source_dir: Path) -> None:
    report = audit(lc_source_dir)
    assert report.exit_code == 0 and rules(report, "error") == set()
    assert rules(report) <= LAGUNA_BASELINE | {"names-not-checked"}


def test_owner_only_files_are_a_warning(tiny: Path) -> None:
    shard = tiny / shard_names(tiny)[0]
    shard.chmod(0o600)
    report = audit(tiny)
    assert_exactly(report, warnings={"file-not-world-readable"})
    owner_only = finding(report, "file-not-world-readable")
    assert owner_only.count == 1 and owner_only.file == shard.name and "(mode 0600)" in owner_only.message


@pytest.mark.slow  # needs the llm-compressor venv (make test creates it)
def test_llm_compressor_export_is_owner_only(lc_nvfp4_kv_dir: Path) -> None:
    # measured: llm-compressor writes its shards with mode 0600; a server running as another user
    # cannot read the checkpoint once a mode-preserving copy brings it there
    shards = [p for p in lc_nvfp4_kv_dir.iterdir() if p.suffix == ".safetensors"]
    assert shards and all(p.stat().st_mode & 0o777 == 0o600 for p in shards)
    assert "file-not-world-readable" in rules(audit(lc_nvfp4_kv_dir), "warning")


# -- shards ------------------------------------------------------------------------------------
def test_invalid_header_utf8(tiny: Path) -> None:
    shard = tiny / shard_names(tiny)[1]
    data = bytearray(shard.read_bytes())
    data[10] = 0xFF  # inside the JSON header: no longer UTF-8
    shard.write_bytes(bytes(data))
    report = audit(tiny)
    assert_exactly(report, "shard-header-invalid")  # its tensors' absence is the same root cause, said once
    assert "follow from it (parameter-missing" in finding(report, "shard-header-invalid").message
    assert "UTF-8" in finding(report, "shard-header-invalid").message
    assert finding(report, "shard-header-invalid").file == shard.name


def test_size_mismatch_trailing_and_truncated(tiny: Path) -> None:
    first, second = (tiny / name for name in shard_names(tiny)[:2])
    with open(first, "ab") as fh:
        fh.write(b"\0" * 17)
    os.truncate(second, second.stat().st_size - 5)
    report = audit(tiny)
    assert_exactly(report, "shard-size-mismatch")  # its tensors' absence is the same root cause, said once
    assert "follow from it (parameter-missing" in finding(report, "shard-size-mismatch").message
    size = finding(report, "shard-size-mismatch")
    assert size.count == 2 and "trailing" in size.message and "truncated" in size.message


def test_lfs_pointer_in_place_of_a_shard(tiny: Path) -> None:
    shard = tiny / shard_names(tiny)[0]
    shard.write_text("version https://git-lfs.github.com/spec/v1\noid sha256:" + "ab" * 32 + "\nsize 5379400\n")
    report = audit(tiny)
    assert_exactly(report, "shard-lfs-pointer")  # its tensors' absence is the same root cause, said once
    assert "follow from it (parameter-missing" in finding(report, "shard-lfs-pointer").message
    assert "5,379,400 bytes" in finding(report, "shard-lfs-pointer").message


def test_missing_shard(tiny: Path) -> None:
    (tiny / shard_names(tiny)[2]).unlink()
    report = audit(tiny)
    assert_exactly(report, "shard-missing")  # its tensors' absence is the same root cause, said once
    assert "follow from it (parameter-missing" in finding(report, "shard-missing").message


def test_symlinked_shard_outside_the_checkpoint_is_not_followed(tiny: Path, tmp_path: Path, monkeypatch) -> None:
    name = shard_names(tiny)[0]
    outside = tmp_path / "outside.safetensors"
    shutil.move(tiny / name, outside)
    os.symlink(outside, tiny / name)
    opened = _record_opens(monkeypatch)
    report = audit(tiny)
    assert_exactly(report, "shard-unreadable")  # its tensors' absence is the same root cause, said once
    assert "follow from it (parameter-missing" in finding(report, "shard-unreadable").message
    assert not [p for p in opened if Path(p).resolve() == outside.resolve()]


def _record_opens(monkeypatch) -> list[str]:
    opened: list[str] = []
    real_open = builtins.open

    def spy(file, *args, **kwargs):
        opened.append(str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", spy)
    return opened


# -- index ------------------------------------------------------------------------------------------
def test_traversal_and_absolute_paths_in_weight_map(tiny: Path, tmp_path: Path, monkeypatch) -> None:
    outside = tmp_path / "evil.safetensors"
    shutil.copy(tiny / shard_names(tiny)[0], outside)
    patch_json(tiny / INDEX_JSON, lambda d: d["weight_map"].update({"model.norm.weight": "../evil.safetensors", "lm_head.weight": "/etc/passwd"}))
    opened = _record_opens(monkeypatch)
    report = audit(tiny)
    unsafe = finding(report, "index-unsafe-path")
    assert unsafe.count == 2 and set(unsafe.tensors) == {"model.norm.weight", "lm_head.weight"}
    # The two tensors still sit in their shards: unlisted there; nothing outside was opened.
    assert_exactly(report, "index-unsafe-path", "index-tensor-unlisted")
    assert not [p for p in opened if "evil" in p or p.startswith("/etc")]


def test_weight_map_entry_its_shard_lacks(tiny: Path) -> None:
    patch_json(tiny / INDEX_JSON, lambda d: d["weight_map"].update({"model.layers.0.mlp.extra.weight": shard_names(tiny)[0]}))
    report = audit(tiny)
    assert_exactly(report, "index-tensor-not-in-shard")
    assert finding(report, "index-tensor-not-in-shard").tensors == ["model.layers.0.mlp.extra.weight"]


def test_tensor_missing_from_weight_map(tiny: Path) -> None:
    patch_json(tiny / INDEX_JSON, lambda d: d["weight_map"].pop("model.layers.2.self_attn.q_norm.weight"))
    report = audit(tiny)
    assert_exactly(report, "index-tensor-unlisted")


def test_a_name_renamed_in_weight_map_is_both_unlisted_and_missing(tiny: Path) -> None:
    # Same number of entries as stored tensors, so only a per-name comparison can see it.
    def rename(d: dict) -> None:
        d["weight_map"]["model.layers.2.self_attn.q_norm.weights"] = d["weight_map"].pop("model.layers.2.self_attn.q_norm.weight")

    patch_json(tiny / INDEX_JSON, rename)
    report = audit(tiny)
    assert_exactly(report, "index-tensor-unlisted", "index-tensor-not-in-shard")
    assert finding(report, "index-tensor-unlisted").tensors == ["model.layers.2.self_attn.q_norm.weight"]
    assert finding(report, "index-tensor-not-in-shard").tensors == ["model.layers.2.self_attn.q_norm.weights"]


def test_total_size_mismatch_is_a_warning(tiny: Path) -> None:
    patch_json(tiny / INDEX_JSON, lambda d: d["metadata"].update(total_size=d["metadata"]["total_size"] + 2))
    report = audit(tiny)
    assert_exactly(report, warnings={"index-total-size"})
    assert report.exit_code == 0


def test_stray_safetensors_file(tiny: Path) -> None:
    with CheckpointWriter(tiny.parent / "kv", [TensorSpec("model.layers.0.self_attn.k_scale", "BF16", (1,))]) as writer:
        writer.write("model.layers.0.self_attn.k_scale", torch.ones(1, dtype=torch.bfloat16))
    shutil.move(tiny.parent / "kv" / "model.safetensors", tiny / "model-kvscales.safetensors")
    report = audit(tiny)
    assert_exactly(report, "shard-unreferenced")
    assert finding(report, "shard-unreferenced").file == "model-kvscales.safetensors"


def test_same_tensor_in_two_shards(tiny: Path) -> None:
    norm = load_tensors(tiny)["model.norm.weight"]
    with CheckpointWriter(tiny.parent / "extra", [TensorSpec("model.norm.weight", "BF16", tuple(norm.shape))]) as writer:
        writer.write("model.norm.weight", norm)
    shutil.move(tiny.parent / "extra" / "model.safetensors", tiny / "model-extra.safetensors")
    patch_json(tiny / INDEX_JSON, lambda d: d["weight_map"].update({"model.norm.weight": "model-extra.safetensors"}))
    report = audit(tiny)
    assert_exactly(report, "tensor-duplicate")
    assert "model-extra.safetensors" in finding(report, "tensor-duplicate").message


def test_index_that_is_not_json_cannot_be_audited(tiny: Path) -> None:
    (tiny / INDEX_JSON).write_text("version https://git-lfs.github.com/spec/v1\noid sha256:" + "cd" * 32 + "\nsize 17618\n")
    with pytest.raises(Fp4forgeError, match="git-LFS pointer"):
        audit(tiny)


# -- config -----------------------------------------------------------------------------------------
def test_config_missing(tiny: Path) -> None:
    (tiny / "config.json").unlink()
    report = audit(tiny)
    assert_exactly(report, "config-missing", baseline=set())


def test_unknown_architecture(tiny: Path) -> None:
    patch_json(tiny / "config.json", lambda d: d.update(architectures=["FooForCausalLM"], model_type="foo"))
    report = audit(tiny)
    assert_exactly(report, warnings={"architecture-unknown"}, baseline=set())
    assert "names-not-checked" in rules(report, "info")


# -- values (--deep) --------------------------------------------------------------------------------
def test_deep_finds_nan_and_zero_weights(tiny: Path, tmp_path: Path) -> None:
    def plant(tensors: dict[str, torch.Tensor]) -> None:
        tensors["model.layers.1.mlp.experts.3.up_proj.weight"][5, 7] = float("nan")
        tensors["model.layers.2.self_attn.o_proj.weight"][0, 0] = float("inf")
        tensors["model.layers.3.mlp.shared_expert.down_proj.weight"].zero_()

    damaged = rebuild(tiny, tmp_path / "damaged", plant)
    assert rules(audit(damaged), "error") == set()  # values are only read with --deep
    report = audit(damaged, deep=True)
    assert_exactly(report, "weight-not-finite", warnings={"weight-all-zero"})
    assert finding(report, "weight-not-finite").count == 2
    assert finding(report, "weight-all-zero").tensors == ["model.layers.3.mlp.shared_expert.down_proj.weight"]


# -- hostile single-file inputs ---------------------------------------------------------------------
def _single_file(tmp_path: Path, tiny: Path, payload: bytes) -> Path:
    out = tmp_path / "hostile"
    out.mkdir()
    shutil.copy(tiny / "config.json", out / "config.json")
    (out / "model.safetensors").write_bytes(payload)
    return out


def _header(doc: dict) -> bytes:
    body = json.dumps(doc).encode()
    return struct.pack("<Q", len(body)) + body


HOSTILE_PAYLOADS = {
    "length past the end": struct.pack("<Q", 1000) + b"{}" + b" " * 20,
    "length over 100 MB": struct.pack("<Q", 200_000_000) + b"{}",
    "invalid utf-8": struct.pack("<Q", 4) + b"{\xff\xfe}",
    "overlapping offsets": _header({"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}, "b": {"dtype": "U8", "shape": [4], "data_offsets": [2, 6]}}) + b"\0" * 6,
    "shorter than the prefix": b"\x01\x02",
    "not an object": _header([1, 2, 3]),  # type: ignore[dict-item]
}


@pytest.mark.parametrize("case", sorted(HOSTILE_PAYLOADS))
def test_hostile_shard_gives_an_error_finding(case: str, tiny: Path, tmp_path: Path) -> None:
    report = audit(_single_file(tmp_path, tiny, HOSTILE_PAYLOADS[case]))
    assert "shard-header-invalid" in rules(report, "error")
    assert report.exit_code == 1
