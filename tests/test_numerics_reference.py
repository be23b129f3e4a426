"""fp4forge.numerics bit for bit against the references' own code.

Oracles:

* compressed-tensors 0.17.0 (the version vLLM pins), installed in the main venv:
  ``compressed_tensors.quantization.utils.helpers.generate_gparam`` / ``calculate_qparams``,
  ``compressed_tensors.quantization.lifecycle.forward.quantize`` / ``dequantize`` /
  ``fake_quantize``, ``compressed_tensors.quantization.quant_args.FP4_E2M1_DATA.cast_to_fp4``,
  ``compressed_tensors.compressors.nvfp4.helpers.pack_fp4_to_uint8`` / ``unpack_fp4_from_uint8``,
  ``compressed_tensors.compressors.nvfp4.base.NVFP4PackedCompressor.compress`` / ``decompress``,
  ``compressed_tensors.compressors.naive_quantized.base.FloatQuantizationCompressor.compress`` /
  ``decompress`` and
  ``compressed_tensors.entrypoints.convert.converters.modelopt_nvfp4.ModelOptNvfp4Converter``.
  llm-compressor's observer step (min/max per group in the weight's dtype, group max for the
  global scale) is reproduced in :func:`ct_observe` from llm-compressor 0.14's
  ``observers/min_max.py`` + ``observers/base.py``.
* The real llm-compressor 0.14.0.1 (+ compressed-tensors 0.19.0) and vLLM 0.32.0 runs, recorded
  as SHA-256 digests of their outputs on inputs built here (they live in other venvs; see
  :data:`LLMC_DIGESTS` and :data:`VLLM_ACT_DIGEST` for how they were made).

CT's ``cast_to_fp4`` is ``torch.compile``d; compiling it costs ~10 s per shape on this CPU, so
dynamo is disabled while these tests run (the eager function is the same code; the recorded
llm-compressor digests were made with compilation on).
"""

from __future__ import annotations

import hashlib
import math
import zlib

import pytest
import torch

from fp4forge.numerics import (
    absmax,
    e2m1_decode,
    e2m1_encode,
    e2m1_round,
    fp4_bytes_to_values,
    fp8_quantize_weight,
    intn_quantize,
    modelopt_scale_2_to_ct_global,
    nvfp4_fake_quantize_activation,
    nvfp4_global_scale,
    nvfp4_quantize,
    nvfp4_quantize_activation,
    pack_fp4,
)

ct = pytest.importorskip("compressed_tensors", reason="compressed-tensors is in the `test` extra")
from compressed_tensors.compressors.naive_quantized.base import FloatQuantizationCompressor  # noqa: E402
from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor  # noqa: E402
from compressed_tensors.compressors.nvfp4.helpers import pack_fp4_to_uint8, unpack_fp4_from_uint8  # noqa: E402
from compressed_tensors.entrypoints.convert.converters.modelopt_nvfp4 import ModelOptNvfp4Converter  # noqa: E402
from compressed_tensors.quantization import QuantizationArgs  # noqa: E402
from compressed_tensors.quantization.lifecycle.forward import dequantize, fake_quantize, quantize  # noqa: E402
from compressed_tensors.quantization.quant_args import FP4_E2M1_DATA  # noqa: E402
from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme  # noqa: E402
from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _eager_compressed_tensors():
    """CT eager (see the module docstring) and one torch thread (small tensors; a busy 2-core
    machine makes every multi-threaded kernel wait for both cores)."""
    import torch._dynamo

    old, old_threads = torch._dynamo.config.disable, torch.get_num_threads()
    torch._dynamo.config.disable = True
    torch.set_num_threads(1)
    yield
    torch._dynamo.config.disable = old
    torch.set_num_threads(old_threads)


def bits(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def assert_bits_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape), (a.dtype, b.dtype, a.shape, b.shape)
    assert torch.equal(bits(a), bits(b)), int((bits(a) != bits(b)).sum())


# -- the compressed-tensors pipeline as llm-compressor drives it ---------------------------------------------
NVFP4 = preset_name_to_scheme("NVFP4", ["Linear"])


