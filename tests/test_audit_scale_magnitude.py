"""`audit --deep`, scale magnitude against the weights: the largest dequantized value of each
quantized weight (NVFP4 E2M1 codes x E4M3 block scale x the per-tensor multiplier of its layout;
FP8 codes x scale) must reach the amax its scales imply. fp4forge's own exports, every recipe and
both layouts, stay clean; planted defects (block scales written without the global scale, block
scales in the other layout's convention, FP8 codes that do not use the range) are errors.

Oracle for the planted values: the defect is made from the stored tensors by hand with torch's
own float8 cast, and the ratio the finding reports is recomputed here from safetensors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fp4forge.audit.checks_declarations import MAGNITUDE_MIN_RATIO
from fp4forge.audit.engine import audit_checkpoint
from fp4forge.audit.options import AuditOptions
from fp4forge.quantize.act_scales import ConstantAmax
from fp4forge.quantize.export import QuantizeOptions, quantize_checkpoint
from fp4forge.quantize.recipe import builtin_recipe_names, load_recipe
from tests.test_audit_integrity import rebuild

ACT = ConstantAmax(8.0)
EXPERT = "model.layers.2.mlp.experts.3"
E2M1_MAX, E4M3_MAX = 6.0, 448.0


@pytest.fixture(scope="module")
def exports(tmp_path_factory) -> dict[tuple[str, str], Path]:
    from fp4forge.testbed import build_tiny_laguna

    root = tmp_path_factory.mktemp("magnitude")
    source = build_tiny_laguna(root / "tiny-laguna", seed=0)
    out = {}
    # the recipes the planted tests start from, plus the all-Linear one (attention and dense MLPs)
    recipes = ("nvfp4-experts", "nvfp4-all-linear", "fp8")
    assert set(recipes) <= set(builtin_recipe_names())
    for recipe in recipes:
        for layout in ("compressed-tensors", "modelopt"):
            target = root / f"{recipe}-{layout}"
            quantize_checkpoint(source, target, QuantizeOptions(load_recipe(recipe), layout, act_amax=ACT))
            out[(recipe, layout)] = target
    return out


def magnitude_findings(path: Path):
    report = audit_checkpoint(str(path), AuditOptions(deep=True))
    return report, [f for f in report.findings if f.rule == "scale-magnitude"]


def test_own_exports_reach_their_scales(exports):
    for key, path in exports.items():
        report, found = magnitude_findings(path)
        assert found == [], (key, [f.message for f in found])
        assert not [f for f in report.findings if f.severity == "error"], key


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for shard in sorted(path.glob("*.safetensors")):
        out.update(load_file(shard))
    return out


@pytest.mark.parametrize("layout", ["compressed-tensors", "modelopt"])
def test_block_scales_without_the_global_scale(layout, exports, tmp_path):
    """The exporter bug: E4M3 block scales of block_amax/6 (no global scale applied)."""
    path = exports[("nvfp4-experts", layout)]
    per_tensor = "weight_global_scale" if layout == "compressed-tensors" else "weight_scale_2"
    module = f"{EXPERT}.down_proj"

    def plant(tensors):
        scale = tensors[f"{module}.weight_scale"].to(torch.float32)
        global_ = tensors[f"{module}.{per_tensor}"].to(torch.float32)
        # CT stores gs = 2688/amax (block scale = block_amax/6 * gs); ModelOpt stores 1/gs
        unscaled = scale / global_ if layout == "compressed-tensors" else scale * global_
        tensors[f"{module}.weight_scale"] = unscaled.to(torch.float8_e4m3fn)

    report, found = magnitude_findings(rebuild(path, tmp_path / "planted", plant))
    assert [f.severity for f in found] == ["error"]
    assert module in found[0].message and "Fix:" in found[0].message
    assert {f.rule for f in report.findings if f.severity == "error"} == {"scale-magnitude"}
    # the ratio by hand from the planted file: top code x top block scale / (6 x 448)
    tensors = _tensors(tmp_path / "planted")
    packed = tensors[f"{module}.weight_packed" if layout == "compressed-tensors" else f"{module}.weight"]
    mags = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    top = torch.maximum(mags[(packed & 7).long()], mags[((packed >> 4) & 7).long()]).reshape(-1, 8).amax(dim=1)
    ratio = float((top * tensors[f"{module}.weight_scale"].to(torch.float32).reshape(-1)).max()) / (E2M1_MAX * E4M3_MAX)
    assert ratio < MAGNITUDE_MIN_RATIO
    assert f"ratio {ratio:.3g}" in found[0].message


def test_block_scales_in_the_other_convention(exports, tmp_path):
    """ModelOpt export whose block scales were computed by multiplying by weight_scale_2 (the CT
    global scale's role) instead of dividing: all blocks collapse towards E4M3's bottom."""
    path = exports[("nvfp4-experts", "modelopt")]
    module = f"{EXPERT}.gate_proj"

    def plant(tensors):
        for shard in (module, f"{EXPERT}.up_proj"):  # the fused gate/up pair, both shards
            scale_2 = tensors[f"{shard}.weight_scale_2"].to(torch.float32)
            tensors[f"{shard}.weight_scale"] = (tensors[f"{shard}.weight_scale"].to(torch.float32) * scale_2 * scale_2).to(torch.float8_e4m3fn)

    _, found = magnitude_findings(rebuild(path, tmp_path / "planted", plant))
    assert len(found) == 1 and f"{EXPERT}.gate_proj, {EXPERT}.up_proj" in found[0].message


def test_fp8_codes_that_do_not_use_the_range(exports, tmp_path):
    path = exports[("fp8", "compressed-tensors")]
    module = "model.layers.1.self_attn.o_proj"

    def plant(tensors):
        tensors[f"{module}.weight"] = (tensors[f"{module}.weight"].to(torch.float32) / 16).to(torch.float8_e4m3fn)

    _, found = magnitude_findings(rebuild(path, tmp_path / "planted", plant))
    assert len(found) == 1 and module in found[0].message
