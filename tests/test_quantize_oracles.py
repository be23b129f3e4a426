"""fp4forge's exports against two independent implementations, each in its own venv:
compressed-tensors 0.17's file-level dequantizer (the vLLM venv) and llm-compressor's NVFP4
export of the same testbed (the llm-compressor venv)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from fp4forge.checkpoint.quantized import QuantizedCheckpoint
from fp4forge.checkpoint.reader import open_checkpoint
from fp4forge.quantize.act_scales import ConstantAmax
from fp4forge.quantize.export import QuantizeOptions, quantize_checkpoint
from fp4forge.quantize.recipe import parse_recipe

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

# What scripts/lc_export.py quantizes: every Linear but lm_head, the router and Laguna's g_proj.
LIKE_LLM_COMPRESSOR = """
name = "like-llm-compressor-nvfp4"
[[rules]]
components = ["routed_experts", "shared_expert", "attention", "dense_mlp"]
scheme = "nvfp4"
ignore = ['re:.*\\.self_attn\\.g_proj$']
"""


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


@pytest.fixture(scope="module")
def ours_like_lc(lc_source_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("oracle") / "fp4forge-nvfp4"
    quantize_checkpoint(lc_source_dir, out, QuantizeOptions(parse_recipe(LIKE_LLM_COMPRESSOR), act_amax=ConstantAmax(8.0)))
    return out


def test_dequantization_equals_compressed_tensors_dequantizer(vllm_venv, ours_like_lc, tmp_path):
    """compressed-tensors' own `convert_checkpoint(CompressedTensorsDequantizer)` and fp4forge's
    dequantization give the same bf16 bits for every NVFP4 Linear."""
    out = tmp_path / "ct-dequantized"
    proc = subprocess.run(
        [str(vllm_venv / "bin" / "python"), str(REPO / "scripts" / "ct_dequantize.py"), str(ours_like_lc), str(out)],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    ours, reference = open_checkpoint(ours_like_lc), open_checkpoint(out)
    modules = [i.name[: -len(".weight_packed")] for _, i in ours.tensors() if i.name.endswith(".weight_packed")]
    assert len(modules) == 4 * 4 + 3 + 3 * (3 * 16 + 3)  # attention, dense layer 0, experts + shared
    view = QuantizedCheckpoint(ours, "compressed-tensors")
    for module in modules:
        assert same_bits(view.dequantize(module), reference.read_tensor(f"{module}.weight")), module


def test_weights_byte_identical_to_llm_compressor_nvfp4(ours_like_lc, lc_nvfp4_kv_dir):
    """With the min-max rule, weight_packed / weight_scale / weight_global_scale equal
    llm-compressor's, tensor for tensor (fused q/k/v and gate/up global scales included).
    input_global_scale is not compared: llm-compressor's comes from its calibration, ours here
    from a constant."""
    ours, theirs = open_checkpoint(ours_like_lc), open_checkpoint(lc_nvfp4_kv_dir)
    compared = 0
    for _, info in theirs.tensors():
        if info.name.endswith((".weight_packed", ".weight_scale", ".weight_global_scale")):
            assert same_bits(ours.read_tensor(info.name), theirs.read_tensor(info.name)), info.name
            compared += 1
    assert compared == 3 * (4 * 4 + 3 + 3 * (3 * 16 + 3))
    untouched = [i.name for _, i in theirs.tensors() if i.dtype == "BF16" and not i.name.endswith(("k_scale", "v_scale"))]
    for name in untouched:
        assert same_bits(ours.read_tensor(name), theirs.read_tensor(name)), name
