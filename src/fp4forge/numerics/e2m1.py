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

import math
import sys
import threading
from dataclasses import dataclass

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
    "encode_packed_rows",
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


@dataclass(frozen=True)
class _FloatBits:
    """The rounding's integer constants for one float format (F32 or F64)."""

    int_dtype: torch.dtype
    width: int
    mantissa: int
    bias: int

    @property
    def magnitude(self) -> int:  # every bit but the sign
        return (1 << (self.width - 1)) - 1

    @property
    def exponent(self) -> int:
        return self.magnitude ^ ((1 << self.mantissa) - 1)

    @property
    def binade_lo(self) -> int:  # bits of 1.0: below it the E2M1 step stays 0.5 (k = 0)
        return self.bias << self.mantissa

    @property
    def binade_hi(self) -> int:  # bits of 8.0: everything from 8 on saturates
        return (self.bias + 3) << self.mantissa

    @property
    def magic(self) -> int:  # bits(M) = bits(2^k) + this
        return (self.mantissa - 1) << self.mantissa

    @property
    def two_k_bias(self) -> int:  # (bits(M) >> (mantissa - 1)) - this = 2k
        return 2 * (self.bias + self.mantissa - 1)


_FORMATS = {
    torch.float32: _FloatBits(torch.int32, 32, 23, 127),
    torch.float64: _FloatBits(torch.int64, 64, 52, 1023),
}


