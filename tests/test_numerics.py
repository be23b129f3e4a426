"""fp4forge.numerics against hand-worked examples, independent reference formulas and invariants.

The bit-exact comparisons with compressed-tensors / llm-compressor / vLLM live in
``test_numerics_reference.py``; this file needs nothing but torch and numpy.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fp4forge.errors import Fp4forgeError
from fp4forge.numerics import (
    E2M1_VALUES,
    NumericsError,
    absmax,
    ct_global_to_modelopt_scale_2,
    e2m1_decode,
    e2m1_encode,
    e2m1_round,
    e8m0_to_float,
    error_sums,
    e2m1_table,
    fp4_bytes_to_values,
    fp8_dequantize_weight,
    fp8_quantize_weight,
    intn_dequantize,
    intn_quantize,
    modelopt_scale_2_to_ct_global,
    mxfp4_dequantize,
    mxfp4_quantize,
    nvfp4_block_scales,
    nvfp4_dequantize,
    nvfp4_encode,
    nvfp4_fake_quantize_activation,
    nvfp4_global_scale,
    nvfp4_quantize,
    nvfp4_quantize_activation,
    nvfp4_scale_2,
    pack_fp4,
    relative_error,
    search_nvfp4,
    to_e4m3fn,
    to_e5m2,
    unpack_fp4,
)

TIES = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Small tensors: one torch thread is faster, and far faster on a busy 2-core machine."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def bits(t: torch.Tensor) -> torch.Tensor:
    """Raw bits of a tensor, for bit-exact comparisons (so -0.0 != 0.0 and NaN == NaN)."""
    t = t.contiguous()
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def assert_bits_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    assert torch.equal(bits(a), bits(b))


# -- an independent E2M1 reference: nearest grid point, ties to the even code ------------------------
def ref_e2m1_code(v: float) -> int:
    a = min(abs(v), 6.0)
    d = [abs(a - g) for g in E2M1_VALUES]
    best = min(d)
    idx = [i for i, di in enumerate(d) if di == best]
    mag = idx[0] if len(idx) == 1 else next(i for i in idx if i % 2 == 0)
    return mag | (8 if v < 0 else 0)


def dense_grid() -> torch.Tensor:
    """Every tie, its F32 neighbours, the grid points, specials and a sweep, both signs."""
    pts = [0.0, 1e-30, 0.1, 6.0, 6.5, 7.0, 1e30] + list(E2M1_VALUES) + list(TIES)
    t = torch.tensor(pts, dtype=torch.float32)
    up = torch.nextafter(t, torch.full_like(t, math.inf))
    down = torch.nextafter(t, torch.full_like(t, -math.inf))
    sweep = torch.linspace(0, 7, 2801)
    allp = torch.cat([t, up, down.clamp(min=0), sweep])
    return torch.cat([allp, -allp])


# -- E2M1 ---------------------------------------------------------------------------------------------
def test_e2m1_table_and_encode_matches_nearest_even_reference():
    assert e2m1_table().tolist() == [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]
    x = dense_grid()
    got = e2m1_encode(x).tolist()
    want = [ref_e2m1_code(v) for v in x.tolist()]
    assert got == want


def test_e2m1_ties_go_to_even_codes_by_hand():
    x = torch.tensor(TIES + tuple(-t for t in TIES))
    # 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4
    assert e2m1_round(x).tolist() == [0, 1, 1, 2, 2, 4, 4, -0.0, -1, -1, -2, -2, -4, -4]
    assert e2m1_encode(x).tolist() == [0, 2, 2, 4, 4, 6, 6, 8, 10, 10, 12, 12, 14, 14]


def test_e2m1_specials():
    x = torch.tensor([-0.0, 0.0, -0.1, 0.1, 7.0, -1e30, math.inf, -math.inf, math.nan])
    # -0.0 -> +0 (code 0); a small negative -> -0 (code 8); saturation at +-6; NaN -> 0
    assert e2m1_encode(x).tolist() == [0, 0, 8, 0, 7, 15, 7, 15, 0]
    assert bits(e2m1_decode(torch.tensor([8])))[0] == bits(torch.tensor([-0.0]))[0]


def test_pack_low_nibble_first_and_roundtrip():
    codes = torch.tensor([[1, 2, 15, 8]], dtype=torch.uint8)
    assert pack_fp4(codes).tolist() == [[0x21, 0x8F]]
    c = torch.randint(0, 16, (5, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    assert torch.equal(unpack_fp4(pack_fp4(c)), c)
    assert_bits_equal(fp4_bytes_to_values(pack_fp4(c)), e2m1_decode(c))
    with pytest.raises(NumericsError):
        pack_fp4(torch.zeros(3, dtype=torch.uint8))
    assert issubclass(NumericsError, Fp4forgeError)


# -- FP8 ------------------------------------------------------------------------------------------------
def test_fp8_casts_saturate_and_round_to_even():
    x = torch.tensor([1.0625, 1.1875, 500.0, -1e9, math.inf, -math.inf, 464.0, 2.0**-10, 3 * 2.0**-10])
    got = to_e4m3fn(x).float()
    # 1.0625 is halfway between 1 and 1.125 -> 1 (even); 1.1875 -> 1.25; +-448 saturation;
    # 2^-10 is halfway between 0 and the smallest subnormal 2^-9 -> 0; 3*2^-10 -> 2^-9*2 (even)
    assert got.tolist() == [1.0, 1.25, 448.0, -448.0, 448.0, -448.0, 448.0, 0.0, 2.0**-8]
    assert math.isnan(float(to_e4m3fn(torch.tensor([math.nan])).float()))
    e5 = torch.tensor([57344.0, 61440.0, 1e9, -1e9])
    assert to_e5m2(e5).float().tolist() == [57344.0, 57344.0, 57344.0, -57344.0]
    assert to_e5m2(e5, saturate=False).float().tolist()[1:] == [math.inf, math.inf, -math.inf]


def test_fp8_weight_by_hand():
    w = torch.tensor([[448.0, -224.0, 1.0, 0.0], [-2.0, 0.5, 0.25, -0.0]])
    q = fp8_quantize_weight(w)  # amax 448 -> scale 1.0, values already on the E4M3 grid
    assert q.scale.tolist() == [1.0] and q.scale.dtype == torch.float32
    assert q.weight.float().tolist() == w.tolist()
    assert bits(q.weight)[1, 3] == 0x00  # -0.0 becomes +0 (CT's symmetric zero point adds +0)
    c = fp8_quantize_weight(w, "channel")
    assert c.scale.tolist() == [[1.0], [float(torch.tensor(2.0) / 448)]]
    assert torch.equal(fp8_dequantize_weight(q), w)
    # all-zero weight: the scale becomes the dtype's eps (CT _get_dtype_eps)
    z = fp8_quantize_weight(torch.zeros(3, 4, dtype=torch.bfloat16))
    assert z.scale.tolist() == [torch.finfo(torch.bfloat16).eps]
    assert torch.equal(z.dequantize(torch.float32), torch.zeros(3, 4))


def test_fp8_shapes_and_row_chunks():
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(300, 200, generator=g) * 0.03).to(torch.bfloat16)
    t = fp8_quantize_weight(w, "tensor")
    assert t.scale.shape == (1,) and t.scale.dtype == torch.bfloat16
    assert fp8_quantize_weight(w, "channel").scale.shape == (300, 1)
    b = fp8_quantize_weight(w, "block")
    assert b.scale.shape == (3, 2) and b.weight.shape == (300, 200)
    # per-tensor: chunks with the whole tensor's amax equal the whole
    amax = absmax(w)
    parts = [fp8_quantize_weight(w[i : i + 77], amax=amax).weight for i in range(0, 300, 77)]
    assert_bits_equal(torch.cat(parts), t.weight)
    # per-channel: any chunks; block: chunks starting at multiples of 128 rows
    parts = [fp8_quantize_weight(w[i : i + 50], "channel").weight for i in range(0, 300, 50)]
    assert_bits_equal(torch.cat(parts), fp8_quantize_weight(w, "channel").weight)
    parts = [fp8_quantize_weight(w[i : i + 128], "block") for i in range(0, 300, 128)]
    assert_bits_equal(torch.cat([p.weight for p in parts]), b.weight)
    assert_bits_equal(torch.cat([p.scale for p in parts]), b.scale)
    # the error is what docs/quantization.md#expected-reconstruction-error gives for FP8 E4M3 (~2.6%)
    assert 0.015 < relative_error(w, b.dequantize(torch.float32)) < 0.035


def test_fp8_rejects_bad_input():
    with pytest.raises(NumericsError):
        fp8_quantize_weight(torch.tensor([[1.0, math.nan]]))
    with pytest.raises(NumericsError):
        fp8_quantize_weight(torch.zeros(2, 3, 4), "channel")
    with pytest.raises(NumericsError):
        fp8_quantize_weight(torch.zeros(2, 4), "channel", amax=1.0)


# -- NVFP4, compressed-tensors convention, by hand --------------------------------------------------------
def test_nvfp4_ct_by_hand():
    # amax = 2688 -> weight_global_scale = 2688 / 2688 = 1.
    # block 0: amax 2688 -> raw scale 1 * 2688/6 = 448 -> E4M3 448; elements / 448
    # block 1: amax 6 -> scale 1 -> elements as they are (incl. the ties 0.25 and 2.5)
    # block 2: all zero -> raw 0 -> E4M3 0 -> CT eps 0.125; codes 0
    # block 3: amax 6e-4 -> raw 1e-4 < 2^-10 -> E4M3 0 -> 0.125 -> every element rounds to 0
    #          (1e-4 and -1e-4 / 0.125 -> tiny -> codes 0 and 8)
    b0 = [2688.0, -1344.0, 448.0, 336.0] + [0.0] * 12  # /448 -> 6, -3, 1, 0.75
    b1 = [6.0, 0.25, 2.5, -2.5, 5.0, -0.0] + [0.0] * 10
    b2 = [0.0] * 16
    b3 = [6e-4, -1e-4] + [0.0] * 14
    w = torch.tensor([b0 + b1 + b2 + b3])
    q = nvfp4_quantize(w)
    assert q.global_scale.tolist() == [1.0] and q.global_scale.dtype == torch.float32
    assert q.block_scale.float().tolist() == [[448.0, 1.0, 0.125, 0.125]]
    codes = q.codes()[0].tolist()
    assert codes[:4] == [7, 13, 2, 2]  # 6, -3, 1, 0.75 -> 1 (tie to even)
    assert codes[16:22] == [7, 0, 4, 12, 6, 0]  # 6, 0.25->0, 2.5->2, -2.5->-2, 5->4, -0.0->+0
    assert codes[32:48] == [0] * 16
    assert codes[48:50] == [0, 8]
    assert q.packed[0, :2].tolist() == [0xD7, 0x22]  # low nibble = element 0
    assert q.shape == (1, 64)
    dq = q.dequantize(torch.float32)[0].tolist()
    assert dq[:4] == [2688.0, -1344.0, 448.0, 448.0]
    assert dq[16:21] == [6.0, 0.0, 2.0, -2.0, 4.0]
    assert dq[48:50] == [0.0, 0.0]


def test_nvfp4_ct_global_scale_rules():
    # computed in amax's dtype, then F32 [1]
    assert nvfp4_global_scale(torch.tensor(2.0)).tolist() == [1344.0]
    g_bf16 = nvfp4_global_scale(torch.tensor(0.0173, dtype=torch.bfloat16))
    assert g_bf16.dtype == torch.float32 and g_bf16.shape == (1,)
    assert float(g_bf16) == float((2688.0 / torch.tensor(0.0173, dtype=torch.bfloat16)).float())
    assert float(g_bf16) != float(2688.0 / torch.tensor(0.0173, dtype=torch.bfloat16).float())
    # 0, NaN, Inf and an overflowing tiny amax all give 1.0
    for a in (0.0, math.nan, 1e-39, 1e-38):
        assert nvfp4_global_scale(torch.tensor(a)).tolist() == [1.0], a
    assert nvfp4_global_scale(torch.tensor(math.inf)).tolist() == [0.0]  # 2688/inf = 0 (as CT)
    # fp16: 2688/amax overflows fp16 for amax < 2688/65504 -> 1.0 (a CT quirk, reproduced)
    assert nvfp4_global_scale(torch.tensor(0.01, dtype=torch.float16)).tolist() == [1.0]
    assert nvfp4_global_scale(torch.tensor(0.01, dtype=torch.float16), dtype=torch.float32).tolist() == [
        pytest.approx(268800.0, rel=1e-3)
    ]
    assert nvfp4_global_scale(torch.tensor(6.0), fp8_max=256.0).tolist() == [256.0]


def test_nvfp4_subnormal_block_scales_ct():
    # global amax 2688 (gs = 1); a block's raw scale = amax_blk / 6:
    #   2^-7 (normal is >= 2^-6, so subnormal) | 2^-9 (smallest subnormal) | 2^-10 (tie -> 0 -> 0.125)
    #   | 1.5 * 2^-10 (rounds up to 2^-9) | 2^-12 (-> 0 -> 0.125)
    amaxes = [2688.0, 6 * 2.0**-7, 6 * 2.0**-9, 6 * 2.0**-10, 6 * 1.5 * 2.0**-10, 6 * 2.0**-12]
    w = torch.zeros(1, 16 * len(amaxes))
    for i, a in enumerate(amaxes):
        w[0, 16 * i] = a
    s = nvfp4_quantize(w).block_scale.float()[0].tolist()
    assert s == [448.0, 2.0**-7, 2.0**-9, 0.125, 2.0**-9, 0.125]


# -- NVFP4, ModelOpt convention, by hand --------------------------------------------------------------
def test_nvfp4_modelopt_by_hand():
    # amax 2688 -> weight_scale_2 = 2688 / 2688 = 1 (F32 scalar)
    # block 0: amax 2688 -> 2688 / (6 * 1) = 448
    # block 1: amax 3 -> 0.5; elements / 0.5
    # block 2: zeros -> 1.0 (ModelOpt's zero rule)
    # block 3: amax 6e-5 -> 1e-5 -> clamped up to 2^-9 (no underflow to 0)
    b0 = [2688.0] + [0.0] * 15
    b1 = [3.0, -0.75, 0.125, 0.375] + [0.0] * 12  # /0.5 -> 6, -1.5, 0.25 (->0), 0.75 (->1)
    b2 = [0.0] * 16
    b3 = [6e-5, -6e-5] + [0.0] * 14
    w = torch.tensor([b0 + b1 + b2 + b3])
    q = nvfp4_quantize(w, convention="modelopt")
    assert q.global_scale.shape == () and float(q.global_scale) == 1.0
    assert q.block_scale.float().tolist() == [[448.0, 0.5, 1.0, 2.0**-9]]
    codes = q.codes()[0].tolist()
    assert codes[16:20] == [7, 11, 0, 2]
    assert codes[48:50] == [0, 8]  # 6e-5 / 2^-9 = 0.0307 -> 0; negative -> -0
    assert q.dequantize(torch.float32)[0, 16:20].tolist() == [3.0, -0.75, 0.0, 0.5]
    assert float(nvfp4_scale_2(torch.tensor(5376.0))) == 2.0


# -- NVFP4 against docs/formats.md#nvfp4-global-scale, written independently (numpy F32 + float64) --
def _fp8(x: float) -> float:
    return float(torch.tensor(x, dtype=torch.float32).to(torch.float8_e4m3fn).float())


def ref_nvfp4(w: np.ndarray, convention: str) -> tuple[list[int], list[float], float]:
    """Per-element loops on an F32 weight; returns (codes, block scales, global scalar)."""
    f32 = np.float32
    amax = f32(np.abs(w).max())
    if convention == "compressed-tensors":
        g = f32(2688.0) / max(amax, f32(np.finfo(np.float32).tiny))
        g = f32(1.0) if not np.isfinite(g) else g
    else:
        g = amax / f32(2688.0)
    codes, scales = [], []
    for row in w:
        for blk in row.reshape(-1, 16):
            ab = f32(np.abs(blk).max())
            if convention == "compressed-tensors":
                s = _fp8(float(min(g * (ab / f32(6.0)), f32(448.0))))
                s = 0.125 if s == 0.0 else s
                step = f32(s) / g
            else:
                raw = ab / (f32(6.0) * g)
                raw = f32(1.0) if raw == 0 else raw
                s = _fp8(float(min(max(raw, f32(2.0**-9)), f32(448.0))))
                step = f32(s) * g
            scales.append(s)
            codes += [ref_e2m1_code(float(f32(v) / step)) for v in blk]
    return codes, scales, float(g)


@pytest.mark.parametrize("convention", ["compressed-tensors", "modelopt"])
def test_nvfp4_matches_independent_formula(convention):
    g = torch.Generator().manual_seed(7)
    w = torch.randn(6, 64, generator=g) * 0.05
    w[1, 5] = 3.0  # an outlier
    w[2, 16:32] = 0.0  # a zero block
    w[3, 32:48] = 1e-6  # a block whose scale underflows / clamps
    codes, scales, gval = ref_nvfp4(w.numpy(), convention)
    q = nvfp4_quantize(w, convention=convention)
    assert q.codes().flatten().tolist() == codes
    assert q.block_scale.float().flatten().tolist() == scales
    assert float(q.global_scale) == gval


# -- conversions between the conventions ---------------------------------------------------------------
def test_convention_conversion_keeps_bytes_and_inverts_the_scalar():
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(32, 128, generator=g) * 0.02).to(torch.bfloat16)
    ct = nvfp4_quantize(w)
    mo = ct.to_convention("modelopt")
    assert mo.packed is ct.packed and mo.block_scale is ct.block_scale
    assert mo.global_scale.shape == () and float(mo.global_scale) == float(1.0 / ct.global_scale)
    assert_bits_equal(mo.weight_global_scale, modelopt_scale_2_to_ct_global(ct_global_to_modelopt_scale_2(ct.global_scale)))
    # quantizing directly in ModelOpt convention gives the same packed bytes here
    direct = nvfp4_quantize(w, convention="modelopt")
    assert float(direct.global_scale) == float(absmax(w).float() / 2688.0)


def test_reciprocal_round_trip_is_exact_only_below_sqrt2_mantissas():
    """The exact rule: CT global = fp32(1 / ModelOpt scale_2) and back. In F32, 1/(1/x) == x
    fails for 17.2% of mantissas (those above ~sqrt(2)); it is never off by more than one ulp."""
    x = (torch.arange(1 << 23, dtype=torch.int32) | (127 << 23)).view(torch.float32)  # all of [1, 2)
    rt = 1.0 / (1.0 / x)
    bad = rt != x
    assert int(bad.sum()) == 1439258
    assert float(x[bad].min()) > math.sqrt(2) - 1e-3
    ulp_off = (rt.view(torch.int32) - x.view(torch.int32)).abs()
    assert int(ulp_off.max()) == 1
    # global scales that CT computes for bf16 weights have bf16 mantissas: 26 of the 129 fail
    xb = x.to(torch.bfloat16).float().unique()
    assert int((1.0 / (1.0 / xb) != xb).sum()) == 26
    assert torch.equal(torch.reciprocal(x), 1.0 / x)  # torch.reciprocal is the correctly rounded 1/x


def test_dequant_divide_and_multiply_differ_by_at_most_one_ulp():
    g = torch.Generator().manual_seed(5)
    w = torch.randn(64, 256, generator=g) * 0.02
    q = nvfp4_quantize(w)
    a = nvfp4_dequantize(q, torch.float32, formula="divide")  # compressed-tensors decompress
    b = nvfp4_dequantize(q, torch.float32, formula="multiply")  # vLLM / ModelOpt
    diff = (a.view(torch.int32) - b.view(torch.int32)).abs()
    assert int(diff.max()) <= 1


# -- chunking, fused groups, shapes ------------------------------------------------------------------------
@pytest.mark.parametrize("convention", ["compressed-tensors", "modelopt"])
def test_nvfp4_row_chunks_equal_whole_tensor(convention):
    g = torch.Generator().manual_seed(11)
    w = (torch.randn(97, 160, generator=g) * 0.02).to(torch.bfloat16)
    w[50, 3] = 1.5
    whole = nvfp4_quantize(w, convention=convention)
    amax = absmax(w)
    chunks = [nvfp4_quantize(w[i : i + 31], convention=convention, global_amax=amax) for i in range(0, 97, 31)]
    assert_bits_equal(torch.cat([c.packed for c in chunks]), whole.packed)
    assert_bits_equal(torch.cat([c.block_scale for c in chunks]), whole.block_scale)
    for c in chunks:
        assert_bits_equal(c.global_scale, whole.global_scale)
    # the chunk amaxes combine exactly
    assert float(torch.stack([absmax(w[i : i + 31]) for i in range(0, 97, 31)]).max()) == float(amax)


def test_nvfp4_fused_group_shares_one_global_scale_and_3d():
    g = torch.Generator().manual_seed(12)
    q_proj = (torch.randn(64, 128, generator=g) * 0.02).to(torch.bfloat16)
    k_proj = (torch.randn(32, 128, generator=g) * 0.05).to(torch.bfloat16)
    group_amax = torch.maximum(absmax(q_proj), absmax(k_proj))
    qa = nvfp4_quantize(q_proj, global_amax=group_amax)
    ka = nvfp4_quantize(k_proj, global_amax=group_amax)
    assert_bits_equal(qa.global_scale, ka.global_scale)
    assert_bits_equal(ka.global_scale, nvfp4_quantize(k_proj).global_scale)  # k holds the max
    assert not torch.equal(qa.global_scale, nvfp4_quantize(q_proj).global_scale)
    # a stacked [experts, out, in] tensor equals its slices with the same scalar
    experts = torch.stack([q_proj[:32], k_proj])
    e = nvfp4_quantize(experts, global_amax=group_amax)
    assert e.packed.shape == (2, 32, 64) and e.block_scale.shape == (2, 32, 8)
    assert_bits_equal(e.packed[1], ka.packed)
    assert_bits_equal(e.dequantize()[0], nvfp4_quantize(q_proj[:32], global_amax=group_amax).dequantize())


def test_nvfp4_rejects_bad_input():
    with pytest.raises(NumericsError):
        nvfp4_quantize(torch.zeros(2, 24))
    with pytest.raises(NumericsError):
        nvfp4_quantize(torch.tensor([[math.inf] + [0.0] * 15]))
    with pytest.raises(NumericsError):
        nvfp4_quantize(torch.zeros(2, 16), convention="nvidia")  # type: ignore[arg-type]
    with pytest.raises(NumericsError):
        nvfp4_quantize(torch.zeros(2, 16), global_amax=1.0, global_scale=torch.ones(1))


def test_nvfp4_all_zero_weight_in_both_conventions():
    z = torch.zeros(4, 32)
    ct = nvfp4_quantize(z)
    assert ct.global_scale.tolist() == [1.0] and ct.block_scale.float().unique().tolist() == [0.125]
    mo = nvfp4_quantize(z, convention="modelopt")  # ModelOpt itself would produce NaN scales here
    assert float(mo.global_scale) == 1.0 and mo.block_scale.float().unique().tolist() == [1.0]
    assert torch.equal(ct.dequantize(torch.float32), z) and torch.equal(mo.dequantize(torch.float32), z)


def test_nvfp4_block_scales_helper_and_encode_agree_with_quantize():
    g = torch.Generator().manual_seed(13)
    w = torch.randn(8, 64, generator=g)
    q = nvfp4_quantize(w)
    assert_bits_equal(nvfp4_block_scales(w, q.global_scale), q.block_scale)
    assert torch.equal(pack_fp4(nvfp4_encode(w, q.block_scale, q.global_scale)), q.packed)


# -- activations (vLLM emulation) ---------------------------------------------------------------------------
def test_activation_fake_quant_properties():
    g = torch.Generator().manual_seed(21)
    x = (torch.randn(4, 64, generator=g) * 2).to(torch.bfloat16)
    x[1, :16] = 0.0
    gs = nvfp4_global_scale(absmax(x).float())
    values, scale = nvfp4_quantize_activation(x, gs)
    assert values.dtype == torch.float32 and scale.shape == (4, 4)
    assert set(values.abs().unique().tolist()) <= set(E2M1_VALUES)
    y = nvfp4_fake_quantize_activation(x, gs)
    assert y.dtype == torch.bfloat16 and torch.equal(y[1, :16].float(), torch.zeros(16))
    assert 0.05 < relative_error(x, y) < 0.15
    # with the block scale exactly representable, weights and activations quantize alike
    w_dq = nvfp4_quantize(x.float(), global_scale=gs).dequantize(torch.float32)
    assert relative_error(w_dq, y.float()) < 0.02


# -- MXFP4 ---------------------------------------------------------------------------------------------------
def test_mxfp4_by_hand():
    # block 0: amax 6 -> floor(log2 6) - 2 = 0 -> scale 1 (byte 127)
    # block 1: amax 1 -> 0 - 2 = -2 -> scale 0.25 (byte 125); 0.3 / 0.25 = 1.2 -> 1 -> 0.25
    # block 2: zeros -> byte 0 (2^-127)
    # block 3: amax 7 -> floor(log2 7) = 2 -> scale 1; 7 saturates to 6
    b0 = [6.0, -3.0, 0.5, 0.25] + [0.0] * 28
    b1 = [1.0, 0.3, -0.125, 0.0] + [0.0] * 28
    b2 = [0.0] * 32
    b3 = [7.0, 5.0] + [0.0] * 30
    q = mxfp4_quantize(torch.tensor([b0 + b1 + b2 + b3]))
    assert q.scale.tolist() == [[127, 125, 0, 127]]
    assert e8m0_to_float(q.scale).tolist() == [[1.0, 0.25, 2.0**-127, 1.0]]
    d = q.dequantize(torch.float32)[0].tolist()
    assert d[:4] == [6.0, -3.0, 0.5, 0.0]  # 0.25 is a tie -> 0
    assert d[32:36] == [1.0, 0.25, -0.125, 0.0]
    assert d[96:98] == [6.0, 4.0]  # 5 is a tie -> 4
    assert math.isnan(float(e8m0_to_float(torch.tensor([255], dtype=torch.uint8))))


def test_mxfp4_roundtrip_properties():
    g = torch.Generator().manual_seed(22)
    # values already on the grid times a power of two survive exactly
    codes = torch.randint(0, 16, (16, 64), generator=g, dtype=torch.uint8)
    codes[:, 0] = 7  # make 6 * 2^X the block max so the scale is exactly 2^X
    codes[:, 32] = 7
    exps = torch.randint(-20, 20, (16, 1), generator=g).float()
    on_grid = e2m1_decode(codes) * torch.pow(2.0, exps)
    assert torch.equal(mxfp4_quantize(on_grid).dequantize(torch.float32), on_grid)
    # random weights: the error is in docs/quantization.md#expected-reconstruction-error's range (11.5% Gaussian)
    w = torch.randn(256, 256, generator=g)
    err = relative_error(w, mxfp4_dequantize(mxfp4_quantize(w), torch.float32))
    assert 0.09 < err < 0.14
    with pytest.raises(NumericsError):
        mxfp4_quantize(torch.zeros(2, 48))


# -- INT-N -----------------------------------------------------------------------------------------------------
def test_int4_symmetric_by_hand():
    # amax 7.5 -> scale 7.5 / 7.5 = 1 (the divisor is (2^4 - 1) / 2 = 7.5, as in CT):
    # -7.5 -> -8 (half to even), -3.75 -> -4, 3.75 -> 4, 7.5 -> 8 -> clipped to 7, 1.5 -> 2, -2.5 -> -2
    w = torch.tensor([[-7.5, -3.75, 0.0, 3.75, 7.5, 1.5, -2.5, -0.0]])
    q = intn_quantize(w, 4, group_size=8)
    assert q.scale.tolist() == [[1.0]] and q.zero_point is None
    assert q.q.tolist() == [[-8, -4, 0, 4, 7, 2, -2, 0]]
    assert q.dequantize(torch.float32).tolist() == [[-8.0, -4.0, 0.0, 4.0, 7.0, 2.0, -2.0, 0.0]]


def test_int4_asymmetric_by_hand():
    # lo 0 (min(0.2, 0)), hi 1.5 -> scale 1.5 / 15 = 0.1; zp = -8 - 0 / 0.1 = -8
    w = torch.tensor([[0.2, 1.5, 0.75, 0.0]])
    q = intn_quantize(w, 4, group_size=4, symmetric=False)
    assert q.zero_point.tolist() == [[-8]]
    assert q.q.tolist() == [[-6, 7, round(7.5) - 8, -8]]
    assert torch.allclose(q.dequantize(torch.float32), torch.tensor([[0.2, 1.5, 0.8, 0.0]]))
    # a group entirely negative: hi = 0, zero point at the top of the range
    n = intn_quantize(torch.tensor([[-3.0, -1.5, -0.0, -0.3]]), 4, group_size=4, symmetric=False)
    assert n.zero_point.tolist() == [[7]]
    # scale 3 / 15 = 0.2, zp = -8 + 15 = 7; -1.5 / 0.2 + 7 = -0.5 -> 0 (half to even) -> -1.4
    assert n.q.tolist() == [[-8, 0, 7, 6]]
    assert torch.allclose(n.dequantize(torch.float32), torch.tensor([[-3.0, -1.4, 0.0, -0.2]]), atol=1e-6)


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("num_bits,group_size", [(4, 128), (8, None), (2, 32), (3, 64)])
def test_intn_roundtrip_properties(num_bits, group_size, symmetric):
    g = torch.Generator().manual_seed(23)
    w = torch.randn(32, 256, generator=g) * 0.02
    q = intn_quantize(w, num_bits, group_size=group_size, symmetric=symmetric)
    qmin, qmax = -(2 ** (num_bits - 1)), 2 ** (num_bits - 1) - 1
    assert int(q.q.min()) >= qmin and int(q.q.max()) <= qmax
    d = intn_dequantize(q, torch.float32)
    gs = q.group_size
    # every element is within half a step of its reconstruction, except the clipped positive max
    step = q.scale.repeat_interleave(gs, dim=-1)
    clipped = q.q == qmax
    tol = step * 1e-5  # F32 rounding of x / scale
    assert bool(((w - d).abs() <= step / 2 + tol)[~clipped].all())
    assert bool(((w - d).abs() <= step + tol).all())
    # dequantized values re-quantize to the same codes with the same scales
    if symmetric:
        again = torch.round(d.unflatten(-1, (-1, gs)) / q.scale.unsqueeze(-1)).clamp(qmin, qmax)
        assert torch.equal(again.flatten(-2).to(torch.int8), q.q)


# -- scale search ------------------------------------------------------------------------------------------------
def _heavy_tailed(kind: str, shape=(128, 512), seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "gauss":
        w = torch.randn(shape, generator=g)
    elif kind == "laplace":
        u = torch.rand(shape, generator=g) - 0.5
        w = -torch.sign(u) * torch.log1p(-2 * u.abs())
    else:  # Student-t with 3 degrees of freedom: normal / sqrt(chi2_3 / 3)
        z = torch.randn(shape, generator=g)
        chi2 = (torch.randn((3, *shape), generator=g) ** 2).sum(0)
        w = z / torch.sqrt(chi2 / 3)
    return (w * 0.02).to(torch.bfloat16)


def test_minmax_search_is_exactly_the_default_path():
    w = _heavy_tailed("t3", (64, 256))
    r = search_nvfp4(w)
    q = nvfp4_quantize(w)
    assert torch.equal(r.weight.packed, q.packed)
    assert_bits_equal(r.weight.block_scale, q.block_scale)
    assert_bits_equal(r.weight.global_scale, q.global_scale)
    assert r.blocks_changed == 0
    # the same F32 squares; the search sums them in F32 within a chunk (F64 across), error_sums in F64
    assert r.relative_error == pytest.approx(relative_error(w, q.dequantize(torch.float32)), rel=1e-6)
    mo = search_nvfp4(w, convention="modelopt")
    assert torch.equal(mo.weight.packed, nvfp4_quantize(w, convention="modelopt").packed)


@pytest.mark.parametrize("kind", ["gauss", "laplace", "t3"])
def test_four_over_six_and_mse_never_worse_than_minmax(kind):
    w = _heavy_tailed(kind)
    mm = search_nvfp4(w, "minmax")
    fos = search_nvfp4(w, "four_over_six")
    mse = search_nvfp4(w, "mse")
    mse46 = search_nvfp4(w, "mse", fp8_max=256.0)
    # docs/quantization.md#expected-reconstruction-error: RTN ~9.0-9.5%, 4/6 ~8.6-8.7%, MSE 0.8-1.8x ~8.1-8.3%
    assert 0.085 < mm.relative_error < 0.100
    assert fos.relative_error < mm.relative_error
    assert mse.relative_error < fos.relative_error
    assert mse.relative_error < 0.086 and mse46.relative_error < mm.relative_error
    assert fos.blocks_changed > 0 and mse.blocks_changed > 0
    # the reported error is the real one
    for r in (fos, mse):
        assert r.relative_error == pytest.approx(relative_error(w, r.weight.dequantize(torch.float32)), rel=1e-6)
    # 4/6 uses the 256 headroom: global = 1536 / amax
    assert float(fos.weight.global_scale) == float(nvfp4_global_scale(absmax(w), fp8_max=256.0))


def test_mse_search_never_worse_per_block_and_chunkable():
    w = _heavy_tailed("t3", (64, 512), seed=3)
    mm = search_nvfp4(w)
    for conv in ("compressed-tensors", "modelopt"):
        mm = search_nvfp4(w, convention=conv)
        r = search_nvfp4(w, "mse", convention=conv, mse_global_steps=1)  # per block at the min-max scalar
        assert search_nvfp4(w, "mse", convention=conv).err_sq <= r.err_sq  # the searched scalar: never worse in total
        e_mm = ((mm.weight.dequantize(torch.float32) - w.float()) ** 2).unflatten(-1, (-1, 16)).sum(-1)
        e_r = ((r.weight.dequantize(torch.float32) - w.float()) ** 2).unflatten(-1, (-1, 16)).sum(-1)
        assert bool((e_r <= e_mm * (1 + 1e-6) + 1e-30).all())
    # row chunks with the whole tensor's amax reproduce the whole result and its error sums
    whole = search_nvfp4(w, "four_over_six")
    parts = [search_nvfp4(w[i : i + 16], "four_over_six", global_amax=absmax(w)) for i in range(0, 64, 16)]
    assert torch.equal(torch.cat([p.weight.packed for p in parts]), whole.weight.packed)
    err = sum(p.err_sq for p in parts)
    ref = sum(p.ref_sq for p in parts)
    assert math.sqrt(err / ref) == pytest.approx(whole.relative_error, rel=1e-6)


def test_relative_error_and_error_sums():
    w = torch.tensor([[3.0, 4.0]])
    assert relative_error(w, torch.zeros_like(w)) == 1.0
    assert relative_error(w, w) == 0.0
    assert relative_error(torch.zeros(2), torch.zeros(2)) == 0.0
    assert relative_error(torch.zeros(2), torch.ones(2)) == math.inf
    assert error_sums(w, torch.tensor([[3.0, 3.0]])) == (1.0, 25.0)
    with pytest.raises(NumericsError):
        search_nvfp4(w.repeat(1, 8), "magic")  # type: ignore[arg-type]


# -- FP8 activation / KV fake-quant and the NVFP4 per-tensor scalars --------------------------------
def test_e4m3_rounding_nearest_and_toward_zero():
    """1.1 lies between E4M3 1.0 and 1.125 (nearer 1.125); 0.84375 is the tie between 0.8125 and
    0.875 (nearest-even: 0.875); both directions saturate at 448."""
    from fp4forge.numerics import e4m3_toward_zero, fp8_fake_quantize

    x = torch.tensor([1.1, -1.1, 0.84375, 500.0, -500.0, 0.0])
    assert e4m3_toward_zero(x).to(torch.float32).tolist() == [1.0, -1.0, 0.8125, 448.0, -448.0, 0.0]
    one = torch.tensor(1.0)
    assert fp8_fake_quantize(x, one).tolist() == pytest.approx([1.125, -1.125, 0.875, 448.0, -448.0, 0.0], abs=0)
    assert fp8_fake_quantize(x, one, rounding="toward_zero").tolist() == [1.0, -1.0, 0.8125, 448.0, -448.0, 0.0]
    # the scale applies on the way in and out, and the result keeps x's dtype
    y = fp8_fake_quantize(torch.tensor([2.2], dtype=torch.bfloat16), torch.tensor(2.0))
    assert y.dtype == torch.bfloat16 and y.item() == 2.25
    with pytest.raises(NumericsError):
        fp8_fake_quantize(x, one, rounding="up")


def test_fp8_fake_quantize_reciprocal_and_dynamic():
    from fp4forge.numerics import fp8_dynamic_fake_quantize, fp8_fake_quantize_reciprocal

    assert fp8_fake_quantize_reciprocal(torch.tensor([1.1, 3.0]), torch.tensor(0.5)).tolist() == [1.125, 3.0]
    # per-token: each row's max maps to 448 and comes back exactly; 1.0 in a row of max 3 does not
    rows = torch.tensor([[3.0, 1.0], [-0.5, 0.25]])
    out = fp8_dynamic_fake_quantize(rows)
    assert out[0, 0].item() == 3.0 and out[1, 0].item() == -0.5
    scale = np.float32(3.0) / np.float32(448.0)
    q = torch.tensor(float(np.float32(1.0) / scale)).to(torch.float8_e4m3fn).to(torch.float32).item()
    assert out[0, 1].item() == float(np.float32(q) * scale)


def test_nvfp4_per_tensor_scalars_both_conventions():
    from fp4forge.numerics import amax_from_ct_global_scale, amax_from_scale_2, ct_global_scale_from_amax
    from fp4forge.numerics.fp8 import fp8_amax_from_scale

    assert ct_global_scale_from_amax(8.0).tolist() == [336.0]  # 6 * 448 / 8
    assert ct_global_scale_from_amax(0.0).tolist() == [1.0]
    assert amax_from_ct_global_scale(336.0) == 8.0
    assert amax_from_scale_2(8.0 / 2688.0) == pytest.approx(8.0, rel=1e-15)
    assert fp8_amax_from_scale(0.5) == 224.0
