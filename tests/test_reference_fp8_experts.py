"""fidelity.reference with FP8 W8A8 routed experts: one expert's output against a hand computation
from the export's own tensors (read with safetensors) and torch's float8_e4m3fn cast."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open

from fp4forge.testbed import build_tiny_laguna

MOE = "model.layers.1.mlp.experts"


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    out = {}
    for shard in sorted(directory.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as handle:
            out.update({name: handle.get_tensor(name) for name in handle.keys()})
    return out


def _e4m3(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (x / scale).clamp(-448, 448).to(torch.float8_e4m3fn).to(torch.float32) * scale


def _weight(t: dict[str, torch.Tensor], module: str, fused_scale: torch.Tensor | None = None) -> torch.Tensor:
    scale = t[f"{module}.weight_scale"].to(torch.float32)
    weight = t[f"{module}.weight"].to(torch.float32) * (scale if scale.numel() == 1 else scale.reshape(-1, 1))
    return _e4m3(weight, fused_scale) if fused_scale is not None and scale.numel() == 1 else weight


def test_fp8_experts_compute_their_dequantized_weights_on_fp8_inputs(tmp_path: Path) -> None:
    from fp4forge.fidelity.reference import load_reference
    from fp4forge.quantize.act_scales import ConstantAmax
    from fp4forge.quantize.export import QuantizeOptions, quantize_checkpoint
    from fp4forge.quantize.recipe import load_recipe

    source = build_tiny_laguna(tmp_path / "src", seed=0)
    export = tmp_path / "fp8"
    quantize_checkpoint(source, export, QuantizeOptions(load_recipe("fp8"), "compressed-tensors", act_amax=ConstantAmax(8.0)))
    model = load_reference(export, "w4a4")
    experts = dict(model.named_modules())[MOE]
    t = _tensors(export)
    count = len({name.split(".")[5] for name in t if name.startswith(MOE + ".") and name.split(".")[5].isdigit()})
    w13_in = torch.stack([t[f"{MOE}.{e}.{p}.input_scale"].float().max() for e in range(count) for p in ("gate_proj", "up_proj")]).max()
    w2_in = torch.stack([t[f"{MOE}.{e}.down_proj.input_scale"].float().max() for e in range(count)]).max()

    torch.manual_seed(0)
    hidden = torch.randn(5, model.config.hidden_size)
    expert = 3
    gate, up = (f"{MOE}.{expert}.{p}" for p in ("gate_proj", "up_proj"))
    shared = torch.maximum(t[f"{gate}.weight_scale"].float().max(), t[f"{up}.weight_scale"].float().max())
    h = F.linear(_e4m3(hidden, w13_in), torch.cat([_weight(t, gate, shared), _weight(t, up, shared)]))
    half = h.shape[1] // 2
    expected = F.linear(_e4m3(F.silu(h[:, :half]) * h[:, half:], w2_in), _weight(t, f"{MOE}.{expert}.down_proj"))

    with torch.no_grad():
        got = experts(hidden, torch.full((5, 1), expert), torch.ones(5, 1))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert got.abs().max() > 0  # the patched experts ran (a dense copy holds zero placeholders)