def ct_observe(w: torch.Tensor, args: QuantizationArgs, absmax_override: torch.Tensor | None = None):
    """llm-compressor's memoryless min/max observer: (scale, zero_point, global_scale).

    Min/max are taken in the weight's dtype over the strategy's groups; TENSOR_GROUP's global
    scale comes from the (fused group's) absmax through ``generate_gparam``; then CT's
    ``calculate_qparams``.
    """
    strategy = args.strategy.value if hasattr(args.strategy, "value") else args.strategy
    if strategy in ("group", "tensor_group"):
        obs = w.unflatten(-1, (-1, args.group_size)).unsqueeze(0)
    elif strategy == "channel":
        obs = w.unsqueeze(-2).unsqueeze(0)
    elif strategy == "tensor":
        obs = w.reshape(1, 1, -1)
    else:  # block, zero-padded like llm-compressor's flatten_for_calibration
        bh, bw = args.block_structure
        pr, pc = (-w.shape[0]) % bh, (-w.shape[1]) % bw
        p = torch.nn.functional.pad(w, (0, pc, 0, pr))
        obs = p.unflatten(0, (-1, bh)).unflatten(-1, (-1, bw)).transpose(1, 2).flatten(-2).unsqueeze(0)
    mn, mx = obs.amin(dim=(0, -1)), obs.amax(dim=(0, -1))
    gs = None
    if strategy == "tensor_group":
        a = torch.max(-mn.min(), mx.max()) if absmax_override is None else absmax_override
        gs = generate_gparam(-a.reshape(1), a.reshape(1))
    scale, zp = calculate_qparams(mn, mx, args, global_scale=gs)
    return scale, zp, gs


def ct_nvfp4(w: torch.Tensor, absmax_override: torch.Tensor | None = None, with_zero_point: bool = True):
    """compress -> (weight_packed, weight_scale, weight_global_scale), decompress -> weight."""
    scale, zp, gs = ct_observe(w, NVFP4.weights, absmax_override)
    sd = {"weight": w, "weight_scale": scale.to(w.dtype), "weight_global_scale": gs}
    if with_zero_point:
        sd["weight_zero_point"] = zp  # llm-compressor registers it; compress drops it
    c = NVFP4PackedCompressor.compress(sd, NVFP4)
    d = NVFP4PackedCompressor.decompress(dict(c), NVFP4)
    return c, d["weight"], scale.to(w.dtype), gs


# -- adversarial NVFP4 inputs ----------------------------------------------------------------------------
TIES = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0]


