"""The fast E2M1 rounding / NVFP4 scale path against the formulas it replaced, kept here as the
reference: per-boundary comparisons for E2M1, ``abs().amax`` block maxima, the F32 round trip of
the compressed-tensors zero-scale rule, ``pack_fp4``'s strided packing and a separate dequantize
for the error. Bit for bit, over random and edge-case inputs (zeros, -0.0, subnormals, the
largest finite values, ties and their neighbours, every finite bf16 value)."""

from __future__ import annotations

import math

import pytest
import torch

from fp4forge.numerics import (
    e2m1_decode,
    e2m1_encode,
    error_sums,
    nvfp4_dequantize,
    nvfp4_global_scale,
    nvfp4_quantize,
    nvfp4_scale_2,
    pack_fp4,
    search_nvfp4,
)
from fp4forge.numerics.e2m1 import block_absmax, encode_packed_blocks, encode_packed_blocks_with_error
from fp4forge.numerics.nvfp4 import e4m3_to_f32

TIES = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
# (boundary, inclusive): the magnitude index is the number of boundaries |x| passes; the tie at an
# inclusive boundary goes up (to the even code), at an exclusive one it stays down
BOUNDARIES = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


# -- the replaced formulas -------------------------------------------------------------------------
def reference_encode(x: torch.Tensor) -> torch.Tensor:
    a = x.abs()
    mag = torch.zeros(x.shape, dtype=torch.uint8)
    for bound, inclusive in BOUNDARIES:
        mag += (a >= bound) if inclusive else (a > bound)
    return mag | ((x < 0).to(torch.uint8) << 3)


def reference_block_scales(w: torch.Tensor, convention: str, fp8_max: float) -> tuple[torch.Tensor, torch.Tensor]:
    amax_blk = w.unflatten(-1, (-1, 16)).abs().amax(dim=-1)
    amax = amax_blk.amax()
    if convention == "compressed-tensors":
        g = nvfp4_global_scale(amax, fp8_max=fp8_max)
        raw = g * (amax_blk / 6.0)
        s = raw.clamp(-448, 448).to(torch.float8_e4m3fn).to(torch.float32)
        s = torch.where(s == 0, torch.full_like(s, 0.125), s).to(torch.float8_e4m3fn)
        return s, g
    g = nvfp4_scale_2(amax, fp8_max=fp8_max)
    if float(g) == 0.0:
        g = torch.ones((), dtype=torch.float32)
    raw = amax_blk.float() / (6.0 * g)
    s = torch.where(raw == 0, torch.ones_like(raw), raw).clamp(2.0**-9, 448).to(torch.float8_e4m3fn)
    return s, g


def reference_quantize(w: torch.Tensor, convention: str = "compressed-tensors", fp8_max: float = 448.0):
    scale, g = reference_block_scales(w, convention, fp8_max)
    s32 = scale.to(torch.float32)
    step = s32 / g if convention == "compressed-tensors" else s32 * g
    codes = reference_encode(w.unflatten(-1, (-1, 16)) / step.unsqueeze(-1)).flatten(-2)
    return pack_fp4(codes), scale


def bits(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous().reshape(-1)
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


# -- inputs -----------------------------------------------------------------------------------------
def scaled_values() -> torch.Tensor:
    """Ties, grid points and their F32 neighbours, zeros, subnormals, the largest finite F32,
    a dense sample of every F32 pattern below 16, both signs."""
    t = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 7.0, 8.0, 12.0, 1e-45, 1e-40, 1.2e-38, 3.4e38, *TIES])
    up = torch.nextafter(t, torch.full_like(t, math.inf))
    down = torch.nextafter(t, torch.zeros_like(t))
    dense = torch.arange(0, 0x41800000, 9973, dtype=torch.int64).to(torch.int32).view(torch.float32)
    pos = torch.cat([t, up, down, dense])
    return torch.cat([pos, -pos, torch.tensor([math.inf, -math.inf])])


