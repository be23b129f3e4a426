"""Fidelity evaluator: W4A4 / W4A16 students of the tiny Laguna against their teacher, the
teacher cache and its KL estimator, and the KV cache at 1.0 when declared without scales."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from fp4forge.calibrate import CalibrationOptions, calibrate_checkpoint
from fp4forge.fidelity.evaluate import ActivationScale, FidelityOptions, SharedExpertFakeQuant, TeacherEntry, estimated_kl, evaluate, exact_kl, teacher_entry
from fp4forge.calibrate.kv import write_declaration
from fp4forge.errors import ConfigError
from fp4forge.checkpoint.quantized import QuantizedCheckpoint, StoredWeight
from fp4forge.checkpoint.reader import open_checkpoint
from fp4forge.checkpoint.stats import write_stats
from fp4forge.model.streaming import StreamedModel, materialize, read_tensors
from fp4forge.quantize.act_scales import StatsAmax
from fp4forge.quantize.export import QuantizeOptions, quantize_checkpoint
from fp4forge.quantize.recipe import load_recipe
from tests.calibration_fixtures import laguna, one_thread  # noqa: F401 (shared fixtures)

# The random testbed reads no text (its perplexity is about its vocabulary size): its fidelity is
# a numerics check, scored on the built-in corpus asked for, with the unreadable-text override.
RANDOM_TEXT = dict(builtin_corpus=True, allow_unreadable=True)
FAST = FidelityOptions(samples=2, seq_len=96, batch_size=2, **RANDOM_TEXT)


@pytest.fixture(scope="module")
def stats(laguna: Path, tmp_path_factory: pytest.TempPathFactory) -> StatsAmax:
    result = calibrate_checkpoint(laguna, CalibrationOptions(samples=4, seq_len=96, batch_size=4))
    return StatsAmax(write_stats(tmp_path_factory.mktemp("fidstats") / "stats.safetensors", result.tensors, result.metadata))


def export(laguna: Path, stats: StatsAmax, out: Path, *, recipe: str = "nvfp4-experts-fp8-attn", block_scales: str = "minmax", layout: str = "compressed-tensors") -> Path:
    quantize_checkpoint(laguna, out, QuantizeOptions(recipe=load_recipe(recipe), layout_format=layout, block_scales=block_scales, act_amax=stats))
    return out


def test_nvfp4_student_kl_positive_with_and_without_block_scale_search(laguna: Path, stats: StatsAmax, tmp_path: Path) -> None:
    results = {}
    for block_scales in ("minmax", "mse"):
        report = evaluate(laguna, export(laguna, stats, tmp_path / block_scales, block_scales=block_scales), FAST)
        metrics = report.metrics
        assert metrics["kl"]["mean"] > 0 and math.isfinite(metrics["kl"]["p99"]) and metrics["kl"]["estimator"].startswith("exact")
        assert 0 < metrics["top1_agreement"] <= 1 and metrics["positions"] == 2 * 95
        assert [layer["layer"] for layer in report.layers] == [f"model.layers.{i}" for i in range(4)]
        assert all(layer["relative_error"] > 0 for layer in report.layers)
        assert report.kv_cache == "fp8 with the checkpoint's k/v scales"
        results[block_scales] = metrics["kl"]["mean"]
    print(f"\ntiny Laguna nvfp4-experts-fp8-attn W4A4 KL mean: minmax {results['minmax']:.6g}, mse {results['mse']:.6g}")


def test_w4a16_drops_only_the_nvfp4_activation_quantization(laguna: Path, stats: StatsAmax, tmp_path: Path) -> None:
    student = export(laguna, stats, tmp_path / "experts-only", recipe="nvfp4-experts")
    w4a4 = evaluate(laguna, student, FAST)
    w4a16 = evaluate(laguna, student, FidelityOptions(samples=2, seq_len=96, batch_size=2, numerics="w4a16", **RANDOM_TEXT))
    assert w4a4.activation_quantized_gemm_inputs == 3 * 2 * 16  # 3 MoE layers x (gate/up, down) x 16 experts
    assert w4a16.activation_quantized_gemm_inputs == 0
    assert w4a4.metrics["kl"]["mean"] != w4a16.metrics["kl"]["mean"]
    assert w4a16.layers[0]["relative_error"] == 0.0, "layer 0 is dense BF16 in this recipe"
    with pytest.raises(ConfigError, match="numerics"):
        evaluate(laguna, student, FidelityOptions(numerics="w8a8"))


def test_modelopt_student_and_kv_declared_without_scales(laguna: Path, stats: StatsAmax, tmp_path: Path) -> None:
    import json

    import typer
    from typer.testing import CliRunner

    from fp4forge.cli.calibrate import register

    student = export(laguna, stats, tmp_path / "mo", recipe="nvfp4-all-linear", layout="modelopt")
    app = typer.Typer()
    app.callback()(lambda: None)
    register(app)
    result = CliRunner().invoke(app, ["fidelity", str(laguna), str(student), "--samples", "2", "--seq-len", "96", "--batch-size", "2", "--builtin", "--allow-unreadable", "--json"])
    assert result.exit_code == 0, result.output
    plain = json.loads(result.stdout)  # the unreadable-text warning goes to stderr
    assert plain["metrics"]["kl"]["mean"] > 0 and plain["kv_cache"].startswith("not quantized")
    write_declaration(student, "modelopt")
    at_one = evaluate(laguna, student, FAST)
    assert at_one.kv_cache.startswith("fp8 at scale 1.0")
    assert at_one.metrics["kl"]["mean"] != plain["metrics"]["kl"]["mean"]


def test_teacher_cache_is_reused_and_estimates_kl(laguna: Path, stats: StatsAmax, tmp_path: Path) -> None:
    student = export(laguna, stats, tmp_path / "student")
    cache = tmp_path / "teacher.safetensors"
    options = FidelityOptions(samples=2, seq_len=96, batch_size=2, teacher_cache=cache, top_k=16, tail_samples=16, **RANDOM_TEXT)
    written = evaluate(laguna, student, options)
    assert cache.is_file() and written.teacher_cache["written"] and written.metrics["kl"]["estimator"].startswith("exact")
    reused = evaluate(laguna, student, options)
    assert reused.teacher_cache["used"] and reused.layers == []
    assert reused.metrics["kl"]["estimator"].startswith("top-k")
    assert reused.metrics["kl"]["mean"] == written.metrics["kl_cache_estimate"]["mean"]
    for key in ("top1_agreement", "perplexity"):
        assert reused.metrics[key] == written.metrics[key]
    with pytest.raises(ConfigError, match="other text"):
        evaluate(laguna, student, FidelityOptions(samples=2, seq_len=64, batch_size=2, teacher_cache=cache, **RANDOM_TEXT))


def test_cached_kl_estimator_is_unbiased() -> None:
    """Averaged over many tail draws, the top-k + sampled-tail estimate meets the exact KL."""
    gen = torch.Generator().manual_seed(0)
    teacher = torch.log_softmax(torch.randn(1, 8, 500, generator=gen) * 2, dim=-1)
    student = torch.log_softmax(teacher + torch.randn(1, 8, 500, generator=gen) * 0.3, dim=-1)
    targets = torch.zeros(1, 8, dtype=torch.int64)
    exact = exact_kl(teacher, student)
    estimates = torch.stack([estimated_kl(teacher_entry(teacher, targets, 10, 8, torch.Generator().manual_seed(seed)), student) for seed in range(400)])
    mean, stderr = estimates.mean(0), estimates.std(0) / math.sqrt(estimates.shape[0])
    assert bool(((mean - exact).abs() < 4 * stderr + 1e-6).all()), (mean, exact, stderr)
    everything: TeacherEntry = teacher_entry(teacher, targets, 500, 4, gen)  # top-k = the whole vocabulary: exact
    assert torch.allclose(estimated_kl(everything, student), exact, atol=1e-6)


def test_student_weights_decoded_where_materialised_are_the_host_decode(laguna: Path, stats: StatsAmax, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the read-ahead hands a CUDA layer (stored codes, decoded on the device) fills every
    parameter with the values the host decode gives (here the CPU stands in for the device)."""
    ckpt = open_checkpoint(export(laguna, stats, tmp_path / "student"))
    reader = QuantizedCheckpoint(ckpt, "compressed-tensors").dequantized(torch.bfloat16, formula="multiply")
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self)  # no page-locked memory without CUDA
    with StreamedModel(ckpt.config, reader, device="cpu", prefetch=False) as streamed:
        layer, prefix = streamed.layers[1], streamed.layer_prefix(1)
        names = streamed._layer_disk_names(1)
        handed = read_tensors(reader, names, pin=True)
        assert sum(isinstance(v, StoredWeight) for v in handed.values()) >= 3 * 16  # the routed experts at least
        deferred = {n: p.clone() for n, p in materialize(layer, prefix, streamed.plan, reader, "cpu", handed).state_dict().items()}
        host = materialize(layer, prefix, streamed.plan, reader, "cpu", read_tensors(reader, names)).state_dict()
        assert deferred.keys() == host.keys() and all(torch.equal(deferred[n], host[n]) for n in host)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_student_weights_decoded_on_cuda_are_the_host_decode(laguna: Path, stats: StatsAmax, tmp_path: Path) -> None:
    ckpt = export(laguna, stats, tmp_path / "student")
    reader = QuantizedCheckpoint(open_checkpoint(ckpt), "compressed-tensors").dequantized(torch.bfloat16, formula="multiply")
    for name in [f"{m}.weight" for m in reader.linears]:
        assert torch.equal(reader.read_host(name, pin=True).on_device(torch.device("cuda")).cpu(), reader.read(name)), name


def test_global_max_experts_quantized_in_one_call_as_per_expert() -> None:
    """SharedExpertFakeQuant quantizes all experts' rows at once: the per-expert calls' values."""
    rows = torch.randn(40, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16) * 3
    quant = ActivationScale("nvfp4", float(rows.abs().max())).quantizer()
    tap = SharedExpertFakeQuant(quant, quant, 4)
    experts, counts = torch.tensor([0] * 7 + [2] * 30 + [3] * 3), [7, 30, 3]
    per_expert = torch.cat([tap.gate_up_input(e, part) for e, part in zip((0, 2, 3), rows.split(counts))])
    assert torch.equal(tap.gate_up_rows(rows, experts), per_expert) and torch.equal(tap.down_rows(rows, experts), per_expert)