def _case(name: str, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    if name == "random":
        w = torch.randn(64, 256, generator=g) * 0.02
    elif name == "heavy_tailed":
        w = torch.randn(64, 256, generator=g) ** 3 * 0.01
    elif name == "zero_blocks":
        w = torch.randn(32, 128, generator=g) * 0.02
        w[::3, :] = 0.0
        w[:, 16:48] = 0.0
    elif name == "one_huge_outlier":
        w = torch.randn(32, 256, generator=g) * 0.01
        w[7, 100] = 3.0e4  # most block scales become E4M3 subnormals or underflow to CT's 0.125
    elif name == "subnormal_block_scales":
        # gs = 1 (amax 2688); block maxima 6 * 2^k put the raw scales exactly on and around the
        # E4M3 subnormal range, plus ties at 2^-10 (-> 0 -> 0.125)
        w = torch.zeros(4, 16 * 16)
        w[0, 0] = 2688.0
        for i, k in enumerate(range(-13, 2)):
            w[1, 16 * (i + 1)] = 6 * 2.0**k
            w[2, 16 * (i + 1)] = 6 * 1.5 * 2.0**k
            w[3, 16 * (i + 1) : 16 * (i + 2)] = torch.linspace(-6 * 2.0**k, 6 * 1.25 * 2.0**k, 16)
    elif name == "exact_ties":
        # gs = 1: block scale 2^k, elements tie * 2^k in both signs -> every E2M1 tie, exactly
        ties = torch.tensor(TIES + [-t for t in TIES])
        w = torch.stack([ties * 2.0**k for k in range(-6, 9)] + [ties * 448.0 / 6.0])
        w[0, 7] = 2688.0
        w = torch.cat([w, w.flip(1)], dim=1)
    elif name == "negative_zero":
        w = torch.randn(8, 64, generator=g) * 0.02
        w[0] = -0.0
        w[1, ::2] = -0.0
        w[2, :16] = -1e-9  # tiny negatives -> code 8 (-0)
        w[3, 16:32] = torch.tensor([-0.0, 1e-9] * 8)
    elif name == "tiny_amax":
        w = torch.randn(16, 64, generator=g) * 1e-36  # 2688 / amax overflows F32 -> gs = 1.0
    elif name == "small_amax":
        w = torch.randn(16, 64, generator=g) * 1e-3
    elif name == "all_zero":
        w = torch.zeros(8, 32)
    else:
        raise AssertionError(name)
    return w.to(dtype)


CASES = [
    "random",
    "heavy_tailed",
    "zero_blocks",
    "one_huge_outlier",
    "subnormal_block_scales",
    "exact_ties",
    "negative_zero",
    "tiny_amax",
    "small_amax",
    "all_zero",
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16], ids=["bf16", "f32", "f16"])
@pytest.mark.parametrize("case", CASES)
def test_nvfp4_bit_exact_against_compressed_tensors(case, dtype):
    w = _case(case, dtype)
    if dtype == torch.float16 and case in ("tiny_amax", "exact_ties", "subnormal_block_scales", "one_huge_outlier"):
        w = w.float().clamp(-6e4, 6e4).to(dtype)  # keep it finite in fp16
    c, d, scale_param, gs = ct_nvfp4(w)
    q = nvfp4_quantize(w)
    assert_bits_equal(q.packed, c["weight_packed"])
    assert_bits_equal(q.block_scale, c["weight_scale"])
    assert_bits_equal(q.global_scale, c["weight_global_scale"])
    assert_bits_equal(q.dequantize(torch.bfloat16), d)  # CT decompresses to bf16
    # without the (dropped) zero point the bytes are the same
    c2, _, _, _ = ct_nvfp4(w, with_zero_point=False)
    assert_bits_equal(q.packed, c2["weight_packed"])
    # CT's forward-path functions on the same qparams
    args = NVFP4.weights
    x_q = quantize(w, scale_param, None, args, global_scale=gs)  # E2M1 values, F32, signed zeros
    assert_bits_equal(e2m1_decode(q.codes(), x_q.dtype), x_q)
    assert_bits_equal(q.dequantize(w.dtype), fake_quantize(w, scale_param, None, args, global_scale=gs))
    deq = dequantize(x_q, scale_param, None, args, dtype=torch.float32, global_scale=gs)
    assert_bits_equal(q.dequantize(torch.float32), deq)


