"""fidelity.reference's routed experts, computed for every (token, expert) pair at once, against the
expert-by-expert definition: each expert's tokens fake-quantized with that expert's input global
scale, its GEMMs, and the outputs added expert after expert. Bit for bit, in F32 and BF16."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fp4forge.fidelity.reference import routed_experts_forward
from fp4forge.numerics.nvfp4 import nvfp4_fake_quantize_activation


def _expert_by_expert(hidden, top_k_index, top_k_weights, gate_up, down, gs):  # type: ignore[no-untyped-def]
    out = torch.zeros_like(hidden)
    intermediate = gate_up.shape[1] // 2
    for expert in torch.unique(top_k_index).tolist():
        tokens, slots = torch.where(top_k_index == expert)
        h = F.linear(nvfp4_fake_quantize_activation(hidden[tokens], gs["w13"][expert : expert + 1]), gate_up[expert])
        h = F.silu(h[:, :intermediate]) * h[:, intermediate:]
        h = F.linear(nvfp4_fake_quantize_activation(h, gs["w2"][expert : expert + 1]), down[expert])
        out.index_add_(0, tokens, (h * top_k_weights[tokens, slots, None]).to(out.dtype))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_all_pairs_at_once_equal_expert_by_expert(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(0)
    experts, top_k, hidden_size, intermediate, tokens = 6, 3, 32, 16, 11
    gate_up = torch.randn(experts, 2 * intermediate, hidden_size, generator=generator).to(dtype)
    down = torch.randn(experts, hidden_size, intermediate, generator=generator).to(dtype)
    gs = {gemm: 2688.0 / (1 + 4 * torch.rand(experts, generator=generator)) for gemm in ("w13", "w2")}
    hidden = torch.randn(tokens, hidden_size, generator=generator).to(dtype)
    # distinct experts per token, expert 5 never chosen (an unused expert)
    top_k_index = torch.stack([torch.randperm(experts - 1, generator=generator)[:top_k] for _ in range(tokens)])
    top_k_weights = torch.rand(tokens, top_k, generator=generator)

    forward = routed_experts_forward(gate_up, down, lambda h, rows, gemm: nvfp4_fake_quantize_activation(h, gs[gemm][rows][:, None, None]))
    found = forward(hidden, top_k_index, top_k_weights)
    expected = _expert_by_expert(hidden, top_k_index, top_k_weights, gate_up, down, gs)
    assert found.dtype == dtype and torch.equal(found, expected)
    single = forward(hidden[:1], top_k_index[:1], top_k_weights[:1])  # one token: a decode step
    assert torch.equal(single, _expert_by_expert(hidden[:1], top_k_index[:1], top_k_weights[:1], gate_up, down, gs))
