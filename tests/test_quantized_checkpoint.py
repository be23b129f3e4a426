"""``QuantizedCheckpoint`` on hand-built checkpoints, against values computed by hand (numpy F32
for the roundings): scheme detection, dequantization in both NVFP4 formulas, input amax in both
layouts, fused groups, vLLM's per-GEMM collapse, and KV scales. The file-level oracle
(compressed-tensors' own dequantizer) is in ``test_quantize_oracles.py``."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from fp4forge.checkpoint.quantized import QuantizedCheckpoint
from fp4forge.checkpoint.reader import open_checkpoint
from fp4forge.errors import ConfigError

F32 = np.float32
E4M3 = torch.float8_e4m3fn
LAGUNA = {"architectures": ["LagunaForCausalLM"], "model_type": "laguna"}

# Two rows of 16 E2M1 codes: row 0 all code 2 (= 1.0); row 1 alternating code 7 (= 6.0) and
# code 9 (= -0.5). Element 2i sits in the low nibble.
PACKED = torch.tensor([[0x22] * 8, [0x97] * 8], dtype=torch.uint8)
ROW_VALUES = ([1.0] * 16, [6.0, -0.5] * 8)


def _write(tmp_path: Path, tensors: dict[str, torch.Tensor], name: str = "ckpt") -> Path:
    root = tmp_path / name
    root.mkdir()
    save_file({k: v.clone().contiguous() for k, v in tensors.items()}, str(root / "model.safetensors"))
    (root / "config.json").write_text(json.dumps(LAGUNA))
    return root


def _nvfp4(module: str, block: tuple[float, float], scalar: float, layout: str, input_scalar: float | None) -> dict[str, torch.Tensor]:
    scales = torch.tensor([[block[0]], [block[1]]], dtype=torch.float32).to(E4M3)
    if layout == "compressed-tensors":
        out = {f"{module}.weight_packed": PACKED, f"{module}.weight_scale": scales, f"{module}.weight_global_scale": torch.tensor([scalar], dtype=torch.float32)}
        if input_scalar is not None:
            out[f"{module}.input_global_scale"] = torch.tensor([input_scalar], dtype=torch.float32)
        return out
    out = {f"{module}.weight": PACKED, f"{module}.weight_scale": scales, f"{module}.weight_scale_2": torch.tensor(scalar, dtype=torch.float32)}
    if input_scalar is not None:
        out[f"{module}.input_scale"] = torch.tensor(input_scalar, dtype=torch.float32)
    return out


def _expected_nvfp4(block: tuple[float, float], step: list) -> np.ndarray:
    return np.array([[F32(v) * step[r] for v in ROW_VALUES[r]] for r in range(2)], dtype=np.float32)


def test_nvfp4_compressed_tensors_both_formulas(tmp_path):
    """CT decompress divides by the global scale, vLLM multiplies by its F32 reciprocal: with a
    block scale of 3 and a global scale of 7 the two differ in the last bit."""
    m = "model.layers.0.mlp.experts.0.gate_proj"
    view = QuantizedCheckpoint(open_checkpoint(_write(tmp_path, _nvfp4(m, (3.0, 6.0), 7.0, "compressed-tensors", 336.0))), "compressed-tensors")
    assert view.scheme(m) == "nvfp4"
    divide = _expected_nvfp4((3.0, 6.0), [F32(3) / F32(7), F32(6) / F32(7)])
    multiply = _expected_nvfp4((3.0, 6.0), [F32(3) * (F32(1) / F32(7)), F32(6) * (F32(1) / F32(7))])
    assert not np.array_equal(divide, multiply)  # the test can tell the formulas apart
    assert np.array_equal(view.dequantize(m, torch.float32).numpy(), divide)
    assert np.array_equal(view.dequantize(m, torch.float32, formula="multiply").numpy(), multiply)
    assert view.input_amax(m) == 2688.0 / 336.0 == 8.0
    assert view.shapes()[f"{m}.weight"] == (2, 16)


def test_nvfp4_modelopt_and_input_amax(tmp_path):
    m = "model.layers.0.self_attn.q_proj"
    scale_2 = float(F32(8.0) / F32(2688.0))
    view = QuantizedCheckpoint(open_checkpoint(_write(tmp_path, _nvfp4(m, (3.0, 0.5), 0.25, "modelopt", scale_2))), "modelopt")
    assert view.scheme(m) == "nvfp4"
    expected = _expected_nvfp4((3.0, 0.5), [F32(3) * F32(0.25), F32(0.5) * F32(0.25)])
    assert np.array_equal(view.dequantize(m, torch.float32).numpy(), expected)
    assert view.input_amax(m) == scale_2 * 2688.0
    assert view.input_amax(m) == pytest.approx(8.0, rel=1e-6)


def test_schemes_fp8_dynamic_weight_only_and_unquantized(tmp_path):
    w = torch.tensor([[1.0, -2.0], [0.5, 4.0]]).to(E4M3)
    tensors = {
        "a.weight": w, "a.weight_scale": torch.tensor([0.5], dtype=torch.bfloat16), "a.input_scale": torch.tensor([0.25], dtype=torch.bfloat16),
        "d.weight": w, "d.weight_scale": torch.tensor([[0.5], [3.0]], dtype=torch.bfloat16),
        "n.weight": torch.ones(2, 2, dtype=torch.bfloat16),
        **{k: v for k, v in _nvfp4("w16", (1.0, 1.0), 1.0, "compressed-tensors", None).items()},
    }
    view = QuantizedCheckpoint(open_checkpoint(_write(tmp_path, tensors)), "compressed-tensors")
    assert [view.scheme(m) for m in ("a", "d", "n", "w16")] == ["fp8", "fp8_dynamic", "unquantized", "nvfp4a16"]
    assert view.dequantize("a", torch.float32).tolist() == [[0.5, -1.0], [0.25, 2.0]]
    assert view.dequantize("d", torch.float32).tolist() == [[0.5, -1.0], [1.5, 12.0]]  # per row
    assert view.input_amax("a") == 0.25 * 448
    assert view.input_amax("d") is None and view.input_amax("w16") is None and view.input_amax("n") is None
    assert view.dequantize("n", torch.float32).tolist() == [[1.0, 1.0], [1.0, 1.0]]
    assert set(view.shapes()) == {"a.weight", "d.weight", "n.weight", "w16.weight"}
    with pytest.raises(ConfigError):
        view.served_linear("n")


def test_fused_fp8_shards_requantized_to_the_largest_scale(tmp_path):
    """vLLM's per-GEMM view: q (scale 0.75) is requantized to the group's max scale 1.0: 1.125 * 0.75
    = 0.84375 lies halfway between E4M3 0.8125 and 0.875 and rounds to the even mantissa, 0.875."""
    p = "model.layers.0.self_attn"
    w = torch.tensor([[1.125, 2.0]]).to(E4M3)
    tensors = {}
    for leaf, scale, inp in (("q_proj", 0.75, 0.5), ("k_proj", 1.0, 2.0), ("v_proj", 0.5, 1.0)):
        tensors |= {f"{p}.{leaf}.weight": w, f"{p}.{leaf}.weight_scale": torch.tensor([scale]), f"{p}.{leaf}.input_scale": torch.tensor([inp])}
    view = QuantizedCheckpoint(open_checkpoint(_write(tmp_path, tensors)), "compressed-tensors")
    assert view.fused_partners(f"{p}.k_proj") == [f"{p}.q_proj", f"{p}.k_proj", f"{p}.v_proj"]
    assert view.dequantize(f"{p}.q_proj", torch.float32).tolist() == [[0.84375, 1.5]]
    served = view.served_linear(f"{p}.q_proj")
    assert served.family == "fp8"
    assert served.weight.tolist() == [[0.875, 1.5]]
    assert served.act_scale.tolist() == [2.0]
    alone = view.served_linear(f"{p}.q_proj", groups=())  # not fused: the module's own scale
    assert alone.weight.tolist() == [[0.84375, 1.5]] and alone.act_scale.tolist() == [0.5]


def test_served_nvfp4_group_and_experts(tmp_path):
    """A fused NVFP4 GEMM takes the largest amax/(6*448) multiplier (CT: the smallest global
    scale); an expert's up_proj is dequantized with its gate's multiplier (vLLM's w13)."""
    p = "model.layers.0.self_attn"
    e = "model.layers.1.mlp.experts"
    tensors = {}
    tensors |= _nvfp4(f"{p}.q_proj", (1.0, 1.0), 8.0, "compressed-tensors", 336.0)
    tensors |= _nvfp4(f"{p}.k_proj", (1.0, 1.0), 4.0, "compressed-tensors", 168.0)
    tensors |= _nvfp4(f"{e}.0.gate_proj", (1.0, 1.0), 4.0, "compressed-tensors", 336.0)
    tensors |= _nvfp4(f"{e}.0.up_proj", (1.0, 1.0), 2.0, "compressed-tensors", 168.0)
    tensors |= _nvfp4(f"{e}.0.down_proj", (1.0, 1.0), 8.0, "compressed-tensors", 84.0)
    view = QuantizedCheckpoint(open_checkpoint(_write(tmp_path, tensors)), "compressed-tensors")
    q = view.served_linear(f"{p}.q_proj")
    assert q.weight.tolist() == [[v / 4.0 for v in row] for row in ROW_VALUES]  # k's 1/4 > q's 1/8
    assert q.act_scale.tolist() == [F32(1) / (F32(1) / F32(168))]  # 1 / max(1/336, 1/168), in F32
    experts = view.served_experts(e, 1)
    assert experts.gate_up[0].tolist() == [[v / 4.0 for v in row] for row in ROW_VALUES * 2]  # up with gate's 1/4, not its 1/2
    assert experts.down[0].tolist() == [[v / 8.0 for v in row] for row in ROW_VALUES]
    assert experts.gate_up_amax.tolist() == [[F32(1) / F32(336), F32(1) / F32(168)]]
    assert experts.down_amax.tolist() == [F32(1) / F32(84)]


@pytest.mark.parametrize("layout, on", [("compressed-tensors", "self_attn"), ("modelopt", "self_attn.{r}_proj")])
def test_kv_scales_in_either_layout(tmp_path, layout, on):
    tensors = {}
    for r, value in (("k", 0.5), ("v", 0.125)):
        where = on.format(r=r)
        tensors[f"model.layers.0.{where}.{r}_scale"] = torch.tensor([value] if layout == "compressed-tensors" else value, dtype=torch.float32)
    tensors["model.layers.0.self_attn.k_proj.weight"] = torch.ones(2, 2)
    view = QuantizedCheckpoint(open_checkpoint(_write(tmp_path, tensors)), layout)
    scales = view.kv_scales(["model.layers.0", "model.layers.1"])
    assert set(scales) == {"model.layers.0"}
    assert {role: t.tolist() for role, t in scales["model.layers.0"].items()} == {"k_scale": [0.5], "v_scale": [0.125]}
    assert view.scheme("model.layers.0.self_attn.k_proj") == "unquantized"  # k_scale beside a BF16 weight is not a scheme


def test_unknown_layout_is_a_named_error(tmp_path):
    with pytest.raises(ConfigError):
        QuantizedCheckpoint(open_checkpoint(_write(tmp_path, {"a.weight": torch.ones(1)})), "gguf")