def test_nvfp4_fused_group_global_scale_matches_llmcompressor():
    g = torch.Generator().manual_seed(31)
    parts = [(torch.randn(n, 128, generator=g) * s).to(torch.bfloat16) for n, s in ((64, 0.02), (32, 0.05), (32, 0.01))]
    group = torch.stack([absmax(p) for p in parts]).max()
    for p in parts:
        c, d, _, _ = ct_nvfp4(p, absmax_override=group)
        q = nvfp4_quantize(p, global_amax=group)
        assert_bits_equal(q.packed, c["weight_packed"])
        assert_bits_equal(q.block_scale, c["weight_scale"])
        assert_bits_equal(q.global_scale, c["weight_global_scale"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_global_scale_matches_generate_gparam(dtype):
    vals = [2.0, 0.0173, 1e-3, 3.0e4, 0.0, 1e-30, 1e-38, 1e-45, math.inf, math.nan, 448.0 * 6]
    for v in vals:
        a = torch.tensor([v]).to(dtype)
        want = generate_gparam(-a, a)
        assert_bits_equal(nvfp4_global_scale(a.reshape(())), want)


def test_e2m1_cast_pack_unpack_match_compressed_tensors():
    ties = torch.tensor(TIES, dtype=torch.float32)
    pts = torch.cat(
        [
            ties,
            torch.nextafter(ties, torch.full_like(ties, 10.0)),
            torch.nextafter(ties, torch.zeros_like(ties)),
            torch.linspace(0, 6, 6001),
            torch.tensor([0.0, 1e-30, 1e-45]),
        ]
    )
    x = torch.cat([pts, -pts, torch.tensor([-0.0])])
    x = x[torch.randperm(x.numel(), generator=torch.Generator().manual_seed(0))]
    x = x[: x.numel() // 2 * 2]
    ref = FP4_E2M1_DATA.cast_to_fp4(x.clone())
    assert_bits_equal(e2m1_round(x), ref)
    packed = pack_fp4_to_uint8(ref.reshape(1, -1))
    assert torch.equal(pack_fp4(e2m1_encode(x)).reshape(1, -1), packed)
    every_byte = torch.arange(256, dtype=torch.uint8).reshape(16, 16)
    for dt in (torch.float32, torch.bfloat16):
        want = unpack_fp4_from_uint8(every_byte, 16, 32, dtype=dt)
        assert_bits_equal(fp4_bytes_to_values(every_byte, dt), want)


def test_modelopt_to_ct_conversion_matches_compressed_tensors_converter():
    g = torch.Generator().manual_seed(41)
    w = (torch.randn(32, 64, generator=g) * 0.02).to(torch.bfloat16)
    mo = nvfp4_quantize(w, convention="modelopt")
    m = "model.layers.0.mlp.experts.3.down_proj"
    tensors = {
        f"{m}.weight": mo.packed.clone(),
        f"{m}.weight_scale": mo.block_scale.clone(),
        f"{m}.weight_scale_2": mo.global_scale.clone(),
        f"{m}.input_scale": torch.tensor(0.0123),
    }
    out = ModelOptNvfp4Converter().process(tensors)
    assert torch.equal(out[f"{m}.weight_packed"], mo.packed)
    assert_bits_equal(out[f"{m}.weight_scale"], mo.block_scale)
    assert_bits_equal(out[f"{m}.weight_global_scale"].reshape(1), mo.weight_global_scale)
    assert_bits_equal(out[f"{m}.weight_global_scale"].reshape(1), modelopt_scale_2_to_ct_global(mo.global_scale))
    assert_bits_equal(out[f"{m}.input_global_scale"].reshape(1), modelopt_scale_2_to_ct_global(torch.tensor(0.0123)))
    # CT decompresses the converted tensors to exactly our CT-formula dequantization, once the
    # scalar has CT's on-disk shape [1].
    gs = out[f"{m}.weight_global_scale"]
    sd = {"weight_packed": mo.packed, "weight_scale": mo.block_scale, "weight_global_scale": gs.reshape(1)}
    d = NVFP4PackedCompressor.decompress(sd, NVFP4)["weight"]
    assert_bits_equal(mo.dequantize(torch.bfloat16, formula="divide"), d)
    # The converter keeps ModelOpt's 0-dim shape, and a 0-dim F32 scalar does not promote CT's
    # bf16 ``scale / global_scale``: CT then divides in bf16 and gets different weights.
    assert gs.shape == ()
    sd["weight_global_scale"] = gs
    d0 = NVFP4PackedCompressor.decompress(sd, NVFP4)["weight"]
    assert not torch.equal(bits(d0), bits(d))


# -- FP8 ---------------------------------------------------------------------------------------------------
FP8_SCHEMES = {"tensor": "FP8", "channel": "FP8_DYNAMIC", "block": "FP8_BLOCK"}


def ct_fp8(w: torch.Tensor, strategy: str, amax: torch.Tensor | None = None):
    scheme = preset_name_to_scheme(FP8_SCHEMES[strategy], ["Linear"])
    if amax is None:
        scale, zp, _ = ct_observe(w, scheme.weights)
    else:
        scale, zp = calculate_qparams(-amax.reshape(1), amax.reshape(1), scheme.weights)
    c = FloatQuantizationCompressor.compress({"weight": w, "weight_scale": scale, "weight_zero_point": zp}, scheme)
    return c, scheme


FP8_CASES = ["random", "heavy_tailed", "zero_blocks", "one_huge_outlier", "negative_zero", "tiny_amax", "all_zero"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("strategy", ["tensor", "channel", "block"])
@pytest.mark.parametrize("case", FP8_CASES)
def test_fp8_bit_exact_against_compressed_tensors(case, strategy, dtype):
    w = _case(case, dtype)
    if strategy == "block":
        w = w.repeat(math.ceil(256 / w.shape[0]), 1)[:256]  # 256 rows: two block rows
    c, scheme = ct_fp8(w, strategy)
    q = fp8_quantize_weight(w, strategy)
    assert_bits_equal(q.weight, c["weight"])
    assert_bits_equal(q.scale, c["weight_scale"])
    assert "weight_zero_point" not in c
    # CT's decompress infers the layout from the scale's shape, which is only unambiguous for
    # block scales with >= 2 block columns and whole blocks
    if strategy != "block" or (w.shape[1] % 128 == 0 and w.shape[1] >= 256):
        d = FloatQuantizationCompressor.decompress(dict(c), scheme)["weight"]
        assert_bits_equal(q.dequantize(), d)


def test_fp8_block_non_divisible_and_per_tensor_chunks_match_compressed_tensors():
    g = torch.Generator().manual_seed(51)
    w = (torch.randn(300, 200, generator=g) * 0.05).to(torch.bfloat16)
    c, _ = ct_fp8(w, "block")
    q = fp8_quantize_weight(w, "block")
    assert_bits_equal(q.weight, c["weight"])
    assert_bits_equal(q.scale, c["weight_scale"])
    # per-tensor with an explicit amax (row chunks) = CT with that amax
    amax = absmax(w)
    c, _ = ct_fp8(w[:100], "tensor", amax=amax)
    assert_bits_equal(fp8_quantize_weight(w[:100], amax=amax).weight, c["weight"])


# -- INT-N (F32 weights: CT and fp4forge both compute in F32 then) --------------------------------------
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("num_bits,group_size", [(4, 128), (8, None), (2, 32), (3, 64)])
def test_intn_matches_compressed_tensors(num_bits, group_size, symmetric):
    g = torch.Generator().manual_seed(61)
    w = torch.randn(16, 256, generator=g) * 0.02
    w[3, :128] = torch.randn(128, generator=g).abs() * 0.01  # an all-positive group
    args = QuantizationArgs(
        num_bits=num_bits,
        type="int",
        symmetric=symmetric,
        strategy="channel" if group_size is None else "group",
        group_size=group_size,
    )
    gsz = 256 if group_size is None else group_size
    grp = w.unflatten(-1, (-1, gsz))
    scale, zp = calculate_qparams(grp.amin(-1), grp.amax(-1), args)
    q = intn_quantize(w, num_bits, group_size=group_size, symmetric=symmetric)
    assert_bits_equal(q.scale, scale)
    if not symmetric:
        assert torch.equal(q.zero_point, zp.to(torch.int8))
    ct_q = quantize(w, scale, zp, args, dtype=torch.int8)  # what CT's int compressors store
    assert_bits_equal(q.q, ct_q)
    ct_dq = dequantize(ct_q, scale, zp, args, dtype=torch.float32)
    assert_bits_equal(q.dequantize(torch.float32), ct_dq)
    # CT's float fake-quant path equals it in value; it only keeps torch.round's -0.0
    assert torch.equal(q.dequantize(torch.float32), fake_quantize(w, scale, zp, args))


# -- recorded runs of the real llm-compressor and vLLM -------------------------------------------------------
def llmc_weight_cases() -> list[torch.Tensor]:
    """Deterministic weights (torch 2.13 CPU RNG) fed to llm-compressor 0.14.0.1 for LLMC_DIGESTS."""
    g = torch.Generator().manual_seed(4321)
    out = [(torch.randn(64, 256, generator=g) * 0.02).to(torch.bfloat16)]
    out.append((torch.randn(128, 384, generator=g) ** 3 * 0.01).to(torch.bfloat16))
    w = torch.randn(32, 256, generator=g) * 0.01
    w[3, 17] = 40.0
    w[5, :64] = 0.0
    w[7, 16:32] = -0.0
    w[9, 32:48] = 1e-7
    out.append(w.to(torch.bfloat16))
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, -0.0])
    t = torch.stack([ties * 2.0**k for k in range(-6, 10)])
    t[0, 7] = 2688.0
    out.append(torch.cat([t, t.flip(1)], 1).to(torch.bfloat16))
    out.append((torch.randn(16, 128, generator=g) * 1e-36).to(torch.bfloat16))
    out.append((torch.randn(130, 300, generator=g) * 0.05).to(torch.bfloat16)[:, :288])
    return out


#: sha256 over the compressed tensors' raw bytes, made in the llm-compressor venv with
#: ``Observer.load_from_registry("memoryless_minmax", base_name="weight", args=scheme.weights)``,
#: ``obs(w); qp = obs.get_qparams()``, then ``NVFP4PackedCompressor`` / ``FloatQuantizationCompressor``
#: ``.compress({"weight": w, "weight_scale": qp["scale"].to(w.dtype), "weight_zero_point":
#: qp["zero_point"], "weight_global_scale": qp["global_scale"]}, scheme)`` for each preset, hashing
#: weight_packed, weight_scale, weight_global_scale (NVFP4; the 288-column case skipped for NVFP4
#: only when K % 16 != 0, which it is not) or weight, weight_scale (FP8) per case in order.
LLMC_DIGESTS = {
    "NVFP4": "1cd8b6322cc69e3c3bb8e8f328ae9fed6be683f54df7d6226931987ca6424bd0",
    "FP8": "d0c73ab67feb46f938869f8072269434c979b75a2e7e880ccb6f18501a06ce4f",
    "FP8_DYNAMIC": "2d92da22e3518fb85ba7c7ec1caea4116f0903b90fadac2c10b025f9450bc3cf",
    "FP8_BLOCK": "cfe2f22e9af5f613ff58cf004b31e8b0210d634d4ef47b3ad40c537d2fada628",
}


def _raw(t: torch.Tensor) -> bytes:
    return bits(t).numpy().tobytes()


def test_matches_recorded_llm_compressor_run():
    for name, strategy in (("NVFP4", None), ("FP8", "tensor"), ("FP8_DYNAMIC", "channel"), ("FP8_BLOCK", "block")):
        h = hashlib.sha256()
        for w in llmc_weight_cases():
            if name == "NVFP4":
                q = nvfp4_quantize(w)
                for t in (q.packed, q.block_scale, q.global_scale):
                    h.update(_raw(t))
            else:
                f = fp8_quantize_weight(w, strategy)
                for t in (f.weight, f.scale):
                    h.update(_raw(t))
        assert h.hexdigest() == LLMC_DIGESTS[name], name


def vllm_activation_cases() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(x, input_global_scale) pairs fed to vLLM 0.32.0's ref_nvfp4_quant for VLLM_ACT_DIGEST."""
    g = torch.Generator().manual_seed(1234)
    cases = []
    x = torch.randn(8, 256, generator=g) * 3.0
    cases.append((x.to(torch.bfloat16), torch.tensor([2688.0 / 12.0])))
    t = torch.randn(8, 256, generator=g) ** 3
    cases.append((t.float(), torch.tensor([2688.0 / float(t.abs().max())])))
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, -0.0])
    rows = [ties * 2.0**k for k in (-8, -3, 0, 2, 5)]
    rows += [torch.zeros(16), torch.full((16,), 1e-30), torch.full((16,), -3e-8), torch.tensor([1e4] + [1e-3] * 15)]
    x2 = torch.stack(rows)
    x2 = torch.cat([x2, x2.flip(0)], dim=1)
    for gs in (1.0, 2688.0 / 1e4, 3.0e5, 1e-3):
        cases.append((x2.clone(), torch.tensor([gs])))
        cases.append((x2.to(torch.bfloat16), torch.tensor([gs])))
    return cases


#: sha256 of, per case in order, the raw bytes of vLLM 0.32.0's
#: ``ref_nvfp4_quant(x, gs, 16)`` (values, scales; both F32) and ``ref_nvfp4_quant_dequant(x, gs, 16)``
#: (x's dtype), from ``vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils`` on CPU.
VLLM_ACT_DIGEST = "fe5424a93ac1cfb5fddbcb0673ad8da2b95cf3d4e319254c03f19bc5a2686770"


def test_activation_quant_matches_recorded_vllm_run():
    h = hashlib.sha256()
    for x, gs in vllm_activation_cases():
        values, scale = nvfp4_quantize_activation(x.clone(), gs)
        dq = nvfp4_fake_quantize_activation(x.clone(), gs)
        for t in (values, scale, dq):
            h.update(_raw(t))
    assert h.hexdigest() == VLLM_ACT_DIGEST
