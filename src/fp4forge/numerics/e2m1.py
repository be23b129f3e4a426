"""FP4 E2M1: the element format of NVFP4 and MXFP4 (docs/formats.md#e2m1-values).

A 4-bit code is ``sign << 3 | magnitude_index``; the magnitude index 0..7 stands for
``0, 0.5, 1, 1.5, 2, 3, 4, 6``. Code 8 is -0 and is legal (it is what a small negative value
rounds to).

Rounding is round-to-nearest, ties-to-even, with exactly the boundaries of the references
(compressed-tensors ``FP4_E2M1_DATA.cast_to_fp4``, vLLM ``cast_to_fp4``, ModelOpt ``_cast_fp4``)::

    |x| <= 0.25 -> 0      0.25 < |x| < 0.75 -> 0.5     0.75 <= |x| <= 1.25 -> 1
    1.25 < |x| < 1.75 -> 1.5     1.75 <= |x| <= 2.5 -> 2     2.5 < |x| < 3.5 -> 3
    3.5 <= |x| <= 5 -> 4         |x| > 5 -> 6 (saturating: everything above 6 is 6)

The sign bit is set iff ``x < 0``: a small negative value becomes code 8 (-0), while ``-0.0``
itself becomes code 0 (+0), as in all three references (compressed-tensors multiplies by
``torch.sign``, which is 0 for -0.0; ModelOpt tests ``x < 0``). NaN encodes to code 0; the
weight quantizers reject non-finite inputs before they get here.

Packing: two codes per byte, element ``2i`` in the LOW nibble, element ``2i+1`` in the HIGH
nibble (compressed-tensors ``pack_fp4_to_uint8``, ModelOpt, vLLM ``break_fp4_bytes`` agree).
"""

from __future__ import annotations

import torch
from torch import Tensor

from fp4forge.errors import NumericsError

__all__ = [
    "E2M1_MAX",
    "E2M1_VALUES",
    "NumericsError",
    "e2m1_decode",
    "e2m1_encode",
    "e2m1_round",
    "e2m1_table",
    "decode_packed_blocks",
    "encode_packed_blocks",
    "fp4_bytes_to_values",
    "pack_fp4",
    "row_chunks",
    "unpack_fp4",
]


E2M1_MAX = 6.0
#: Magnitudes of the 8 non-negative codes, by magnitude index.
E2M1_VALUES: tuple[float, ...] = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

# (boundary, inclusive) pairs: magnitude index = number of boundaries that |x| passes, where an
# inclusive boundary is passed at equality (the tie goes up to the even code) and an exclusive one
# is not (the tie stays on the lower, even code).
_BOUNDARIES: tuple[tuple[float, bool], ...] = (
    (0.25, False),  # tie 0.25 -> 0   (code 0, even)
    (0.75, True),  # tie 0.75 -> 1   (code 2, even)
    (1.25, False),  # tie 1.25 -> 1   (code 2)
    (1.75, True),  # tie 1.75 -> 2   (code 4)
    (2.5, False),  # tie 2.5  -> 2   (code 4)
    (3.5, True),  # tie 3.5  -> 4   (code 6)
    (5.0, False),  # tie 5    -> 4   (code 6)
)

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


def e2m1_table(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> Tensor:
    """The 16 signed values of the codes 0..15 (code 8 is -0.0), as a ``[16]`` tensor."""
    key = (torch.device(device), dtype)
    table = _TABLE_CACHE.get(key)
    if table is None:
        mags = list(E2M1_VALUES)
        table = torch.tensor(mags + [-m for m in mags], dtype=dtype, device=device)
        _TABLE_CACHE[key] = table
    return table


def e2m1_encode(x: Tensor) -> Tensor:
    """Round an already-scaled float tensor to E2M1 codes (uint8 0..15, same shape).

    Round-to-nearest-even with the references' boundaries, saturating at +-6.
    """
    if not x.is_floating_point():
        raise NumericsError(f"e2m1_encode needs a float tensor, got {x.dtype}")
    a = x.abs()
    # magnitude index = sum of boundary indicators (7 vectorised comparisons, no branches)
    mag = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for bound, inclusive in _BOUNDARIES:
        mag += (a >= bound) if inclusive else (a > bound)
    sign = (x < 0).to(torch.uint8) << 3
    return mag | sign


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


def encode_packed_blocks(blocks: Tensor, step: Tensor) -> Tensor:
    """``pack_fp4(e2m1_encode(blocks / step))`` for ``blocks`` ``[..., nb, bs]`` and a per-block
    ``step`` ``[..., nb]``, run in row chunks (same result; the temporaries stay in cache).

    The division promotes to ``step``'s dtype (F32): a bf16 block divided by an F32 step is
    computed in F32, as ``bf16_tensor / f32_tensor`` is in compressed-tensors.
    """
    nb, bs = blocks.shape[-2], blocks.shape[-1]
    b2 = blocks.reshape(-1, nb, bs)
    s2 = step.reshape(-1, nb, 1)
    out = torch.empty((b2.shape[0], nb * bs // 2), dtype=torch.uint8, device=blocks.device)
    for rows in row_chunks(b2.shape[0], nb * bs):
        out[rows] = pack_fp4(e2m1_encode(b2[rows] / s2[rows]).flatten(-2))
    return out.reshape(*blocks.shape[:-2], nb * bs // 2)


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