def every_finite_bf16() -> torch.Tensor:
    allb = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    finite = allb[torch.isfinite(allb)]
    return finite[: finite.numel() // 64 * 64].reshape(-1, 64)


def weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    z = torch.zeros(8, 64, dtype=torch.bfloat16)
    z[0, :16] = -0.0
    z[1, 3] = -1e-38
    z[2, :] = 9.2e-41  # bf16 subnormals
    z[3, 5] = 3.3e38
    z[4, :32] = torch.tensor(TIES * 4 + (6.0,) * 4, dtype=torch.bfloat16)
    return {
        "gauss": (torch.randn(64, 256, generator=g) * 0.02).to(torch.bfloat16),
        "heavy": (torch.randn(32, 128, generator=g) / torch.randn(32, 128, generator=g).abs().clamp_min(1e-3) * 1e-3).to(torch.bfloat16),
        "wide-exponents": (torch.randn(32, 128, generator=g) * torch.exp2(torch.randint(-120, 110, (32, 128), generator=g).float())).to(torch.bfloat16),
        "edges": z,
        "every-bf16": every_finite_bf16(),
        "f16": torch.randn(16, 64, generator=g).to(torch.float16),
        "f32-subnormal": torch.randn(16, 64, generator=g) * 1e-39,
    }


# -- tests ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_e2m1_encode_equals_the_boundary_formula(dtype):
    x = scaled_values()
    x = x.to(dtype) if dtype != torch.float64 else x.double()
    g = torch.Generator().manual_seed(0)
    x = torch.cat([x, (torch.randn(20000, generator=g) * 3).to(dtype)])
    assert torch.equal(e2m1_encode(x), reference_encode(x))
    nan = torch.tensor([math.nan, -math.nan], dtype=dtype)
    assert e2m1_encode(nan).tolist() == [0, 0]


@pytest.mark.parametrize("convention", ["compressed-tensors", "modelopt"])
@pytest.mark.parametrize("fp8_max", [448.0, 256.0])
def test_nvfp4_quantize_bytes_equal_the_replaced_pipeline(convention, fp8_max):
    for name, w in weights().items():
        q = nvfp4_quantize(w, convention=convention, fp8_max=fp8_max)
        packed, scale = reference_quantize(w, convention, fp8_max)
        assert torch.equal(bits(q.block_scale), bits(scale)), name
        assert torch.equal(q.packed, packed), name


def test_encode_packed_blocks_across_chunk_boundaries_and_error_sums():
    from fp4forge.numerics import e2m1

    w = weights()["heavy"]
    blocks = w.unflatten(-1, (-1, 16))
    step = (block_absmax(blocks).float() / 6).clamp_min(2.0**-20)
    want = pack_fp4(reference_encode(blocks / step.unsqueeze(-1)).flatten(-2))
    saved = e2m1.ENCODE_CHUNK_ELEMENTS_ONE_THREAD
    try:
        e2m1.ENCODE_CHUNK_ELEMENTS_ONE_THREAD = 3 * 128  # chunks of 3 rows, the last one short
        packed, err_sq, ref_sq = encode_packed_blocks_with_error(blocks, step)
    finally:
        e2m1.ENCODE_CHUNK_ELEMENTS_ONE_THREAD = saved
    assert torch.equal(packed, want) and torch.equal(encode_packed_blocks(blocks, step), want)
    dequantized = (e2m1_decode(reference_encode(blocks / step.unsqueeze(-1))) * step.unsqueeze(-1)).flatten(-2)
    want_err, want_ref = error_sums(w, dequantized)
    assert err_sq == pytest.approx(want_err, rel=1e-6) and ref_sq == pytest.approx(want_ref, rel=1e-6)


def test_a_zero_or_infinite_step_takes_the_general_path():
    blocks = torch.tensor([[[0.0] * 8 + [1.0] * 8], [[-2.0] * 16]])
    step = torch.tensor([[0.0], [math.inf]])
    want = pack_fp4(reference_encode(blocks / step.unsqueeze(-1)).flatten(-2))
    assert torch.equal(encode_packed_blocks(blocks, step), want)


@pytest.mark.parametrize("method", ["minmax", "four_over_six", "mse"])
def test_search_error_sums_come_from_the_quantize_pass(method):
    w = weights()["gauss"]
    r = search_nvfp4(w, method)
    err, ref = error_sums(w, nvfp4_dequantize(r.weight, torch.float32))
    assert r.err_sq == pytest.approx(err, rel=1e-6) and r.ref_sq == pytest.approx(ref, rel=1e-6)
    quiet = search_nvfp4(w, method, error=False)
    assert quiet.relative_error is None and quiet.err_sq is None and quiet.ref_sq is None
    assert torch.equal(quiet.weight.packed, r.weight.packed) and torch.equal(bits(quiet.weight.block_scale), bits(r.weight.block_scale))


def test_four_over_six_picks_what_the_comparison_formula_picks():
    w = weights()["heavy"]
    r = search_nvfp4(w, "four_over_six")
    # reference: per block, the lower squared error of max->6 and max->4 (x1.5), ties keep max->6
    amax_blk = w.unflatten(-1, (-1, 16)).abs().amax(dim=-1)
    g = nvfp4_global_scale(amax_blk.amax(), fp8_max=256.0)
    raw = g * (amax_blk / 6.0)

    def finish(x):
        s = x.clamp(-448, 448).to(torch.float8_e4m3fn).to(torch.float32)
        return torch.where(s == 0, torch.full_like(s, 0.125), s)

    a = w.unflatten(-1, (-1, 16)).float().abs()

    def block_err(s):
        eff = (s / g).unsqueeze(-1)
        d = e2m1_decode(reference_encode(a / eff)) * eff - a
        return (d * d).sum(-1)

    six, four = finish(raw), finish(raw * 1.5)
    want = torch.where(block_err(four) < block_err(six), four, six).to(torch.float8_e4m3fn)
    assert torch.equal(bits(r.weight.block_scale), bits(want))
    assert r.blocks_changed == int((bits(want) != bits(six.to(torch.float8_e4m3fn))).sum())


def test_block_absmax_and_e4m3_table_equal_torch():
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        x = torch.tensor([0.0, -0.0, 1.5, -2.0, 1e-7, -math.inf, 3.0, math.nan, 2.0, -5.0, 0.0, -0.0, 1.0, 1.0, 1.0, 1.0], dtype=dtype)
        x = torch.stack([x, x.nan_to_num(nan=0.0, posinf=1.0, neginf=-1.0), torch.full((16,), -0.0, dtype=dtype)])
        assert torch.equal(bits(block_absmax(x)), bits(x.abs().amax(dim=-1)))
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).reshape(16, 16)
    assert torch.equal(bits(e4m3_to_f32(codes)), bits(codes.to(torch.float32)))


def test_encoder_scratch_survives_switching_inference_mode():
    # The encoder reuses per-thread scratch tensors; GPTQ calls it under inference_mode and the
    # exporter outside it. A buffer made in one mode must not be written in place in the other
    # (torch refuses in-place updates of inference tensors outside inference_mode).
    w = torch.randn(64, 128, dtype=torch.bfloat16)
    with torch.inference_mode():
        inside = nvfp4_quantize(w)
    outside = nvfp4_quantize(w)
    assert torch.equal(inside.packed, outside.packed)
    assert torch.equal(inside.block_scale.view(torch.uint8), outside.block_scale.view(torch.uint8))
