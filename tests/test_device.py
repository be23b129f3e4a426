"""`--device` and the device-side layer streamer on a CPU-only machine: the read-ahead runner and
the activation tiers change no statistic, a GPU asked for where there is none (or a device name
that does not exist) is a named error with exit 2, and `--device cpu` runs every command."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import typer
from typer.testing import CliRunner

from fp4forge.calibrate import CalibrationOptions, calibrate_checkpoint, calibration_samples
from fp4forge.checkpoint.reader import open_checkpoint
from fp4forge.errors import ConfigError, ExitCode
from fp4forge.model.device import resolve_device
from fp4forge.model.streaming import ActivationStore, SpillSpace
from tests.calibration_fixtures import one_thread, tiny  # noqa: F401 (shared fixtures)


@pytest.fixture(scope="module")
def tiny_laguna(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny(tmp_path_factory, "laguna")  # the session's one tiny Laguna, shared with the calibration tests

SMALL = dict(samples=6, seq_len=96, batch_size=2)


def _equal_stats(a, b) -> None:
    assert a.tensors.keys() == b.tensors.keys()
    assert [n for n in a.tensors if not torch.equal(a.tensors[n], b.tensors[n])] == []
    for key in ("tokens_per_expert", "experts_without_tokens", "data"):
        assert a.metadata[key] == b.metadata[key]


def test_read_ahead_and_activation_tiers_leave_statistics_unchanged(tiny_laguna: Path) -> None:
    ckpt = open_checkpoint(tiny_laguna)
    plain = CalibrationOptions(**SMALL, device="cpu", prefetch=False)
    samples = calibration_samples(ckpt, plain)
    reference = calibrate_checkpoint(ckpt, plain, samples=samples)
    assert reference.device == "cpu" and reference.host_batches == 0 and reference.spilled_batches == 0

    # Read ahead, and a device budget of one byte: every batch of activations goes on to RAM.
    tiers = calibrate_checkpoint(ckpt, CalibrationOptions(**SMALL, device="cpu", prefetch=True, activation_budget_bytes=1), samples=samples)
    assert tiers.host_batches > 0 and tiers.spilled_batches == 0
    _equal_stats(tiers, reference)
    to_disk = calibrate_checkpoint(ckpt, CalibrationOptions(**SMALL, device="cpu", activation_budget_bytes=1, ram_budget_bytes=1), samples=samples)
    assert to_disk.host_batches > 0 and to_disk.spilled_batches > 0
    _equal_stats(to_disk, reference)


def test_activation_store_tiers_round_trip(tmp_path: Path) -> None:
    space = SpillSpace(ram_budget_bytes=64, spill_dir=tmp_path, device="cpu", activation_budget_bytes=64)
    store = ActivationStore(space, "x")
    values = [torch.randn(4, 4, generator=torch.Generator().manual_seed(i)) for i in range(3)]  # 64 bytes each
    for i, v in enumerate(values):
        store.put(i, v)
    assert (space.device_used_bytes, space.used_bytes, space.host_batches, space.spilled_batches) == (64, 64, 2, 1)
    assert all(torch.equal(store.get(i), v) for i, v in enumerate(values))
    store.clear()
    assert (space.device_used_bytes, space.used_bytes) == (0, 0)
    space.close()


def test_device_names(monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    for bad in ("tpu", "cuda:x", ""):
        with pytest.raises(ConfigError) as caught:
            resolve_device(bad)
        assert caught.value.option == "device"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device(None) == torch.device("cpu") and resolve_device("auto") == torch.device("cpu")
    with pytest.raises(ConfigError, match="sees none") as caught:
        resolve_device("cuda")
    assert caught.value.option == "device"
    from fp4forge.pipeline import PipelineOptions

    from fp4forge.cli.pipeline import _pipeline_options

    flags = dict(recipe="nvfp4-experts", layout_format="compressed-tensors", block_scales="minmax", calib_samples=4, calib_seq_len=32,
                 calib_text=[], fidelity_samples=2, fidelity_seq_len=32, fidelity_text=[], fidelity_numerics="w4a4", fidelity_builtin=True, fidelity_allow_unreadable=True, tokenizer=None,
                 activation_budget="5", vllm_venv=None, serve=False, bench=None, perf_workload=None, quality_runs=2, quality_max_tokens=8,
                 quality_categories=None)
    options = _pipeline_options(**flags, device="cpu")
    assert isinstance(options, PipelineOptions)
    assert (options.calibration.device, options.calibration.activation_budget_bytes) == ("cpu", 5)
    assert (options.fidelity.device, options.quantize.device) == ("cpu", "cpu")
    with pytest.raises(ConfigError) as caught:
        _pipeline_options(**flags, device="cuda")
    assert caught.value.option == "calibration.device"


def _app() -> typer.Typer:
    from fp4forge.cli import app

    return app


def _named_error(result, option: str) -> bool:
    """The command ended in the named error about ``option``: raised to ``fp4forge.cli.main``
    (which prints one line and exits 2), or already printed and exited 2 (pipeline)."""
    if isinstance(result.exception, ConfigError):
        return result.exception.option == option and result.exception.exit_code == ExitCode.UNUSABLE
    return result.exit_code == ExitCode.UNUSABLE and "--" + option.split("_bytes")[0].replace("_", "-") in result.output


def test_cuda_without_a_gpu_is_a_named_error_per_command(tiny_laguna: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    runner = CliRunner()
    commands = [
        ["calibrate", str(tiny_laguna), "--out", str(tmp_path / "s.safetensors")],
        ["kv", "calibrate", str(tiny_laguna), "--into", str(tmp_path / "none")],
        ["quantize", str(tiny_laguna), str(tmp_path / "q"), "--recipe", "nvfp4-experts"],
        ["fidelity", str(tiny_laguna), str(tiny_laguna)],
        ["pipeline", str(tiny_laguna), str(tmp_path / "p"), "--recipe", "nvfp4-experts"],
    ]
    for args in commands:
        result = runner.invoke(_app(), [*args, "--device", "cuda"])
        assert _named_error(result, "device"), (args, result.output, result.exception)
    bad_budget = runner.invoke(_app(), ["calibrate", str(tiny_laguna), "--out", str(tmp_path / "s.safetensors"), "--device", "cpu", "--activation-budget", "lots"])
    assert _named_error(bad_budget, "activation_budget_bytes"), bad_budget.output
    assert not (tmp_path / "s.safetensors").exists() and not (tmp_path / "q").exists() and not (tmp_path / "p").exists()


def test_cuda_without_a_gpu_exits_2_with_one_line(tiny_laguna: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    import sys

    from fp4forge.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(sys, "argv", ["fp4forge", "quantize", str(tiny_laguna), str(tmp_path / "q"), "--recipe", "nvfp4-experts", "--device", "cuda"])
    with pytest.raises(SystemExit) as exited:
        main()
    err = capsys.readouterr().err
    assert exited.value.code == ExitCode.UNUSABLE, err
    assert "--device" in err and "sees none" in err and "Traceback" not in err and not (tmp_path / "q").exists()


def test_device_cpu_runs_each_command(tiny_laguna: Path, tmp_path: Path) -> None:
    runner = CliRunner()
    stats = tmp_path / "stats.safetensors"
    small = ["--samples", "2", "--seq-len", "64", "--device", "cpu"]
    result = runner.invoke(_app(), ["calibrate", str(tiny_laguna), "--out", str(stats), *small, "--activation-budget", "1KiB", "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)  # the built-in text's warning goes to stderr
    assert summary["device"] == "cpu" and summary["host_batches"] > 0 and summary["tokens"] == 128
    out = tmp_path / "q"
    result = runner.invoke(_app(), ["quantize", str(tiny_laguna), str(out), "--recipe", "nvfp4-experts", "--stats", str(stats), "--device", "cpu", "--json"])
    assert result.exit_code == 0, result.output
    result = runner.invoke(_app(), ["kv", "calibrate", str(stats), "--into", str(out), "--device", "cpu", "--json"])
    assert result.exit_code == 0, result.output
    result = runner.invoke(_app(), ["fidelity", str(tiny_laguna), str(out), *small, "--builtin", "--allow-unreadable", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["metrics"]["positions"] == 2 * 63


def test_device_export_path_writes_the_same_bytes(tiny_laguna: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU export path's structure (batches read ahead by threads into stacks, one stacked
    pass per signature, pipelined), run on the CPU in many small batches: the same bytes as the
    CPU worker pool."""
    import hashlib

    from fp4forge.quantize import export
    from fp4forge.quantize.act_scales import ConstantAmax
    from fp4forge.quantize.recipe import load_recipe

    def digests(out: Path) -> dict[str, str]:
        return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(out.glob("*.safetensors"))}

    options = export.QuantizeOptions(recipe=load_recipe("nvfp4-experts"), act_amax=ConstantAmax(8.0), device="cpu", workers=2)
    export.quantize_checkpoint(tiny_laguna, tmp_path / "pool", options)
    from fp4forge.checkpoint import ranges

    # the device path on the CPU, the stacks read as coalesced requests, of a size that cuts through tensors
    schedule = export.ExportSchedule(path="device", device_batch_bytes=1 << 16, device_read_ahead=2, device_read_request_bytes=10_000)
    requests = []
    plain_read_request = ranges.read_request
    monkeypatch.setattr(ranges, "read_request", lambda ckpt, request, buffers: requests.append(request) or plain_read_request(ckpt, request, buffers))
    export.quantize_checkpoint(tiny_laguna, tmp_path / "device-path", options, schedule=schedule)
    assert digests(tmp_path / "pool") == digests(tmp_path / "device-path") and digests(tmp_path / "pool")
    assert requests and max(r.nbytes for r in requests) == 10_000 and any(len(r.keys) > 1 for r in requests)


