"""GEMM microbench: shapes from a config, and each kernel computes what it claims (checked on CPU
against hand-built references; timings are never asserted)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from fp4forge.bench import gemm
from fp4forge.bench.gemm import GemmShape, projection_shapes, run_gemm_bench
from fp4forge.errors import ConfigError
from fp4forge.numerics.fp8 import fp8_quantize_weight
from fp4forge.numerics.nvfp4 import nvfp4_dequantize, nvfp4_quantize

PRESET = Path(__file__).resolve().parents[1] / "src/fp4forge/testbed/presets/laguna-s-2.1-like.json"


def test_laguna_s_shapes_by_hand() -> None:
    cfg = json.loads(PRESET.read_text())
    shapes = {s.name: (s.n, s.k) for s in projection_shapes(cfg)}
    # hidden 3072, head_dim 128, 48 / 64 query heads, 8 KV heads, experts 1024, shared 1536, dense 12288
    assert shapes == {
        "q_proj[48 heads]": (6144, 3072),
        "o_proj[48 heads]": (3072, 6144),
        "q_proj[64 heads]": (8192, 3072),
        "o_proj[64 heads]": (3072, 8192),
        "k_proj / v_proj": (1024, 3072),
        "experts.gate_up": (2048, 3072),
        "experts.down": (3072, 1024),
        "shared_expert.gate_up": (3072, 3072),
        "shared_expert.down": (3072, 1536),
        "mlp.gate_up": (24576, 3072),
        "mlp.down": (3072, 12288),
        "lm_head": (100352, 3072),
    }


def test_plain_moe_without_dense_layers_has_no_dense_mlp() -> None:
    cfg = {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "moe_intermediate_size": 64,
           "intermediate_size": 512, "vocab_size": 1000}
    names = [s.name for s in projection_shapes(cfg)]
    assert names == ["q_proj", "o_proj", "k_proj / v_proj", "experts.gate_up", "experts.down", "lm_head"]


def test_config_without_dimensions_is_a_named_error() -> None:
    with pytest.raises(ConfigError):
        projection_shapes({"model_type": "x"})


def _kernel_output(kernel: str, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    fn, _ = gemm._kernel_fns(kernel, x, [w])
    return fn(0).float()


def test_kernels_compute_their_own_products() -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 64, generator=g).to(torch.bfloat16)
    w = (torch.randn(32, 64, generator=g) * 0.02).to(torch.bfloat16)
    # bf16: the plain product
    assert torch.equal(_kernel_output("bf16", x, w), (x @ w.t()).float())
    # fp8: the activation by hand (per-tensor amax/448, F32), the weight as compressed-tensors
    # quantizes it (numerics/fp8.py, tested bit-exact against compressed-tensors); the GEMM of the
    # dequantized operands
    sx = x.float().abs().amax() / 448
    xq = (x.float() / sx).clamp(-448, 448).to(torch.float8_e4m3fn).float() * sx
    wq = fp8_quantize_weight(w, "tensor").dequantize(torch.float32)
    expect = (xq @ wq.t()).to(torch.bfloat16).float()
    for kernel in ("fp8", "fp8-static-act"):
        got = _kernel_output(kernel, x, w)
        assert torch.allclose(got, expect, rtol=1e-2, atol=1e-3), kernel
    # fp8-dynamic-act (FP8_DYNAMIC): a scale per token (row of x) and per output channel (row of W)
    sxt = x.float().abs().amax(dim=1, keepdim=True) / 448
    xq = (x.float() / sxt).clamp(-448, 448).to(torch.float8_e4m3fn).float() * sxt
    wq = fp8_quantize_weight(w, "channel").dequantize(torch.float32)
    expect = (xq @ wq.t()).to(torch.bfloat16).float()
    assert torch.allclose(_kernel_output("fp8-dynamic-act", x, w), expect, rtol=1e-2, atol=1e-3)
    # nvfp4 emulated: x times the dequantized NVFP4 weight
    wd = nvfp4_dequantize(nvfp4_quantize(w, convention="modelopt"), torch.bfloat16)
    assert torch.equal(_kernel_output("nvfp4-emulated", x, w), (x @ wd.t()).float())


def test_report_orders_precision_and_rotates_weights() -> None:
    report = run_gemm_bench(
        [GemmShape("t", 64, 128)], m_values=[1, 16], device="cpu", samples=2, inner=1, warmup=0, cache_bytes=64 * 128 * 2 * 3
    )
    rows = {(r.m, r.kernel): r for r in report.results}
    assert len(rows) == 2 * len(gemm.KERNELS)
    for m in (1, 16):
        # bf16 output rounding only; FP8 a few %; NVFP4 about 10 % (random Gaussian weights)
        assert rows[(m, "bf16")].rel_error < 5e-3
        assert 5e-3 < rows[(m, "fp8")].rel_error < 0.08
        assert 0.05 < rows[(m, "nvfp4-emulated")].rel_error < 0.2
    assert gemm._copies(64 * 128 * 2, 64 * 128 * 2 * 3) == 3
    out = report.to_json()
    assert out["fp4_tensor_cores"] is False and any("no FP4 tensor cores" in n for n in out["not_run"])
    assert all(len(r["samples_us"]) == 2 and r["p10_us"] <= r["median_us"] <= r["p90_us"] for r in out["results"])


def test_unknown_kernel_and_bad_m_are_named_errors() -> None:
    with pytest.raises(ConfigError):
        run_gemm_bench([GemmShape("t", 16, 16)], kernels=["int3"], device="cpu")  # type: ignore[list-item]
    with pytest.raises(ConfigError):
        run_gemm_bench([GemmShape("t", 16, 16)], m_values=[0], device="cpu")


def _cli(*args: str) -> subprocess.CompletedProcess:
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "fp4forge.cli", "bench", "gemm", *args], capture_output=True, text=True, timeout=600)


def test_cli_measures_writes_and_renders(tmp_path: Path) -> None:
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"hidden_size": 64, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
                               "moe_intermediate_size": 32, "vocab_size": 128}))
    out = tmp_path / "out"
    done = _cli("--config", str(cfg), "--device", "cpu", "--m", "1,4", "--kernels", "bf16,fp8", "--samples", "2", "--inner", "1",
                "--out", str(out), "--json")
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert {r["kernel"] for r in data["results"]} == {"bf16", "fp8"} and {r["m"] for r in data["results"]} == {1, 4}
    assert json.loads((out / "gemm.json").read_text()) == data
    assert (out / "gemm.png").stat().st_size > 0 and "| shape |" in (out / "gemm.md").read_text()
    rendered = _cli("--config", "unused", "--from-json", str(out / "gemm.json"), "--markdown")
    assert rendered.returncode == 0 and rendered.stdout == (out / "gemm.md").read_text()


def test_cli_bad_config_is_exit_2_without_traceback(tmp_path: Path) -> None:
    done = _cli("--config", str(tmp_path / "nope.json"), "--device", "cpu")
    assert done.returncode == 2
    assert "Traceback" not in done.stderr and "--config" in done.stderr
