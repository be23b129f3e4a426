"""One codec per quantization scheme: how its tensors are written, read back and peeked at.

A scheme's tensors (names, dtypes, shapes, roles) are data in ``layouts/_schemes.toml``; its
arithmetic is :mod:`fp4forge.numerics`. A codec joins the two for the three callers that used to
carry their own copy: the exporter (:meth:`Codec.encode`, :meth:`Codec.input_scale`), the reader
of quantized Linears (:meth:`Codec.decode`, :meth:`Codec.input_amax`) and the audit's value check
(:meth:`Codec.peek`). Callers look a codec up by the scheme name (:func:`codec`) and branch on
what the table says (:meth:`Codec.has_role`), never on the name itself; the layout's NVFP4
scalar convention is :mod:`fp4forge.numerics.conventions`' object of the same name.

Adding a scheme: a table entry, a codec registered here (or an existing codec's name list), its
declaration in ``declarations.py``; ``tests/test_codecs.py`` fails while any part is missing.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from fp4forge.checkpoint.schemes import LAYOUTS, NVFP4_BLOCK, resolve_shape, role_entries, scheme_table
from fp4forge.errors import ConfigError

if TYPE_CHECKING:  # the arithmetic is imported where it runs: the registry itself loads no torch
    import torch
    from torch import Tensor

    from fp4forge.numerics.nvfp4 import DequantFormula, Nvfp4Weight


@lru_cache(maxsize=1)
def torch_dtypes() -> dict[str, torch.dtype]:
    """safetensors dtype codes of the scheme table -> torch dtypes (the float ones a scale may have)."""
    import torch

    return {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


@dataclass(frozen=True)
class EncodeOptions:
    """How the writer wants weights encoded: the NVFP4 block-scale rule, and whether to compute
    each Linear's relative weight error."""

    block_scales: str = "minmax"
    error: bool = True


@dataclass(frozen=True)
class Encoded:
    """One Linear's stored tensors by role (``_schemes.toml``), and its relative weight error."""

    tensors: dict[str, Tensor]
    relative_error: float | None


@dataclass(frozen=True)
class Peek:
    """The audit's value check of one quantized Linear: the largest dequantized magnitude against
    the amax its scales imply (an exporter that scales right reaches ratio 1)."""

    largest: float
    implied_amax: float
    family: str