def test_device_export_path_refuses_a_nan_expert_by_name(tiny_laguna: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A NaN in one stacked expert: the stacked pass flags it without a host sync; the export
    stops with a NumericsError that names the Linear, and leaves no output."""
    import shutil

    from safetensors.torch import load_file, save_file

    from fp4forge.errors import NumericsError
    from fp4forge.quantize import export
    from fp4forge.quantize.act_scales import ConstantAmax
    from fp4forge.quantize.recipe import load_recipe

    src = tmp_path / "src"
    shutil.copytree(tiny_laguna, src)
    target = "model.layers.1.mlp.experts.3.up_proj.weight"
    shard = next(p for p in sorted(src.glob("*.safetensors")) if target in load_file(p))
    tensors = load_file(shard)
    tensors[target][2, 5] = float("nan")
    save_file(tensors, shard, metadata={"format": "pt"})
    options = export.QuantizeOptions(recipe=load_recipe("nvfp4-experts"), act_amax=ConstantAmax(8.0), device="cpu")
    with pytest.raises(NumericsError, match="experts.3.up_proj"):
        export.quantize_checkpoint(src, tmp_path / "q", options, schedule=export.ExportSchedule(path="device", device_batch_bytes=1 << 16))
    assert not (tmp_path / "q").exists()
