"""The NVFP4 "mse" scale search against brute-force oracles on tiny tensors.

The oracles do not use fp4forge's rounding: the E2M1 magnitudes are written out, each element
goes to its nearest magnitude by argmin in F64, and every positive finite E4M3 code (bit patterns
0x01 .. 0x7E) is tried as a block scale. CT's dequantization is ``code * e4m3 / global_scale``.
"""

from __future__ import annotations

import pytest
import torch

from fp4forge.numerics.nvfp4 import nvfp4_global_scale
from fp4forge.numerics.scale_search import MSE_GLOBAL_STEPS, nvfp4_mse_global_scale, search_nvfp4

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)
E4M3_CODES = torch.arange(1, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float64)  # every positive finite value


def _best_block_errors(w: torch.Tensor, g: float) -> torch.Tensor:
    """Per 16-block, the lowest squared error over every E4M3 scale code: ``[rows, blocks]``."""
    a = w.to(torch.float64).abs().unflatten(-1, (-1, 16))  # [R, B, 16]
    step = E4M3_CODES / g  # [C]
    x = a.unsqueeze(-1) / step  # [R, B, 16, C]
    nearest = (x.unsqueeze(-1) - E2M1).abs().argmin(dim=-1)  # [R, B, 16, C]
    err = ((E2M1[nearest] * step - a.unsqueeze(-1)) ** 2).sum(dim=-2)  # [R, B, C]
    return err.min(dim=-1).values


def _block_errors(w: torch.Tensor, result) -> torch.Tensor:
    d = result.weight.dequantize(torch.float64) - w.to(torch.float64)
    return (d * d).unflatten(-1, (-1, 16)).sum(-1)


def _gauss(shape, seed):
    return (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 0.02).to(torch.bfloat16)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_mse_block_scale_matches_a_brute_force_over_every_e4m3_code(seed):
    w = _gauss((6, 64), seed)
    g = nvfp4_global_scale(w.abs().max())
    r = search_nvfp4(w, "mse", global_scale=g)
    best = _best_block_errors(w, float(g))
    assert torch.allclose(_block_errors(w, r), best, rtol=1e-5, atol=1e-18)
    # and never worse than min-max on any block
    mm = search_nvfp4(w, "minmax")
    assert bool((_block_errors(w, r) <= _block_errors(w, mm) * (1 + 1e-9)).all())


def test_mse_global_scale_is_the_best_of_its_candidates():
    w = _gauss((2, 128), 5)
    g0 = float(nvfp4_global_scale(w.abs().max()))
    # oracle: total brute-force error at each candidate scalar g0 * 2**(-t/steps)
    totals = [float(_best_block_errors(w, g0 * 2.0 ** (-t / MSE_GLOBAL_STEPS)).sum()) for t in range(MSE_GLOBAL_STEPS)]
    chosen = search_nvfp4(w, "mse")
    assert float(chosen.weight.global_scale) == pytest.approx(g0 * 2.0 ** (-totals.index(min(totals)) / MSE_GLOBAL_STEPS), rel=1e-6)
    assert chosen.err_sq == pytest.approx(min(totals), rel=1e-5)
    fixed = search_nvfp4(w, "mse", mse_global_steps=1)
    assert float(fixed.weight.global_scale) == g0
    assert chosen.err_sq <= fixed.err_sq <= search_nvfp4(w, "minmax").err_sq


def test_fused_group_shares_the_searched_scalar():
    a, b = _gauss((8, 64), 7), _gauss((8, 64), 8) * 3
    amax = torch.maximum(a.abs().max(), b.abs().max())
    g = nvfp4_mse_global_scale([a, b], global_amax=amax)
    g0 = nvfp4_global_scale(amax)
    ratio = float(g0 / g)
    assert any(ratio == pytest.approx(2.0 ** (t / MSE_GLOBAL_STEPS), rel=1e-6) for t in range(MSE_GLOBAL_STEPS))
    together = sum(search_nvfp4(x, "mse", global_scale=g).err_sq for x in (a, b))
    assert together <= sum(search_nvfp4(x, "mse", global_scale=g0).err_sq for x in (a, b))
    # ModelOpt's scale_2 moves the other way (it multiplies the step)
    s2 = nvfp4_mse_global_scale([a, b], global_amax=amax, convention="modelopt")
    assert float(s2) * float(g0) == pytest.approx(ratio, rel=1e-3)  # the same step t; g0 divides in bf16


def test_gptq_with_an_identity_hessian_reproduces_the_mse_search():
    # no coupling between columns: GPTQ is round-to-nearest on the grid it is given
    from fp4forge.numerics.gptq import gptq_quantize

    w = _gauss((8, 64), 9)
    r = search_nvfp4(w, "mse")
    q = gptq_quantize(w, torch.eye(64), "nvfp4", block_scale=r.weight.block_scale, global_scale=r.weight.global_scale).quantized
    assert torch.equal(q.packed, r.weight.packed)
    assert torch.equal(q.block_scale.view(torch.uint8), r.weight.block_scale.view(torch.uint8))
    assert float(q.global_scale) == float(r.weight.global_scale)
