"""`fp4forge frontier` and `fp4forge study`: clip search, bits-per-parameter accounting, the
frontier's JSON, the bootstrap interval, and the study end to end on the trained testbed (narrowed)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import typer
from typer.testing import CliRunner

import fp4forge
from fp4forge.numerics.clip_search import intn_quantize_mse
from fp4forge.numerics.intn import intn_dequantize, intn_quantize
from fp4forge.lab.study.frontier import ArmSpec, quantize_dequantize
from fp4forge.model.samples import OWN_TEXT_FILES
from tests.trained_fixtures import trained_laguna  # noqa: F401


@pytest.fixture(scope="module")
def tiny_laguna(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from fp4forge.testbed.tiny import build_tiny_laguna

    return build_tiny_laguna(tmp_path_factory.mktemp("study") / "tiny-laguna", seed=0)


def _invoke(*args: str):  # type: ignore[no-untyped-def]
    from fp4forge.lab.study.cli import register

    app = typer.Typer()
    register(app)
    return CliRunner().invoke(app, list(args), catch_exceptions=False)


# -- INT-N clip search -------------------------------------------------------------------------------
@pytest.mark.parametrize("symmetric", [True, False])
def test_clip_search_with_only_the_full_range_is_min_max_bit_for_bit(symmetric: bool) -> None:
    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(1))
    ours = intn_quantize_mse(w, 3, group_size=16, symmetric=symmetric, clip_grid=(1.0,))
    ref = intn_quantize(w, 3, group_size=16, symmetric=symmetric)
    assert torch.equal(ours.q, ref.q) and torch.equal(ours.scale, ref.scale)
    assert (ours.zero_point is None) == symmetric and (symmetric or torch.equal(ours.zero_point, ref.zero_point))


def test_clip_search_never_loses_to_min_max_per_group_and_wins_at_two_bits() -> None:
    w = torch.randn(16, 128, generator=torch.Generator().manual_seed(2))
    for bits in (2, 4):
        searched = intn_dequantize(intn_quantize_mse(w, bits, group_size=32), torch.float32)
        plain = intn_dequantize(intn_quantize(w, bits, group_size=32), torch.float32)
        group_err = lambda approx: (approx - w).pow(2).unflatten(-1, (4, 32)).sum(-1)  # noqa: E731
        assert bool((group_err(searched) <= group_err(plain) + 1e-6).all())
    two_searched = float((intn_dequantize(intn_quantize_mse(w, 2, group_size=32), torch.float32) - w).norm() / w.norm())
    two_plain = float((intn_dequantize(intn_quantize(w, 2, group_size=32), torch.float32) - w).norm() / w.norm())
    assert two_searched < 0.85 * two_plain


# -- frontier arithmetic --------------------------------------------------------------------------------
def test_bits_per_parameter_count_the_stored_scales() -> None:
    w = torch.randn(32, 128, generator=torch.Generator().manual_seed(3))
    numel = w.numel()
    expected = {
        ArmSpec("nvfp4", 4, 16, "minmax"): 4 + 8 / 16 + 32 / numel,
        ArmSpec("mxfp4", 4, 32, "minmax"): 4 + 8 / 32,
        ArmSpec("fp8", 8, 0, "minmax"): 8 + 16 / numel,
        ArmSpec("fp8", 8, None, "minmax"): 8 + 16 / 128,
        ArmSpec("int4", 4, 32, "minmax"): 4 + 16 / 32,
        ArmSpec("int2", 2, 16, "mse", symmetric=False): 2 + 24 / 16,
        ArmSpec("int8", 8, None, "minmax"): 8 + 16 / 128,
    }
    for arm, bpp in expected.items():
        _, got = quantize_dequantize(w, arm)
        assert math.isclose(got, bpp), (arm, got, bpp)
    # the study's two 2-bit arms: 3.5 bits at g16 asymmetric (scale + zero point), 2.5 at g32
    from fp4forge.lab.study.run import INT2_ARMS

    assert {name: quantize_dequantize(w, arm)[1] for name, arm in INT2_ARMS.items()} == {"int2-g16-mse": 3.5, "int2-g32-mse": 2.5}


def test_a_weight_on_the_int4_grid_round_trips_exactly() -> None:
    # Rows of -8..7 times a row step d: asymmetric INT4 per row has scale (7d + 8d) / 15 = d and
    # zero point 0, so every value is a code and the error is zero (hand-computed).
    codes = torch.arange(-8, 8, dtype=torch.float32).repeat(4, 4)  # [4, 64]
    w = codes * torch.tensor([[0.5], [0.25], [2.0], [1.0]])
    approx, bpp = quantize_dequantize(w, ArmSpec("int4", 4, None, "minmax", symmetric=False))
    assert torch.equal(approx, w) and bpp == 4 + 24 / 64


# -- commands -------------------------------------------------------------------------------------------
def test_frontier_json_and_named_errors(tiny_laguna: Path, tmp_path: Path) -> None:
    result = _invoke("frontier", str(tiny_laguna), "--formats", "nvfp4,int2", "--components", "attention", "--groups", "16",
                     "--max-tensors", "2", "--json", "--out", str(tmp_path / "f"))
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    keys = {"component", "format", "bits", "group_size", "method", "bpp", "rel_error"}
    assert doc["arms"] and all(keys <= set(arm) for arm in doc["arms"])
    assert {(a["format"], a["method"]) for a in doc["arms"]} >= {("nvfp4", "minmax"), ("nvfp4", "mse"), ("nvfp4", "four_over_six"),
                                                                  ("int2", "minmax"), ("int2", "mse")}
    assert all(a["component"] == "attention" and 0 < a["rel_error"] < 1 for a in doc["arms"])
    assert (tmp_path / "f" / "frontier.md").is_file()
    written = json.loads((tmp_path / "f" / "frontier.json").read_text())
    assert written == doc and written["fp4forge_version"] == fp4forge.__version__  # the file is the printed document
    bad = _invoke("frontier", str(tiny_laguna), "--formats", "int9")
    assert bad.exit_code == 2 and "--formats" in bad.output
    # every arm skipped (width 256 is no multiple of 48): nothing measured is an error, not an empty table
    none = _invoke("frontier", str(tiny_laguna), "--formats", "int4", "--groups", "48", "--components", "attention", "--json")
    assert none.exit_code == 2 and "no arm applies" in json.loads(none.stdout)["error"]


def test_paired_differences_resample_the_pairs_together() -> None:
    from fp4forge.lab.study.run import _comparisons, _paired_differences

    def arm(name, per_sample):
        return {"name": name, "kl": {"per_sample": per_sample, "ci95": [min(per_sample), max(per_sample)]}}

    # per-arm intervals overlap widely, but b is above a by exactly 1 on every sample: the paired CI is [1, 1]
    arms = [arm("nvfp4-w4a16-minmax", [1.0, 5.0, 9.0]), arm("int2-g16-mse", [2.0, 6.0, 10.0])]
    (row,) = _paired_differences(arms)
    assert row["mean"] == 1.0 and row["ci95"] == [1.0, 1.0]
    assert _comparisons(arms)[0].startswith("KL of nvfp4-w4a16-minmax is below int2-g16-mse's")
    mixed = [arm("nvfp4-w4a16-minmax", [1.0, 5.0, 9.0]), arm("int2-g16-mse", [2.0, 4.0, 10.0])]
    assert "not resolved" in _comparisons(mixed)[0]


def test_study_runs_resumes_and_names_what_it_did_not_run(trained_laguna: Path, tmp_path: Path) -> None:  # noqa: F811
    out = tmp_path / "study"
    args = ["study", str(trained_laguna), str(out), "--formats", "nvfp4,int2", "--components", "attention", "--groups", "16",
            "--arms", "nvfp4-w4a16-minmax,int2-g16-mse", "--samples", "4", "--seq-len", "32", "--calibration-samples", "4",
            # its own text: the built-in corpus is not (fidelity refuses it unasked, docs/fidelity.md#text)
            "--text", str(trained_laguna / OWN_TEXT_FILES["heldout"]), "--calibration-text", str(trained_laguna / OWN_TEXT_FILES["calibration"]), "--json"]
    result = _invoke(*args)
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    names = [arm["name"] for arm in doc["arms"]]
    assert sorted(names) == ["int2-g16-mse", "nvfp4-w4a16-minmax"]
    for arm in doc["arms"]:
        lo, hi = arm["kl"]["ci95"]
        assert lo <= arm["kl"]["mean"] <= hi and len(arm["kl"]["per_sample"]) == 4
    # 2-bit weights move the model further from its teacher than NVFP4's do.
    by = {arm["name"]: arm for arm in doc["arms"]}
    assert by["int2-g16-mse"]["kl"]["mean"] > by["nvfp4-w4a16-minmax"]["kl"]["mean"]
    # the paired difference is over the same 4 samples: its mean is the difference of the per-sample KLs
    (pair,) = doc["paired_differences"]
    diffs = [b - a for a, b in zip(by["nvfp4-w4a16-minmax"]["kl"]["per_sample"], by["int2-g16-mse"]["kl"]["per_sample"])]
    assert (pair["a"], pair["b"], pair["samples"]) == ("nvfp4-w4a16-minmax", "int2-g16-mse", 4)
    assert pair["mean"] == pytest.approx(sum(diffs) / 4) and pair["ci95"][0] <= pair["mean"] <= pair["ci95"][1]
    assert doc["fidelity"]["positions"] == by["int2-g16-mse"]["positions"] == 4 * 31
    not_run = " ".join(item["part"] for item in doc["not_run"])
    assert "GEMM" in not_run or not __import__("torch").cuda.is_available()
    assert "serving-latency arms" in not_run and "arm fp8" in not_run
    report = (out / "study.md").read_text()
    assert "## Not run" in report and "nvfp4-w4a16-minmax" in report and "Compression frontier" in report
    again = _invoke(*args)
    assert again.exit_code == 0
    assert set(json.loads(again.stdout)["resumed_parts"]) >= {"frontier", "arm:nvfp4-w4a16-minmax", "arm:int2-g16-mse"}
    other = _invoke(*[a if a != "4" else "5" for a in args])
    assert other.exit_code == 2 and "other settings" in other.output
