"""`fp4forge audit`, name rules: tensors against the architecture config.json describes (built
on the meta device; on-disk per-expert names), and the serving engine's known blind spots.
Defects are planted in copies of the real tiny Laguna testbed (and, marked slow, of an
llm-compressor export, whose quantized names must map back to their parameters)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fp4forge.audit.checks_names import find_renames, pattern_of, version_matches
from tests.test_audit_integrity import assert_exactly, audit, copy_checkpoint, finding, patch_json, rebuild, rules


@pytest.fixture()
def tiny(lc_source_dir: Path, tmp_path: Path) -> Path:
    return copy_checkpoint(lc_source_dir, tmp_path / "tiny")


def renamed(src: Path, dst: Path, old: str, new: str) -> Path:
    def rename(tensors: dict[str, torch.Tensor]) -> None:
        for name in [n for n in tensors if old in n]:
            tensors[name.replace(old, new)] = tensors.pop(name)

    return rebuild(src, dst, rename)


# -- renames, unexpected, missing -------------------------------------------------------------------
def test_shared_expert_under_the_hy3_name(tiny: Path, tmp_path: Path) -> None:
    report = audit(renamed(tiny, tmp_path / "hy3", ".mlp.shared_expert.", ".mlp.shared_mlp."))
    assert_exactly(report, "tensor-misnamed")
    message = finding(report, "tensor-misnamed").message
    assert "`mlp.shared_mlp.*` present where `mlp.shared_expert.*` is expected" in message
    assert "3 layers' shared-expert Linears would stay uninitialised" in message
    assert len(finding(report, "tensor-misnamed").tensors) == 9


def test_router_bias_under_transformers_in_memory_name(tiny: Path, tmp_path: Path) -> None:
    report = audit(renamed(tiny, tmp_path / "bias", ".mlp.experts.e_score_correction_bias", ".mlp.gate.e_score_correction_bias"))
    assert_exactly(report, "tensor-misnamed", baseline=set())  # the quirk no longer applies: no such tensor
    assert "`mlp.gate.*` present where `mlp.experts.*` is expected" in finding(report, "tensor-misnamed").message


def test_tensor_matching_no_parameter(tiny: Path, tmp_path: Path) -> None:
    def add(tensors):
        for layer in (1, 2):
            tensors[f"model.layers.{layer}.mlp.extra_router.weight"] = torch.zeros(4, 256, dtype=torch.bfloat16)

    report = audit(rebuild(tiny, tmp_path / "extra", add))
    assert_exactly(report, "tensor-unexpected")
    found = finding(report, "tensor-unexpected")
    assert "model.layers.*.mlp.extra_router.weight (2 tensors)" in found.message and len(found.tensors) == 2


def test_parameters_absent(tiny: Path, tmp_path: Path) -> None:
    def drop(tensors):
        for expert in range(16):
            del tensors[f"model.layers.3.mlp.experts.{expert}.down_proj.weight"]

    report = audit(rebuild(tiny, tmp_path / "dropped", drop))
    assert_exactly(report, "parameter-missing")
    found = finding(report, "parameter-missing")
    assert "model.layers.*.mlp.experts.*.down_proj.weight (16 parameters, routed-expert Linears)" in found.message
    assert len(found.tensors) == 16


def test_shape_differs_from_config(tiny: Path) -> None:
    patch_json(tiny / "config.json", lambda d: d.update(vocab_size=4160))
    report = audit(tiny)
    assert_exactly(report, "parameter-shape-mismatch")
    assert set(finding(report, "parameter-shape-mismatch").tensors) == {"model.embed_tokens.weight", "lm_head.weight"}


# -- serving engine blind spots ---------------------------------------------------------------------
def test_laguna_router_bias_blind_spot_depends_on_the_vllm_version(lc_source_dir: Path) -> None:
    at_032 = audit(lc_source_dir)
    blind = finding(at_032, "serving-blind-spot")
    assert blind.count == 3 and "router bias stays 0" in blind.message and blind.severity == "warning"
    assert "serving-blind-spot" not in rules(audit(lc_source_dir, vllm_version="0.33"))


def test_g_proj_without_gating(tiny: Path, tmp_path: Path) -> None:
    def widen(tensors):  # with gating off, g_proj is [heads*head_dim, hidden]
        for layer in range(4):
            tensors[f"model.layers.{layer}.self_attn.g_proj.weight"] = torch.zeros(256, 256, dtype=torch.bfloat16)

    ungated = rebuild(tiny, tmp_path / "ungated", widen)
    patch_json(ungated / "config.json", lambda d: d.update(gating=False))
    report = audit(ungated)
    assert_exactly(report)
    assert any("g_proj" in f.message and "laguna-g-proj-without-gating" in f.message for f in report.findings if f.rule == "serving-blind-spot")


# -- pieces -----------------------------------------------------------------------------------------
def test_rename_pairs_need_exactly_one_differing_part() -> None:
    renames = find_renames(
        ["model.layers.1.mlp.shared_mlp.up_proj.weight", "model.layers.1.mlp.other.thing.weight"],
        ["model.layers.1.mlp.shared_expert.up_proj.weight", "model.layers.1.mlp.gate.weight"],
    )
    assert renames == {"model.layers.1.mlp.shared_mlp.up_proj.weight": ("model.layers.1.mlp.shared_expert.up_proj.weight", 4)}
    assert pattern_of("model.layers.12.mlp.experts.7.up_proj.weight") == "model.layers.*.mlp.experts.*.up_proj.weight"


@pytest.mark.parametrize(
    ("version", "spec", "expected"),
    [((0, 32), "<=0.32", True), ((0, 32, 1), "<=0.32", False), ((0, 31), ">=0.30,<0.33", True), ((0, 33), "<=0.32", False), ((1, 0), ">0.33", True)],
)
def test_version_specs(version: tuple[int, ...], spec: str, expected: bool) -> None:
    assert version_matches(version, spec) is expected


# -- quantized names map back to their parameters (llm-compressor export) ------------------------
@pytest.mark.slow
def test_quantized_shared_expert_under_the_hy3_name(lc_nvfp4_kv_dir: Path, tmp_path: Path) -> None:
    report = audit(renamed(lc_nvfp4_kv_dir, tmp_path / "hy3", ".mlp.shared_expert.", ".mlp.shared_mlp."))
    assert_exactly(report, "tensor-misnamed")
    found = finding(report, "tensor-misnamed")
    assert "`mlp.shared_mlp.*` present where `mlp.shared_expert.*` is expected" in found.message
    assert len(found.tensors) == 9 * 4  # packed weight, block scale, global scale, input scale each


def test_wrapper_prefix_is_one_rename(tiny: Path, tmp_path: Path) -> None:
    """A text model's tensors stored under a vision-language wrapper's `model.language_model.`:
    one finding for the prefix, not one per name pattern."""
    report = audit(renamed(tiny, tmp_path / "wrapped", "model.", "model.language_model."))
    assert_exactly(report, "tensor-misnamed")
    found = finding(report, "tensor-misnamed")
    assert found.count == 1
    assert "`model.language_model.*` present where `model.*` is expected" in found.message
    assert not [f for f in report.findings if f.rule in ("tensor-unexpected", "parameter-missing")]


def test_prefix_rename_needs_most_names() -> None:
    from fp4forge.audit.checks_names import find_prefix_rename

    missing = [f"model.layers.{i}.mlp.down_proj.weight" for i in range(4)] + ["model.norm.weight"]
    stored = ["model.language_model." + n[len("model."):] for n in missing]
    old, new, mapping = find_prefix_rename(stored, missing)
    assert (old, new) == ("model.language_model", "model") and len(mapping) == 5
    # two unrelated names sharing a tail are not a prefix change of the checkpoint
    assert find_prefix_rename(["a.x.weight"] + [f"u{i}.q" for i in range(9)], ["b.x.weight"]) is None
