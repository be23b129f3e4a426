"""FP4 E2M1: the element format of NVFP4 and MXFP4 (docs/formats.md#e2m1-values).

A 4-bit code is ``sign << 3 | magnitude_index``; the magnitude index 0..7 stands for
``0, 0.5, 1, 1.5, 2, 3, 4, 6``. Code 8 is -0 and is legal (it is what a small negative value
rounds to).

Rounding is round-to-nearest, ties-to-even, with exactly the boundaries of the references
(compressed-tensors ``FP4_E2M1_DATA.cast_to_fp4``, vLLM ``cast_to_fp4``, ModelOpt ``_cast_fp4``)::

    |x| <= 0.25 -> 0      0.25 < |x| < 0.75 -> 0.5     0.75 <= |x| <= 1.25 -> 1
    1.25 < |x| < 1.75 -> 1.5     1.75 <= |x| <= 2.5 -> 2     2.5 < |x| < 3.5 -> 3
    3.5 <= |x| <= 5 -> 4         |x| > 5 -> 6 (saturating: everything above 6 is 6)

How it is computed (a few integer and float operations per element, no per-boundary
comparisons): with ``k = clamp(floor(log2 |x|), 0, 3)`` read from the float's exponent bits,
adding ``M = 2^(k+22)`` (F32) rounds ``|x|`` at exactly the E2M1 step ``2^(k-1)`` of its binade
(0.5 below 2) by the FPU's own round-to-nearest-even, which gives the ties above;
``(|x| + M) - M`` is the rounded magnitude (exact) and ``bits(|x| + M) - bits(M) + 2k`` its code,
saturated at 7. ``tests/test_numerics.py`` checks it bit for bit against the boundary table.

The sign bit is set iff ``x < 0``: a small negative value becomes code 8 (-0), while ``-0.0``
itself becomes code 0 (+0), as in all three references (compressed-tensors multiplies by
``torch.sign``, which is 0 for -0.0; ModelOpt tests ``x < 0``). NaN encodes to code 0; the
weight quantizers reject non-finite inputs before they get here.

Packing: two codes per byte, element ``2i`` in the LOW nibble, element ``2i+1`` in the HIGH
nibble (compressed-tensors ``pack_fp4_to_uint8``, ModelOpt, vLLM ``break_fp4_bytes`` agree).
"""

from __future__ import annotations

import sys

import torch
from torch import Tensor

from fp4forge.errors import NumericsError

__all__ = [
    "E2M1_MAX",
    "E2M1_VALUES",
    "block_absmax",
    "NumericsError",
    "e2m1_decode",
    "e2m1_encode",
    "e2m1_round",
    "e2m1_table",
    "decode_packed_blocks",
    "encode_packed_blocks",
    "encode_packed_blocks_with_error",
    "fp4_bytes_to_values",
    "pack_fp4",
    "row_chunks",
    "unpack_fp4",
]


E2M1_MAX = 6.0
#: Magnitudes of the 8 non-negative codes, by magnitude index.
E2M1_VALUES: tuple[float, ...] = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

_TABLE_CACHE: dict[tuple[torch.device, torch.dtype], Tensor] = {}
_PAIR_CACHE: dict[tuple[torch.device, torch.dtype], Tensor] = {}

#: Elements per chunk in the chunked loops below. With one torch thread, small chunks keep every
#: temporary (1 MiB F32) in cache: ~1/3 less CPU time for NVFP4 quantization on the 2-core target.
#: With several threads every kernel is an OpenMP region whose threads must all be scheduled, and
#: on a busy machine hundreds of small regions cost seconds, so chunks are large (16 MiB F32) and
#: only bound the memory of the temporaries.
CHUNK_ELEMENTS_ONE_THREAD = 1 << 18
CHUNK_ELEMENTS_THREADED = 1 << 22
#: Override for both (None: choose by ``torch.get_num_threads()``).
CHUNK_ELEMENTS: int | None = None