def blocks_match(packed_bytes: int, block_scale_bytes: int) -> bool:
    """Whether NVFP4 codes and E4M3 block scales of these sizes pair up block by block (eight
    bytes of two codes each per block scale). Torch-free: the deep audit plans its reads (and
    asks the disk for them) before torch is imported."""
    return packed_bytes % (NVFP4_BLOCK // 2) == 0 and packed_bytes // (NVFP4_BLOCK // 2) == block_scale_bytes


_E2M1_TABLES: dict = {}  # device -> E2M1 magnitude of each three-bit code, F32
_SIX_TIMES_TABLES: dict = {}  # device -> _six_times_e4m3() as F32
_LOW_THREE_BITS = 0x0707070707070707


def lanes_of(rows: Tensor, lane: Any) -> Tensor:
    """``rows`` (uint8 [m, L], the last dimension contiguous) as ``lane`` integers [m, L / width]:
    a view where the length, the row stride and the offset allow, else of a compact copy."""
    import torch

    width = lane.itemsize
    if not rows.numel():
        return rows.new_empty((rows.shape[0], rows.shape[1] // width), dtype=lane)
    if rows.shape[1] % width == 0 and rows.stride(0) % width == 0 and rows.storage_offset() % width == 0:
        return rows.view(lane)
    return torch.empty(rows.shape, dtype=rows.dtype, device=rows.device).copy_(rows).view(lane)  # offset 0, compact


def masked_lanes(rows: Tensor, lanes: str, mask: int) -> Tensor:
    """``rows`` (uint8 [m, L]) as integer lanes (``lanes``: a torch dtype name), each and-ed with
    ``mask``: eight bytes per int64 operation where the length allows (several times faster than
    narrow lanes on the CPU)."""
    import torch

    lane = getattr(torch, lanes)
    width = lane.itemsize
    if rows.shape[1] % 8 == 0:
        repeated = int.from_bytes(mask.to_bytes(width, "little") * (8 // width), "little")
        repeated -= (1 << 64) if repeated >= 1 << 63 else 0  # as a signed int64 constant
        return (lanes_of(rows, torch.int64) & repeated).view(lane)
    return lanes_of(rows, lane) & mask


def any_code_rows(packed: Tensor) -> Tensor:
    """Per row of packed E2M1 codes (uint8 [m, L]): whether any code is nonzero (zero and negative
    zero are not)."""
    return (masked_lanes(packed, "uint8", 0x77) > 0).any(dim=1)


def _top_codes(packed: Tensor) -> Tensor:
    """Each block's largest E2M1 magnitude code (0..7; the magnitude grows with the low three
    bits), from its eight packed bytes: rows of blocks (uint8 [m, 8 x blocks]) -> [m, blocks]."""
    import torch


    words = lanes_of(packed, torch.int64)  # eight lanes per int64 op
    lo, hi = (words & _LOW_THREE_BITS).view(torch.uint8), ((words >> 4) & _LOW_THREE_BITS).view(torch.uint8)
    return torch.maximum(lo, hi).view(packed.shape[0], -1, NVFP4_BLOCK // 2).amax(dim=2)


def _scale_magnitudes(block_scale: Tensor) -> tuple[Tensor, Tensor]:
    """(|block scale| in F32 with NaN as 0, which scales are not NaN) of E4M3 bytes."""
    from fp4forge.numerics.fp8 import FP8_E4M3_NAN_BITS
    from fp4forge.numerics.nvfp4 import e4m3_to_f32

    magnitude = block_scale & 0x7F  # |x| of E4M3 is its low seven bits
    valid = magnitude != FP8_E4M3_NAN_BITS
    return e4m3_to_f32(magnitude.masked_fill(~valid, 0)), valid


def _e2m1_table(device: Any) -> Tensor:
    import torch

    from fp4forge.numerics.e2m1 import E2M1_VALUES

    table = _E2M1_TABLES.get(device)
    if table is None:  # one copy to each device, not one per piece
        table = _E2M1_TABLES[device] = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)
    return table


def _products(packed: Tensor, scales: Tensor) -> Tensor:
    """E2M1 value of each block's top code x its |scale| (exact in F32): [m, blocks]."""
    return _e2m1_table(scales.device)[_top_codes(packed).int()] * scales


def _largest_products(packed: Tensor, block_scale: Tensor) -> Tensor:
    """Per row: max over blocks of top code x |scale|, NaN scales skipped, -inf where none."""
    import torch

    if not block_scale.shape[1]:
        return torch.full((block_scale.shape[0],), -math.inf, device=packed.device)
    scales, valid = _scale_magnitudes(block_scale)
    return _products(packed, scales).masked_fill(~valid, -math.inf).amax(dim=1)


def _largest_products_by_search(packed: Tensor, block_scale: Tensor) -> Tensor:
    """The same maxima, computed on the blocks that can reach them, on the scales' codes (E4M3's
    magnitude grows with its low seven bits; no F32 table over every scale): each row's block
    with the largest scale gives a lower bound; only blocks whose scale x 6 (E2M1's top) exceeds
    it can beat it, and those are the codes from one threshold up (a few, in a min-max export)."""
    import torch

    from fp4forge.numerics.fp8 import FP8_E4M3_NAN_BITS
    from fp4forge.numerics.nvfp4 import e4m3_to_f32

    rows, count = block_scale.shape
    if not count:
        return torch.full((rows,), -math.inf, device=packed.device)
    codes = block_scale & 0x7F  # |x| of E4M3 is its low seven bits
    nan = codes == FP8_E4M3_NAN_BITS
    all_nan = nan.all(dim=1) if bool(nan.any()) else None
    if all_nan is not None:  # NaN scales are skipped: as code 0, never a rival
        codes = codes.masked_fill(nan, 0)
    blocks = packed.reshape(rows, count, NVFP4_BLOCK // 2)
    index = torch.arange(rows, device=packed.device)
    first = codes.argmax(dim=1)
    best = _products(blocks[index, first], e4m3_to_f32(codes[index, first]).unsqueeze(1)).squeeze(1)
    thresholds = torch.bucketize(best, _six_times_e4m3_tensor(best.device), right=True)
    row, block = torch.nonzero(codes >= thresholds.unsqueeze(1).to(codes.dtype), as_tuple=True)
    if row.numel():
        rivals = _products(blocks[row, block], e4m3_to_f32(codes[row, block]).unsqueeze(1)).squeeze(1)
        best = best.scatter_reduce(0, row, rivals, "amax")
    return best if all_nan is None else best.masked_fill(all_nan, -math.inf)


@lru_cache(maxsize=1)
def _six_times_e4m3() -> tuple[float, ...]:
    """6 (E2M1's top) x the value of each E4M3 magnitude code below NaN, ascending."""
    from fp4forge.checkpoint.raw import fp8_e4m3_table
    from fp4forge.numerics.e2m1 import E2M1_MAX
    from fp4forge.numerics.fp8 import FP8_E4M3_NAN_BITS

    return tuple(float(v) * E2M1_MAX for v in fp8_e4m3_table()[:FP8_E4M3_NAN_BITS])


def _six_times_e4m3_tensor(device: Any) -> Tensor:
    """:func:`_six_times_e4m3` as F32 on ``device`` (exact: 3 bits of mantissa times 6)."""
    import torch

    table = _SIX_TIMES_TABLES.get(device)
    if table is None:
        table = _SIX_TIMES_TABLES[device] = torch.tensor(_six_times_e4m3(), dtype=torch.float32, device=device)
    return table


def _byte_tensor(raw: bytes) -> Tensor:
    """Stored bytes as a flat uint8 tensor (a copy: torch wants a writable buffer)."""
    import torch

    return torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)


def _cast_to_entry(value: Tensor, entry: dict, out_features: int = 0, in_features: int = 0) -> Tensor:
    """A scale as the table's entry stores it (dtype, shape; shape symbols of a Linear [out, in])."""
    return value.to(torch_dtypes()[entry["dtype"]]).reshape(resolve_shape(entry["shape"], out_features, in_features))


def _group_amax(weights: Sequence[Tensor]) -> float | None:
    """A fused group's shared amax (its members share one per-tensor scale); None for one Linear."""
    from fp4forge.numerics.nvfp4 import absmax

    return max(float(absmax(w)) for w in weights) if len(weights) > 1 else None


class Codec:
    """The shared part: the scheme's roles in a layout, read from the table."""

    family = ""  # the weight format vLLM picks its kernel by
    stored_roles: frozenset[str] = frozenset()  # the roles it reads and writes (input scales aside)
    doc = ""  # the docs/formats.md section that states the format
    strategy = ""  # how the weight's scales are laid out (compressed-tensors' strategy names)
    writable = True  # the exporter writes it (False: read-only formats of other tools)
    #: without a stored input scale: True = activations quantized at run time (FP8 dynamic);
    #: False = not quantized at all (weight-only)
    dynamic_activations = False

    def __init__(self, scheme: str, title: str | None = None):
        self.scheme = scheme
        self.title = title or scheme  # how reports name it

    @property
    def static_inputs(self) -> bool:
        """Whether the scheme stores a static input scale (in the layouts that write it)."""
        return any(self.has_input_scale(layout) for layout in LAYOUTS if self.scheme in scheme_table()[layout])

    def roles(self, layout: str) -> dict[str, dict]:
        """role -> {suffix, dtype, shape, ...} of this scheme in ``layout``."""
        return role_entries(layout, self.scheme)

    def has_role(self, layout: str, role: str) -> bool:
        return role in self.roles(layout)

    def has_input_scale(self, layout: str) -> bool:
        """Whether the scheme stores a static input (activation) scale in ``layout``."""
        return self.has_role(layout, "input_scale")

    def in_features(self, stored_in: int) -> int:
        """The Linear's input size from its stored weight's last dimension."""
        return stored_in

    def input_scale(self, amax: float, layout: str) -> Tensor:
        """The stored input scale for an activation amax, in the table's dtype and shape."""
        return _cast_to_entry(self._input_scale_f32(amax, layout), self.roles(layout)["input_scale"])

    def _input_scale_f32(self, amax: float, layout: str) -> Tensor:
        raise NotImplementedError

    def encode(self, weights: Sequence[Tensor], layout: str, how: EncodeOptions, precomputed: Sequence[Any] | None = None) -> list[Encoded]:
        """Encode a unit's weights (one Linear, or a fused group sharing one per-tensor scale)."""
        raise ConfigError(f"fp4forge reads {self.scheme} but does not write it")


class Nvfp4Codec(Codec):
    """NVFP4 (W4A4 and weight-only): packed E2M1 codes, E4M3 block scales, one per-tensor scalar
    in the layout's convention (docs/formats.md#nvfp4)."""

    family = "nvfp4"
    stored_roles = frozenset({"packed", "block_scale", "global_scale"})
    doc = "docs/formats.md#nvfp4"
    strategy = "tensor_group"

    def in_features(self, stored_in: int) -> int:
        return stored_in * 2  # two FP4 codes per byte

    def _input_scale_f32(self, amax: float, layout: str) -> Tensor:
        # the activation's per-tensor scalar follows the weight's convention (2688/amax or amax/2688)
        from fp4forge.numerics.conventions import convention_rule

        return convention_rule(layout).input_scalar(amax)

    def input_amax(self, stored: float, layout: str) -> float:
        """The activation amax a stored input scale stands for, in float64."""
        from fp4forge.numerics.conventions import convention_rule

        return convention_rule(layout).amax_of(stored)

    def encode(self, weights: Sequence[Tensor], layout: str, how: EncodeOptions, precomputed: Sequence[Any] | None = None) -> list[Encoded]:
        import torch

        from fp4forge.numerics.scale_search import nvfp4_mse_global_scale, relative_error, search_nvfp4

        group_amax = _group_amax(weights)
        group_scalar = None
        out = []
        for i, w in enumerate(weights):
            pre = precomputed[i] if precomputed is not None else None
            if pre is not None:  # a GPTQ result, in the layout's convention
                q = pre.to_convention(layout)
                rel = relative_error(w, q.dequantize(torch.float32).to(w.device)) if how.error else None
            else:
                amax = None if group_amax is None else torch.tensor(group_amax, dtype=w.dtype)
                scalar = None
                if group_amax is not None and how.block_scales == "mse":  # the searched scalar, one per fused group
                    if group_scalar is None:
                        group_scalar = nvfp4_mse_global_scale(list(weights), convention=layout, global_amax=amax)
                    scalar, amax = group_scalar, None
                result = search_nvfp4(w, how.block_scales, convention=layout, global_amax=amax, global_scale=scalar, error=how.error)
                q, rel = result.weight, result.relative_error
            out.append(Encoded(self.tensors_of(q), rel))
        return out

    @staticmethod
    def tensors_of(q: Nvfp4Weight) -> dict[str, Tensor]:
        """An NVFP4 weight's stored tensors by role."""
        return {"packed": q.packed, "block_scale": q.block_scale, "global_scale": q.global_scale}

    def weight(self, tensors: dict[str, Tensor], layout: str) -> Nvfp4Weight:
        """The stored NVFP4 weight (per-tensor scalar in F32, in the layout's convention)."""
        import torch

        from fp4forge.numerics.nvfp4 import Nvfp4Weight

        return Nvfp4Weight(tensors["packed"], tensors["block_scale"], tensors["global_scale"].to(torch.float32), layout)

    def decode(self, tensors: dict[str, Tensor], layout: str, dtype: torch.dtype, formula: DequantFormula | None = None) -> Tensor:
        """The dequantized weight (``formula``: see :func:`~fp4forge.numerics.nvfp4.nvfp4_dequantize`)."""
        return self.weight(tensors, layout).dequantize(dtype, formula=formula)

    def peek(self, raw: dict[str, bytes], per_tensor: float, layout: str) -> Peek | None:
        """From the stored bytes of the codes and block scales and the per-tensor scalar's value:
        the largest code x block scale x step multiplier against 6 x 448 x that multiplier.
        None where there is nothing to judge (shapes disagree, or every code is zero)."""
        if not blocks_match(len(raw["packed"]), len(raw["block_scale"])):
            return None  # a shape finding elsewhere
        any_code, product = self.peek_piece(_byte_tensor(raw["packed"]), _byte_tensor(raw["block_scale"])).tolist()
        return self.peek_finish(bool(any_code), product, per_tensor, layout)

    def peek_piece(self, packed: Tensor, block_scale: Tensor, *, search: bool = True) -> Tensor:
        """:meth:`peek_rows` of one piece (flat uint8 tensors): float64 [any code, largest product]."""
        return self.peek_rows(packed.view(1, -1), block_scale.view(1, -1), search=search)[0]

    def peek_rows(self, packed: Tensor, block_scale: Tensor, *, search: bool = True) -> Tensor:
        """The value check over rows of stored bytes (uint8 [m, 8 x blocks] codes and [m, blocks]
        scales, the last dimension contiguous, on any device; block i of a row is its packed bytes
        [8i, 8i+8) and its scale byte i): float64 [m, 2] of [any code nonzero, the largest top
        code x |block scale| (NaN scales skipped; -inf where none)]. Rows combine by max, so a
        tensor may be read in any number of pieces. ``search``: find the largest product among
        the blocks whose scale could reach it rather than computing every block's; the same
        number either way."""
        import torch

        any_code = any_code_rows(packed)
        largest = _largest_products_by_search(packed, block_scale) if search else _largest_products(packed, block_scale)
        return torch.stack([any_code.double(), largest.double()], dim=1)

    def peek_finish(self, any_code: bool, product: float, per_tensor: float, layout: str) -> Peek | None:
        """The Peek from a Linear's pieces combined (None where every code is zero). Any scalar
        gives a Peek, never an exception: 0 makes the multiplier infinite (the ratio NaN)."""
        from fp4forge.numerics.conventions import convention_rule
        from fp4forge.numerics.nvfp4 import NVFP4_GLOBAL_NUMERATOR

        if not any_code:
            return None  # weight-all-zero's business
        multiplier = convention_rule(layout).step_multiplier(per_tensor)
        largest = math.nan if product == -math.inf else product  # every block scale NaN
        return Peek(largest * multiplier, NVFP4_GLOBAL_NUMERATOR * multiplier, self.family)


class Fp8Codec(Codec):
    """FP8 E4M3 weights with a scale per tensor, per output channel, or per block."""

    family = "fp8"
    stored_roles = frozenset({"weight", "weight_scale"})

    dynamic_activations = True

    def __init__(self, scheme: str, title: str | None, strategy: str, writable: bool = True):
        super().__init__(scheme, title)
        self.strategy = strategy
        self.doc = "docs/formats.md#fp8-block-wise" if strategy == "block" else "docs/formats.md#fp8-e4m3"
        self.writable = writable

    def _input_scale_f32(self, amax: float, layout: str) -> Tensor:
        import torch

        from fp4forge.numerics.fp8 import FP8_E4M3_MAX

        return torch.tensor([amax], dtype=torch.float32) / FP8_E4M3_MAX  # static FP8: amax / 448

    def input_amax(self, stored: float, layout: str) -> float:
        from fp4forge.numerics.fp8 import fp8_amax_from_scale

        return fp8_amax_from_scale(stored)

    def encode(self, weights: Sequence[Tensor], layout: str, how: EncodeOptions, precomputed: Sequence[Any] | None = None) -> list[Encoded]:
        if not self.writable:
            return super().encode(weights, layout, how, precomputed)
        import torch

        from fp4forge.numerics.fp8 import fp8_dequantize_weight, fp8_quantize_weight
        from fp4forge.numerics.scale_search import relative_error

        group_amax = _group_amax(weights)
        amax = group_amax if self.strategy == "tensor" else None  # fused per-tensor shards share one scale
        scale_entry = self.roles(layout)["weight_scale"]
        out = []
        for w in weights:
            q8 = fp8_quantize_weight(w, self.strategy, amax=amax)
            rel = relative_error(w, fp8_dequantize_weight(q8, torch.float32)) if how.error else None
            out.append(Encoded({"weight": q8.weight, "weight_scale": _cast_to_entry(q8.scale, scale_entry, *w.shape)}, rel))
        return out

    def decode(self, tensors: dict[str, Tensor], layout: str, dtype: torch.dtype, formula: DequantFormula | None = None) -> Tensor:
        """``q * scale`` in the scale's stored dtype (compressed-tensors' decompress), then cast."""
        from fp4forge.numerics.fp8 import Fp8Weight, fp8_dequantize_weight

        scale = tensors["weight_scale"]
        strategy = "tensor" if scale.numel() == 1 else "channel"
        shaped = scale.reshape(1) if strategy == "tensor" else scale.reshape(-1, 1)
        return fp8_dequantize_weight(Fp8Weight(tensors["weight"], shaped, strategy), dtype)

    def peek(self, raw: dict[str, bytes], per_tensor: float | None, layout: str | None) -> Peek | None:
        """The largest |code| against E4M3's 448 (the scale multiplies both sides)."""
        return self.peek_finish(int(self.peek_piece(_byte_tensor(raw["weight"]))))

    def peek_piece(self, weight: Tensor) -> Tensor:
        """Over one piece of the stored codes (flat uint8, any device): the largest magnitude byte
        that is not NaN (E4M3's magnitude grows with its low seven bits), 0 where none; pieces
        combine by max."""
        import torch

        from fp4forge.numerics.fp8 import FP8_E4M3_NAN_BITS

        magnitude = weight & 0x7F
        if not magnitude.numel():
            return torch.zeros((), dtype=torch.uint8, device=weight.device)
        return magnitude.masked_fill(magnitude == FP8_E4M3_NAN_BITS, 0).amax()

    def peek_finish(self, top_code: int) -> Peek | None:
        """The Peek from the largest magnitude byte of a Linear (None where every code is 0 or NaN)."""
        from fp4forge.checkpoint.raw import fp8_e4m3_table
        from fp4forge.numerics.fp8 import FP8_E4M3_MAX

        if top_code <= 0:
            return None
        return Peek(float(fp8_e4m3_table()[top_code]), FP8_E4M3_MAX, self.family)


_CODECS: dict[str, Codec] = {
    c.scheme: c
    for c in (
        Nvfp4Codec("nvfp4", "NVFP4 W4A4"),
        Nvfp4Codec("nvfp4a16", "NVFP4 W4A16"),
        Fp8Codec("fp8", "FP8 W8A8 (static)", "tensor"),
        Fp8Codec("fp8_dynamic", "FP8 W8A8 (dynamic)", "channel"),
        Fp8Codec("fp8_block", None, "block", writable=False),
    )
}


def codec(scheme: str) -> Codec:
    """The codec registered for a scheme name; a named error for any other."""
    found = _CODECS.get(scheme)
    if found is None:
        raise ConfigError(f"no codec for quantization scheme {scheme!r} (known: {', '.join(_CODECS)})")
    return found


def codecs() -> dict[str, Codec]:
    """Every registered codec by scheme name, in registration order."""
    return dict(_CODECS)


def title(scheme: str) -> str:
    """A scheme's name in reports (the name itself for a scheme without a codec)."""
    found = _CODECS.get(scheme)
    return scheme if found is None else found.title


def nvfp4_kinds(schemes: Iterable[str]) -> tuple[bool, bool]:
    """(any NVFP4 with static input scales (W4A4), any weight-only NVFP4 (W4A16)) among ``schemes``."""
    found = [c for s in schemes if isinstance(c := _CODECS.get(s), Nvfp4Codec)]
    return any(c.static_inputs for c in found), any(not c.static_inputs for c in found)


def writable_schemes() -> tuple[str, ...]:
    """The schemes the exporter writes (what a recipe may name)."""
    return tuple(name for name, c in _CODECS.items() if c.writable)


def layout_of_suffix(scheme: str, role: str, suffix: str) -> str:
    """The layout that names ``scheme``'s ``role`` tensor ``<m>.<suffix>`` (e.g. the NVFP4 per-tensor
    scalar: ``weight_global_scale`` in compressed-tensors, ``weight_scale_2`` in ModelOpt)."""
    for layout in LAYOUTS:
        entry = codec(scheme).roles(layout).get(role)
        if entry is not None and entry["suffix"] == suffix:
            return layout
    raise ConfigError(f"no layout names the {role} of {scheme} {suffix!r}")


def needs_activation_amax(scheme: str, layout: str) -> bool:
    """Whether writing ``scheme`` in ``layout`` needs a calibrated activation amax."""
    return codec(scheme).has_input_scale(layout)


__all__ = ["Codec", "EncodeOptions", "Encoded", "Fp8Codec", "Nvfp4Codec", "Peek", "codec", "codecs", "layout_of_suffix", "needs_activation_amax", "nvfp4_kinds", "title", "writable_schemes"]