class _Buffers(threading.local):
    """Per-thread scratch tensors of the chunked encoder, reused from chunk to chunk: fresh
    ~0.5 MiB temporaries cost more (allocation, page faults) than the arithmetic on them."""

    def __init__(self) -> None:
        self.store: dict[tuple[str, torch.dtype, torch.device, bool], Tensor] = {}

    def get(self, name: str, numel: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        # a buffer made under inference_mode cannot be written in place outside it (and the
        # callers use both), so each mode keeps its own
        key = (name, dtype, device, torch.is_inference_mode_enabled())
        buf = self.store.get(key)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(numel, dtype=dtype, device=device)
            if numel <= _BUFFER_KEEP_ELEMENTS:
                self.store[key] = buf
        return buf[:numel]


_BUFFER_KEEP_ELEMENTS = 1 << 20
_BUFFERS = _Buffers()


def _round_in_place(s: Tensor, m: Tensor, f: _FloatBits, values: Tensor | None = None) -> None:
    """Overwrite ``s`` (contiguous F32/F64, no NaN, sign already cleared) with ``|s| + M`` and
    ``m`` with the bits of ``M`` (module docstring); with ``values``, write the rounded
    magnitudes ``min((|s| + M) - M, 6)`` there (the subtraction is exact).

    ``|s| + M`` is exact to represent as the rounded value: ``|s| < 2^(k+1) <= M`` below 8, and
    from 8 on every result saturates.
    """
    torch.bitwise_and(s.view(f.int_dtype), f.exponent, out=m)
    m.clamp_(f.binade_lo, f.binade_hi).add_(f.magic)
    s.add_(m.view(s.dtype))
    if values is not None:
        torch.sub(s, m.view(s.dtype), out=values).clamp_max_(E2M1_MAX)


def _encode_in_place(s: Tensor, codes: Tensor, m: Tensor, sign: Tensor, values: Tensor | None = None) -> None:
    """E2M1 codes of ``s`` (contiguous F32/F64, no NaN) into ``codes`` (uint8); ``s``, ``m`` and
    ``sign`` (integer scratch of ``s``'s width) are overwritten; ``values`` as in
    :func:`_round_in_place`.

    The magnitude index is the rounded value in steps of ``2^(k-1)`` (``bits(|s| + M) - bits(M)``)
    plus ``2k``; the sign bit is set iff ``s < 0``.
    """
    f = _FORMATS[s.dtype]
    bits = s.view(f.int_dtype)
    s.add_(0.0)  # -0.0 + 0.0 = +0.0: its code is 0, like +0.0's
    torch.bitwise_right_shift(bits, f.width - 1, out=sign)  # -1 where s < 0, else 0
    bits.bitwise_and_(f.magnitude)
    _round_in_place(s, m, f, values)
    bits.sub_(m).add_(m.bitwise_right_shift_(f.mantissa - 1))  # index + two_k_bias
    bits.clamp_max_(f.two_k_bias + 7).sub_(sign, alpha=8)
    codes.copy_(bits)  # integer -> uint8 keeps the low byte, so the bias comes off in uint8
    codes.sub_(f.two_k_bias % 256)


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    """F64 stays F64; every other float widens exactly to F32 (as the references' F32 math)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def e2m1_encode(x: Tensor) -> Tensor:
    """Round an already-scaled float tensor to E2M1 codes (uint8 0..15, same shape).

    Round-to-nearest-even with the references' boundaries, saturating at +-6.
    """
    if not x.is_floating_point():
        raise NumericsError(f"e2m1_encode needs a float tensor, got {x.dtype}")
    s = x.to(_work_dtype(x.dtype), copy=True).contiguous().reshape(-1)
    nan = torch.isnan(s)
    if bool(nan.any()):
        s.masked_fill_(nan, 0.0)  # NaN -> code 0, as the boundary comparisons give
    f = _FORMATS[s.dtype]
    codes = torch.empty(s.shape, dtype=torch.uint8, device=s.device)
    _encode_in_place(s, codes, torch.empty_like(s, dtype=f.int_dtype), torch.empty_like(s, dtype=f.int_dtype))
    return codes.reshape(x.shape)


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


def _encode_chunk(
    blocks: Tensor, step: Tensor, out: Tensor, error: bool, row_sums: tuple[Tensor, Tensor] | None = None
) -> tuple[float, float]:
    """Codes of ``blocks / step`` (``[R, nb, bs]`` / ``[R, nb, 1]`` F32) packed into ``out``
    ``[R, nb * bs / 2]``; with ``error``, also (sum of squared dequantization error, sum of
    squares) of this chunk, from the same rounded values. With ``row_sums`` (two F64 ``[R]``
    tensors) those sums are written there per row instead, and (0, 0) returned: no host sync, so
    a CUDA caller never waits for the device."""
    n, device = blocks.numel(), blocks.device
    if blocks.dtype == torch.float32:
        x = blocks
    else:
        x = _BUFFERS.get("x", n, torch.float32, device).view(blocks.shape)
        x.copy_(blocks)  # bf16/f16 -> F32 is exact
    s = _BUFFERS.get("s", n, torch.float32, device).view(blocks.shape)
    torch.div(x, step, out=s)  # in F32, as ``bf16_tensor / f32_tensor`` in compressed-tensors
    codes = _BUFFERS.get("codes", n, torch.uint8, device)
    m = _BUFFERS.get("m", n, torch.int32, device)
    sign = _BUFFERS.get("sign", n, torch.int32, device)
    values = _BUFFERS.get("values", n, torch.float32, device).view(blocks.shape) if error else None
    _encode_in_place(s.view(-1), codes, m, sign, None if values is None else values.view(-1))
    err_sq = ref_sq = 0.0
    if values is not None:
        # value * step is the dequantized weight (as decode_packed_blocks computes it); the sign
        # does not change the square of the difference
        a = _BUFFERS.get("a", n, torch.float32, device).view(blocks.shape)
        torch.abs(x, out=a)
        d = values.mul_(step).sub_(a)
        if row_sums is not None:
            torch.sum(d.mul_(d).view(d.shape[0], -1), dim=1, dtype=torch.float64, out=row_sums[0])
            torch.sum(a.mul_(a).view(a.shape[0], -1), dim=1, dtype=torch.float64, out=row_sums[1])
        else:  # F32 squares summed in F64: only the summation order differs between paths (~1e-15)
            err_sq = float(d.mul_(d).sum(dtype=torch.float64))
            ref_sq = float(a.mul_(a).sum(dtype=torch.float64))
    if sys.byteorder == "little":
        # pack_fp4 on each code pair read as one int16: (pair | pair >> 4) has element 2i in the
        # low nibble of its low byte and 2i+1 in the high nibble
        pairs = codes.view(torch.int16)
        high = _BUFFERS.get("high", n // 2, torch.int16, device)
        pairs.bitwise_or_(torch.bitwise_right_shift(pairs, 4, out=high))
        out.copy_(pairs.view(out.shape))
    else:
        out.copy_(pack_fp4(codes.view(out.shape[0], -1)))
    return err_sq, ref_sq


def _encode_blocks(blocks: Tensor, step: Tensor, error: bool) -> tuple[Tensor, float, float]:
    nb, bs = blocks.shape[-2], blocks.shape[-1]
    b2 = blocks.reshape(-1, nb, bs)
    s2 = step.to(torch.float32).reshape(-1, nb, 1)
    out = torch.empty((b2.shape[0], nb * bs // 2), dtype=torch.uint8, device=blocks.device)
    err_sq = ref_sq = 0.0
    step_abs = s2.abs()
    if b2.dtype == torch.float64 or not (s2.numel() == 0 or 0.0 < float(step_abs.amin()) <= float(step_abs.amax()) < math.inf):
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


def encode_packed_rows(
    blocks: Tensor, step: Tensor, *, error: bool = False, chunk_elements: int | None = None
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """:func:`encode_packed_blocks` for F32/bf16/f16 ``blocks`` ``[N, nb, bs]`` whose ``step``
    ``[N, nb]`` is positive and finite everywhere (the caller guarantees it; a zero or non-finite
    step needs :func:`encode_packed_blocks`), without any host sync: returns (packed
    ``[N, nb * bs / 2]``, and with ``error`` the per-row sums of the squared dequantization
    error and of ``w^2`` (F32 squares summed in F64), else None twice). The codes are the same bit for bit."""
    n_rows, nb, bs = blocks.shape
    s2 = step.to(torch.float32).reshape(n_rows, nb, 1)
    out = torch.empty((n_rows, nb * bs // 2), dtype=torch.uint8, device=blocks.device)
    err = torch.empty(n_rows, dtype=torch.float64, device=blocks.device) if error else None
    ref = torch.empty(n_rows, dtype=torch.float64, device=blocks.device) if error else None
    per_chunk = chunk_elements or CHUNK_ELEMENTS or (ENCODE_CHUNK_ELEMENTS_ONE_THREAD if torch.get_num_threads() == 1 else CHUNK_ELEMENTS_THREADED)
    for rows in row_chunks(n_rows, nb * bs, per_chunk):
        sums = (err[rows], ref[rows]) if err is not None and ref is not None else None
        _encode_chunk(blocks[rows], s2[rows], out[rows], error, sums)
    return out, err, ref


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