def row_chunks(n_rows: int, row_elements: int, chunk_elements: int | None = None) -> list[slice]:
    """Row slices covering ``n_rows`` rows with about ``chunk_elements`` elements each."""
    per_chunk = chunk_elements or CHUNK_ELEMENTS
    if not per_chunk:
        per_chunk = CHUNK_ELEMENTS_ONE_THREAD if torch.get_num_threads() == 1 else CHUNK_ELEMENTS_THREADED
    step = max(1, per_chunk // max(1, row_elements))
    return [slice(i, min(i + step, n_rows)) for i in range(0, n_rows, step)]


_MAGNITUDE_BITS: dict[torch.dtype, tuple[torch.dtype, int]] = {
    torch.bfloat16: (torch.int16, 0x7FFF),
    torch.float16: (torch.int16, 0x7FFF),
    torch.float32: (torch.int32, 0x7FFFFFFF),
}


def block_absmax(blocks: Tensor) -> Tensor:
    """``blocks.abs().amax(dim=-1)``, bit for bit, at about half the cost for bf16/f16/F32: the max
    of the bit patterns with the sign cleared (they order like the magnitudes; NaN's patterns are
    above infinity's, so a NaN still comes out as NaN)."""
    entry = _MAGNITUDE_BITS.get(blocks.dtype)
    if entry is None or not blocks.is_contiguous():
        return blocks.abs().amax(dim=-1)
    int_dtype, mask = entry
    magnitudes = torch.bitwise_and(blocks.view(int_dtype), torch.tensor(mask, dtype=int_dtype, device=blocks.device))
    return magnitudes.amax(dim=-1).view(blocks.dtype)


def e2m1_table(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> Tensor:
    """The 16 signed values of the codes 0..15 (code 8 is -0.0), as a ``[16]`` tensor."""
    key = (torch.device(device), dtype)
    table = _TABLE_CACHE.get(key)
    if table is None:
        mags = list(E2M1_VALUES)
        table = torch.tensor(mags + [-m for m in mags], dtype=dtype, device=device)
        _TABLE_CACHE[key] = table
    return table


class _FloatBits:
    """The rounding's constants for F32 or F64, as 0-dim tensors: eager torch spends ~2 µs more per
    call on a Python scalar operand, which adds up over many small chunks."""

    def __init__(self, dtype: torch.dtype, device: torch.device):
        int_dtype, width, mantissa, bias = {
            torch.float32: (torch.int32, 32, 23, 127),
            torch.float64: (torch.int64, 64, 52, 1023),
        }[dtype]

        def const(value: float, dt: torch.dtype = int_dtype) -> Tensor:
            return torch.tensor(value, dtype=dt, device=device)

        self.int_dtype = int_dtype
        self.magnitude = const((1 << (width - 1)) - 1)  # every bit but the sign
        self.exponent = const(((1 << (width - 1)) - 1) ^ ((1 << mantissa) - 1))
        self.binade_lo = const(bias << mantissa)  # 1.0: below it the E2M1 step stays 0.5 (k = 0)
        self.binade_hi = const((bias + 3) << mantissa)  # 8.0: everything from 8 on saturates
        self.magic = const((mantissa - 1) << mantissa)  # bits(M) = bits(2^k) + this
        self.shift = const(mantissa - 1)  # bits(M) >> shift = 2 * biased exponent of M
        self.two_k_bias = const(2 * (bias + mantissa - 1))  # (bits(M) >> shift) - this = 2k
        self.code_max = const(7)
        self.value_max = const(E2M1_MAX, dtype)
        self.zero = const(0.0, dtype)
        self.three = const(3, torch.uint8)
        self.four = const(4, torch.int16)


_BITS_CACHE: dict[tuple[torch.dtype, torch.device], _FloatBits] = {}


def _float_bits(dtype: torch.dtype, device: torch.device) -> _FloatBits:
    key = (dtype, device)
    consts = _BITS_CACHE.get(key)
    if consts is None:
        consts = _BITS_CACHE[key] = _FloatBits(dtype, device)
    return consts


def _sign_bits(s: Tensor, c: _FloatBits) -> Tensor:
    """The codes' sign bits, uint8 8 or 0: set iff ``s < 0`` (so -0.0 gets none)."""
    return torch.lt(s, c.zero).view(torch.uint8).bitwise_left_shift_(c.three)


def _round(s: Tensor, c: _FloatBits) -> tuple[Tensor, Tensor]:
    """Overwrite ``s`` (contiguous F32/F64, no NaN) with ``|s| + M``; return it and ``M``'s bits.

    ``M = 2^(k + mantissa - 1)`` with ``k = clamp(floor(log2 |s|), 0, 3)`` (see the module
    docstring); ``|s| + M`` is exact to represent as the rounded value (``|s| < 2^(k+1) <= M``
    below 8; from 8 on every result saturates).
    """
    magnitude = s.view(c.int_dtype).bitwise_and_(c.magnitude)
    m_bits = torch.bitwise_and(magnitude, c.exponent).clamp_(c.binade_lo, c.binade_hi).add_(c.magic)
    return s.add_(m_bits.view(s.dtype)), m_bits


def _rounded_values(t: Tensor, m_bits: Tensor, c: _FloatBits) -> Tensor:
    """The rounded E2M1 magnitudes ``min((|s| + M) - M, 6)`` (a new tensor; the subtraction is exact)."""
    return torch.sub(t, m_bits.view(t.dtype)).clamp_max_(c.value_max)


def _codes(sign: Tensor, t: Tensor, m_bits: Tensor, c: _FloatBits) -> Tensor:
    """Codes (uint8) from :func:`_sign_bits` and :func:`_round`, whose results it overwrites: the magnitude
    index is the rounded value in steps of ``2^(k-1)`` (``bits(t) - bits(M)``) plus ``2k``."""
    index = t.view(c.int_dtype).sub_(m_bits)
    index.add_(m_bits.bitwise_right_shift_(c.shift)).sub_(c.two_k_bias).clamp_max_(c.code_max)
    return index.to(torch.uint8).bitwise_or_(sign)


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    """F64 stays F64; every other float widens exactly to F32 (as the references' F32 math)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def e2m1_encode(x: Tensor) -> Tensor:
    """Round an already-scaled float tensor to E2M1 codes (uint8 0..15, same shape).

    Round-to-nearest-even with the references' boundaries, saturating at +-6.
    """
    if not x.is_floating_point():
        raise NumericsError(f"e2m1_encode needs a float tensor, got {x.dtype}")
    s = x.to(_work_dtype(x.dtype), copy=True).contiguous()
    nan = torch.isnan(s)
    has_nan = bool(nan.any())
    if has_nan:
        s.masked_fill_(nan, 0.0)  # NaN -> code 0, as the boundary comparisons give
    c = _float_bits(s.dtype, s.device)
    sign = _sign_bits(s, c)
    return _codes(sign, *_round(s, c), c).reshape(x.shape)


def e2m1_decode(codes: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """E2M1 codes (any integer dtype, values 0..15) -> float values (code 8 -> -0.0)."""
    table = e2m1_table(codes.device, dtype).unsqueeze(-1)  # a [16, 1] lookup table
    return torch.nn.functional.embedding((codes & 0xF).to(torch.int32), table).squeeze(-1)


def _pair_table(device: torch.device, dtype: torch.dtype) -> Tensor:
    """``[256, 2]``: the values of the low and the high nibble of every byte."""
    key = (torch.device(device), dtype)
    table = _PAIR_CACHE.get(key)
    if table is None:
        byte = torch.arange(256, device=device)
        single = e2m1_table(device, dtype)
        table = torch.stack((single[byte & 0xF], single[byte >> 4]), dim=-1)
        _PAIR_CACHE[key] = table
    return table


def fp4_bytes_to_values(packed: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """Packed bytes ``[..., m]`` -> E2M1 values ``[..., 2m]``: ``unpack_fp4`` + ``e2m1_decode``
    in one table lookup per byte (row ``b`` of the table = values of b's low and high nibble)."""
    if packed.dtype != torch.uint8:
        raise NumericsError(f"packed FP4 must be uint8, got {packed.dtype}")
    pairs = torch.nn.functional.embedding(packed.to(torch.int32), _pair_table(packed.device, dtype))
    return pairs.flatten(-2)


def e2m1_round(x: Tensor) -> Tensor:
    """Fake-quantize to the E2M1 grid: ``decode(encode(x))`` in ``x``'s dtype."""
    return e2m1_decode(e2m1_encode(x), x.dtype)


def pack_fp4(codes: Tensor) -> Tensor:
    """Pack E2M1 codes ``[..., n]`` (n even) into bytes ``[..., n/2]``: element 2i -> low nibble."""
    if codes.shape[-1] % 2:
        raise NumericsError(f"FP4 packing needs an even last dimension, got shape {list(codes.shape)}")
    c = codes.to(torch.uint8)
    return (c[..., 0::2] & 0xF) | ((c[..., 1::2] & 0xF) << 4)


def unpack_fp4(packed: Tensor) -> Tensor:
    """Inverse of :func:`pack_fp4`: bytes ``[..., m]`` -> codes ``[..., 2m]`` (uint8)."""
    if packed.dtype != torch.uint8:
        raise NumericsError(f"packed FP4 must be uint8, got {packed.dtype}")
    low = packed & 0xF
    high = packed >> 4
    return torch.stack((low, high), dim=-1).flatten(-2)


#: Elements per chunk of the encoder's kernel on one thread: ~20 eager ops per chunk, so the
#: chunk is large enough to hide each op's fixed cost and small enough for its temporaries
#: (~0.5 MiB each) to stay near the core.
ENCODE_CHUNK_ELEMENTS_ONE_THREAD = 1 << 17


def _pack_codes(codes: Tensor, out: Tensor, c: _FloatBits) -> None:
    """``pack_fp4`` into ``out`` by reading each code pair as one little-endian int16:
    ``(pair | pair >> 4)`` holds element 2i in the low nibble and 2i+1 in the high one."""
    pairs = codes.view(torch.int16)
    out.copy_(pairs.bitwise_or_(torch.bitwise_right_shift(pairs, c.four)).view(out.shape))


def _encode_chunk(blocks: Tensor, step: Tensor, out: Tensor, error: bool) -> tuple[float, float]:
    """Codes of ``blocks / step`` packed into ``out``; with ``error``, also (sum of squared
    dequantization error, sum of squares) of this chunk, from the same rounded values."""
    c = _float_bits(torch.float32, blocks.device)
    x = blocks.to(torch.float32)  # may alias ``blocks``: never written to
    s = torch.div(x, step)  # in F32, as ``bf16_tensor / f32_tensor`` in compressed-tensors
    sign = _sign_bits(s, c)
    t, m_bits = _round(s, c)
    err_sq = ref_sq = 0.0
    if error:
        # value * step is the dequantized weight (as decode_packed_blocks computes it); the sign
        # does not change the square of the difference
        d = _rounded_values(t, m_bits, c).mul_(step).sub_(x.abs())
        err_sq = float(d.mul_(d).sum())
        ref_sq = float(torch.mul(x, x).sum())
    codes = _codes(sign, t, m_bits, c)
    if sys.byteorder == "little":
        _pack_codes(codes, out, c)
    else:
        out.copy_(pack_fp4(codes.flatten(-2)))
    return err_sq, ref_sq


def _encode_blocks(blocks: Tensor, step: Tensor, error: bool) -> tuple[Tensor, float, float]:
    nb, bs = blocks.shape[-2], blocks.shape[-1]
    b2 = blocks.reshape(-1, nb, bs)
    s2 = step.to(torch.float32).reshape(-1, nb, 1)
    out = torch.empty((b2.shape[0], nb * bs // 2), dtype=torch.uint8, device=blocks.device)
    err_sq = ref_sq = 0.0
    if b2.dtype == torch.float64 or not bool(torch.isfinite(s2).all() and (s2 != 0).all()):
        # F64 blocks, or a zero / non-finite step (0/0 is NaN): the general path
        for rows in row_chunks(b2.shape[0], nb * bs):
            x = b2[rows].to(torch.float64 if b2.dtype == torch.float64 else torch.float32)
            codes = e2m1_encode(x / s2[rows])
            out[rows] = pack_fp4(codes.flatten(-2))
            if error:
                d = x - e2m1_decode(codes, x.dtype) * s2[rows]
                err_sq += float(torch.sum(d * d, dtype=torch.float64))
                ref_sq += float(torch.sum(x * x, dtype=torch.float64))
        return out.reshape(*blocks.shape[:-2], nb * bs // 2), err_sq, ref_sq
    per_chunk = CHUNK_ELEMENTS or (ENCODE_CHUNK_ELEMENTS_ONE_THREAD if torch.get_num_threads() == 1 else CHUNK_ELEMENTS_THREADED)
    for rows in row_chunks(b2.shape[0], nb * bs, per_chunk):
        e, r = _encode_chunk(b2[rows], s2[rows], out[rows], error)
        err_sq += e
        ref_sq += r
    return out.reshape(*blocks.shape[:-2], nb * bs // 2), err_sq, ref_sq


def encode_packed_blocks(blocks: Tensor, step: Tensor) -> Tensor:
    """``pack_fp4(e2m1_encode(blocks / step))`` for finite ``blocks`` ``[..., nb, bs]`` and a
    per-block ``step`` ``[..., nb]``, run in row chunks (same result; the temporaries stay in cache).

    The division promotes to ``step``'s dtype (F32): a bf16 block divided by an F32 step is
    computed in F32, as ``bf16_tensor / f32_tensor`` is in compressed-tensors.
    """
    return _encode_blocks(blocks, step, False)[0]


def encode_packed_blocks_with_error(blocks: Tensor, step: Tensor) -> tuple[Tensor, float, float]:
    """:func:`encode_packed_blocks` and, from the same pass, ``(err_sq, ref_sq)``: the sums of
    ``(w - value * step)^2`` (the F32 dequantization of :func:`decode_packed_blocks`) and of ``w^2``.

    Squares are F32; they are summed in F32 within a chunk (torch's pairwise sum) and in F64
    across chunks, so the sums agree with an F64 sum of the same squares to about 1e-6.
    """
    return _encode_blocks(blocks, step, True)


def decode_packed_blocks(packed: Tensor, step: Tensor, block: int, dtype: torch.dtype) -> Tensor:
    """``e2m1_value * step`` (F32) cast to ``dtype``: packed ``[..., K/2]``, step ``[..., K/block]``
    -> ``[..., K]``, in row chunks."""
    nb = step.shape[-1]
    p2 = packed.reshape(-1, nb * block // 2)
    s2 = step.to(torch.float32).reshape(-1, nb, 1)
    out = torch.empty((p2.shape[0], nb * block), dtype=dtype, device=packed.device)
    for rows in row_chunks(p2.shape[0], nb * block):
        values = fp4_bytes_to_values(p2[rows], torch.float32).unflatten(-1, (nb, block))
        out[rows] = (values * s2[rows]).flatten(-2)
    return out.reshape(*packed.shape[:-1], nb * block)
