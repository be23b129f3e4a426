"""The stacked NVFP4 pass (GPU export path) against the per-weight quantizer: same bytes."""

from __future__ import annotations

import math

import pytest
import torch

from fp4forge.numerics.nvfp4 import absmax, nvfp4_quantize_stacked
from fp4forge.numerics.scale_search import search_nvfp4


@pytest.mark.parametrize("convention", ["compressed-tensors", "modelopt"])
@pytest.mark.parametrize("group", [1, 2])
def test_stacked_pass_gives_each_slice_the_per_weight_bytes(convention: str, group: int) -> None:
    generator = torch.Generator().manual_seed(0)
    w = (torch.randn(6, 40, 64, generator=generator) * 0.02).to(torch.bfloat16)
    w[1, 3, :16] = 0  # an all-zero block (CT's 0.125 scale)
    w[2] *= 1e-30  # a tiny slice: its own global scale, far from the others'
    w[4, 0, 0] = 3.0  # one outlier: a large global amax for slice 4 (and its group)
    stacked = nvfp4_quantize_stacked(w, convention=convention, group=group, error=True, chunk_elements=1000)  # chunks straddle slices
    assert stacked.finite.all() and stacked.regular.all()
    for i in range(w.shape[0]):
        first = i // group * group
        group_amax = max(float(absmax(w[j])) for j in range(first, first + group))
        one = search_nvfp4(w[i], convention=convention, global_amax=torch.tensor(group_amax, dtype=w.dtype))
        q = stacked.weight(i)
        assert torch.equal(q.packed, one.weight.packed)
        assert torch.equal(q.block_scale.view(torch.uint8), one.weight.block_scale.view(torch.uint8))
        assert q.global_scale.shape == one.weight.global_scale.shape and torch.equal(q.global_scale, one.weight.global_scale)
        ref = float(stacked.ref_sq[i])
        rel = math.sqrt(float(stacked.err_sq[i]) / ref) if ref else 0.0
        assert rel == pytest.approx(one.relative_error, rel=1e-5)


def test_stacked_pass_flags_non_finite_slices_without_raising() -> None:
    w = torch.ones(3, 2, 16, dtype=torch.bfloat16)
    w[1, 1, 5] = float("nan")
    stacked = nvfp4_quantize_stacked(w)
    assert stacked.finite.tolist() == [True, False, True]
