"""GPTQ numerics: exact against round-to-nearest where no error can move (H diagonal), better
than it on the output error where inputs correlate, and always on the format's own grid."""

from __future__ import annotations

import pytest
import torch

from fp4forge.errors import NumericsError
from fp4forge.numerics import E2M1_VALUES, fp4_bytes_to_values, intn_quantize, mxfp4_quantize, nvfp4_quantize
from fp4forge.numerics.gptq import HessianAccumulator, gptq_quantize, gptq_quantize_batch, output_error


def _weight(n=32, k=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.02
    w[0, 5] = 0.2  # an outlier, as real weights have
    return w


def _correlated_inputs(k=128, tokens=2048, seed=1):
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(k, k, generator=g) / k**0.5 + torch.eye(k)
    scale = torch.exp(torch.randn(k, generator=g))  # channels of very different size
    return (torch.randn(tokens, k, generator=g) @ mix) * scale


def _rtn(w, fmt, group_size=None):
    if fmt == "nvfp4":
        return nvfp4_quantize(w)
    if fmt == "mxfp4":
        return mxfp4_quantize(w)
    return intn_quantize(w, int(fmt[3:]), group_size=group_size, symmetric=True)


def _same_tensors(a, b):
    if hasattr(a, "packed"):
        assert torch.equal(a.packed, b.packed)
        if hasattr(a, "block_scale"):
            assert torch.equal(a.block_scale.view(torch.uint8), b.block_scale.view(torch.uint8))
            assert torch.equal(a.global_scale, b.global_scale)
        else:
            assert torch.equal(a.scale, b.scale)
    else:
        assert torch.equal(a.q, b.q)
        assert torch.equal(a.scale, b.scale)


CASES = [("nvfp4", None), ("mxfp4", None), ("int4", 32), ("int3", None), ("int8", 64)]


@pytest.mark.parametrize("fmt,group_size", CASES)
def test_identity_hessian_is_round_to_nearest(fmt, group_size):
    w = _weight()
    res = gptq_quantize(w, torch.eye(w.shape[1]), fmt, group_size=group_size)
    _same_tensors(res.quantized, _rtn(w, fmt, group_size))
    assert not res.fallback


@pytest.mark.parametrize("fmt,group_size", [("nvfp4", None), ("int4", 32)])
def test_diagonal_hessian_with_act_order_is_round_to_nearest(fmt, group_size):
    # a diagonal H moves no error in any order, so the permuted sweep must land on RTN exactly:
    # this checks the permutation and its inverse, and the per-column group lookup
    w = _weight(seed=3)
    h = torch.diag(torch.rand(w.shape[1], generator=torch.Generator().manual_seed(4)) + 0.1)
    res = gptq_quantize(w, h, fmt, group_size=group_size, act_order=True, block_size=48)
    _same_tensors(res.quantized, _rtn(w, fmt, group_size))


def test_dynamic_scales_with_identity_hessian_are_round_to_nearest():
    w = _weight(seed=5)
    res = gptq_quantize(w, torch.eye(w.shape[1]), "nvfp4", scale_mode="dynamic")
    _same_tensors(res.quantized, nvfp4_quantize(w))


@pytest.mark.parametrize("fmt,group_size", CASES)
@pytest.mark.parametrize("act_order", [False, True])
def test_correlated_inputs_lower_output_error_than_rtn(fmt, group_size, act_order):
    w = _weight()
    x = _correlated_inputs()
    h = x.T @ x / x.shape[0]
    res = gptq_quantize(w, h, fmt, group_size=group_size, act_order=act_order)
    rtn = _rtn(w, fmt, group_size).dequantize(torch.float32)
    # ||(W - Q) X^T||^2 on the calibration tokens, computed directly (not through H)
    gptq_err = float(((w - res.dequantized) @ x.T).pow(2).sum())
    rtn_err = float(((w - rtn) @ x.T).pow(2).sum())
    assert gptq_err < 0.8 * rtn_err, (gptq_err, rtn_err)
    assert output_error(w, res.dequantized, h) == pytest.approx(gptq_err / x.shape[0], rel=1e-3)


def test_dynamic_scales_also_beat_rtn():
    w = _weight()
    x = _correlated_inputs()
    h = x.T @ x / x.shape[0]
    res = gptq_quantize(w, h, "nvfp4", scale_mode="dynamic")
    assert output_error(w, res.dequantized, h) < 0.8 * output_error(w, nvfp4_quantize(w).dequantize(torch.float32), h)


def test_nvfp4_codes_are_on_the_grid():
    w = _weight()
    x = _correlated_inputs()
    res = gptq_quantize(w, x.T @ x / x.shape[0], "nvfp4", act_order=True)
    q = res.quantized
    assert q.block_scale.dtype == torch.float8_e4m3fn and q.packed.dtype == torch.uint8
    # the per-tensor scalar is the original weight's (2688 / amax), fixed before the sweep
    assert torch.equal(q.global_scale, nvfp4_quantize(w).global_scale)
    step = (q.block_scale.float() / q.global_scale).repeat_interleave(16, dim=1)
    values = (res.dequantized / step).abs()
    grid = torch.tensor(E2M1_VALUES)
    assert bool(torch.isclose(values.unsqueeze(-1), grid).any(-1).all())
    # quantizing the result again with the same scales reproduces the same values (a code 8,
    # -0, comes back as +0: equal as values)
    again = nvfp4_quantize(res.dequantized, global_scale=q.global_scale, block_scale=q.block_scale)
    assert torch.equal(fp4_bytes_to_values(again.packed), fp4_bytes_to_values(q.packed))


def test_int_codes_are_in_range():
    w = _weight()
    x = _correlated_inputs()
    res = gptq_quantize(w, x.T @ x / x.shape[0], "int3", group_size=64)
    assert res.quantized.q.dtype == torch.int8
    assert int(res.quantized.q.min()) >= -4 and int(res.quantized.q.max()) <= 3


def test_global_amax_of_a_fused_group_is_used():
    w = _weight()
    res = gptq_quantize(w, torch.eye(128), "nvfp4", global_amax=1.0)
    _same_tensors(res.quantized, nvfp4_quantize(w, global_amax=1.0))


def test_indefinite_hessian_falls_back_to_rtn():
    w = _weight()
    h = -torch.eye(128)
    h[0, 0] = 1.0
    res = gptq_quantize(w, h, "nvfp4")
    assert res.fallback
    _same_tensors(res.quantized, nvfp4_quantize(w))


def test_hessian_accumulator_matches_direct_product():
    x = _correlated_inputs(k=32, tokens=300)
    acc = HessianAccumulator(32)
    acc.add(x[:100].reshape(10, 10, 32))
    acc.add(x[100:])
    acc.add(x[:0])
    assert acc.count == 300
    torch.testing.assert_close(acc.hessian(), x.T @ x / 300, rtol=1e-5, atol=1e-5)
    other = HessianAccumulator(32)
    other.add(x[:50])
    acc.merge(other)
    assert acc.count == 350
    both = torch.cat([x, x[:50]])
    torch.testing.assert_close(acc.hessian(), both.T @ both / 350, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(fmt="fp5"),
        dict(fmt="nvfp4", group_size=32),
        dict(fmt="int4", group_size=48),
        dict(fmt="nvfp4", hessian=torch.eye(64)),
        dict(fmt="nvfp4", damp=0.0),
        dict(fmt="nvfp4", act_order=True, scale_mode="dynamic"),
        dict(fmt="mxfp4", global_amax=1.0),
    ],
)
def test_bad_options_are_named_errors(kwargs):
    w = _weight()
    h = kwargs.pop("hessian", torch.eye(128))
    with pytest.raises(NumericsError):
        gptq_quantize(w, h, **kwargs)


def test_nan_weight_is_refused():
    w = _weight()
    w[3, 3] = float("nan")
    with pytest.raises(NumericsError):
        gptq_quantize(w, torch.eye(128), "nvfp4")


@pytest.mark.parametrize("fmt,group_size,act_order", [("nvfp4", None, True), ("mxfp4", None, False), ("int4", 32, True)])
def test_batch_equals_one_at_a_time(fmt, group_size, act_order):
    ws = torch.stack([_weight(seed=s) for s in range(3)])
    xs = [_correlated_inputs(seed=10 + s, tokens=512) for s in range(3)]
    hs = torch.stack([x.T @ x / x.shape[0] for x in xs])
    batch = gptq_quantize_batch(ws, hs, fmt, group_size=group_size, act_order=act_order)
    for b in range(3):
        alone = gptq_quantize(ws[b], hs[b], fmt, group_size=group_size, act_order=act_order)
        _same_tensors(batch[b].quantized, alone.quantized)
