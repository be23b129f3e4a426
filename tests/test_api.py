"""The public API in ``fp4forge/__init__.py``: typed functions, imported on first use, that give
what the library (and the CLI) give; checked against safetensors' own reader."""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path

import pytest
from safetensors import safe_open

import fp4forge
from fp4forge.errors import ConfigError

NAMES = ("open_checkpoint", "audit_checkpoint", "quantize_checkpoint", "calibrate_checkpoint", "byte_table",
         "diff_checkpoints", "measure_fidelity")


def test_every_name_is_a_typed_function_of_the_api_module() -> None:
    assert set(NAMES) <= set(fp4forge.__all__) and set(NAMES) <= set(dir(fp4forge))
    for name in NAMES:
        function = getattr(fp4forge, name)
        assert inspect.isfunction(function) and function.__module__ == "fp4forge.api", name
        signature = inspect.signature(function)
        assert signature.return_annotation is not inspect.Signature.empty, name
        assert all(p.annotation is not inspect.Parameter.empty for p in signature.parameters.values()), name
    with pytest.raises(AttributeError):
        fp4forge.no_such_function  # noqa: B018


def test_subpackages_do_not_shadow_the_functions() -> None:
    """Importing fp4forge.audit / .quantize / .calibrate rebinds those package attributes; the
    API's names must survive that."""
    for module in ("fp4forge.audit.engine", "fp4forge.quantize.export", "fp4forge.calibrate.run", "fp4forge.audit.diff"):
        importlib.import_module(module)
    assert all(inspect.isfunction(getattr(fp4forge, name)) for name in NAMES)


def safetensors_view(directory: Path) -> dict[str, int]:
    """{tensor name: stored bytes}, read by safetensors itself."""
    sizes = {}
    for shard in sorted(directory.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as fh:
            for name in fh.keys():
                sizes[name] = fh.get_tensor(name).nbytes
    return sizes


def test_open_bytes_audit_diff_on_the_tiny_model(tiny_laguna_dense_dir: Path) -> None:
    truth = safetensors_view(tiny_laguna_dense_dir)
    ckpt = fp4forge.open_checkpoint(tiny_laguna_dense_dir)
    assert sorted(info.name for _, info in ckpt.tensors()) == sorted(truth)
    table = fp4forge.byte_table(tiny_laguna_dense_dir)
    assert table.to_json()["total"]["bytes"] == sum(truth.values())
    report = fp4forge.audit_checkpoint(tiny_laguna_dense_dir)
    assert report.exit_code == 0 and report.summary["errors"] == 0
    same = fp4forge.diff_checkpoints(tiny_laguna_dense_dir, tiny_laguna_dense_dir)
    assert same.exit_code == 0 and same.summary["identical"] == len(truth) and same.summary["different"] == 0


def test_quantize_checks_its_options_and_writes_a_checkpoint(tiny_laguna_dense_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as refused:
        fp4forge.quantize_checkpoint(tiny_laguna_dense_dir, tmp_path / "bad", fp4forge.QuantizeJob("fp8", layout_format="gguf"))
    assert refused.value.option == "layout_format" and "--" not in refused.value.message
    assert not (tmp_path / "bad").exists()
    summary = fp4forge.quantize_checkpoint(tiny_laguna_dense_dir, tmp_path / "fp8", fp4forge.QuantizeJob("fp8", act_scales="constant:8")).export
    written = safetensors_view(tmp_path / "fp8")
    assert summary.tensors_written == len(written) and summary.layout_format == "compressed-tensors"
    assert fp4forge.audit_checkpoint(tmp_path / "fp8").summary["errors"] == 0


def test_the_read_only_jobs_take_one_options_object_checked_when_made(tiny_laguna_dense_dir: Path) -> None:
    """audit, bytes and diff take their options as the command line makes them; a bad value is
    refused when the options are made, naming the keyword, before any checkpoint is read."""
    report = fp4forge.audit_checkpoint(tiny_laguna_dense_dir, fp4forge.AuditOptions(deep=True, vllm_version="0.31"))
    assert report.to_json()["audit"] == {**report.to_json()["audit"], "deep": True, "vllm_version": "0.31", "format": "auto"}
    for make, option in ((lambda: fp4forge.AuditOptions(fmt="gguf"), "fmt"), (lambda: fp4forge.AuditOptions(vllm_version="zero"), "vllm_version"),
                         (lambda: fp4forge.ByteTableOptions(layout="no-such-layout"), "layout")):
        with pytest.raises(fp4forge.errors.Fp4forgeError) as refused:
            make()
        assert refused.value.option == option
    named = fp4forge.byte_table(tiny_laguna_dense_dir, fp4forge.ByteTableOptions(layout=fp4forge.byte_table(tiny_laguna_dense_dir).layout))
    assert named.to_json() == fp4forge.byte_table(tiny_laguna_dense_dir).to_json()
