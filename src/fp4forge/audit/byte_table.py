"""Where the bytes are: stored bytes and logical parameters per component and per dtype,
computed from shard headers alone.

Accounting rules (stated, because headline bpp numbers are only comparable under them):
- a packed-FP4 ``U8`` byte holds two parameters (compressed-tensors ``weight_packed``;
  ModelOpt's ``U8`` ``weight`` with an FP8 ``weight_scale`` beside it); an ``F4`` header
  already counts logical elements;
- scales, global scales, input scales and zero points are overhead: their bytes count
  toward their weight's component, their elements are not parameters;
- KV-cache scales form their own component;
- formats the world ships count the same way: FP8 block-wise ``weight_scale_inv`` (any block
  size) and MXFP4 ``*_scales`` are overhead, MXFP4 ``*_blocks`` hold two parameters per byte,
  parameters stored without a ``.weight`` suffix (``A_log``, ``dt_bias``, ``sinks``) count.

A checkpoint whose architecture has no layout table still gets a table from the inferred layout
(components from name patterns); ``layout_inferred`` says so.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field

from fp4forge.checkpoint.layout import KV_SCALES, UNKNOWN, Layout
from fp4forge.checkpoint.reader import Checkpoint, gc_paused

EXPERTS = "routed_experts"


@dataclass
class ComponentBytes:
    name: str
    tensors: int = 0
    bytes: int = 0
    params: int = 0
    bpp: float | None = None
    share: float = 0.0


@dataclass
class ByteTable:
    checkpoint: str
    layout: str
    total_bytes: int
    total_params: int
    components: list[ComponentBytes]
    dtypes: dict[str, dict[str, int]]
    unknown_tensors: list[str] = field(default_factory=list)
    layout_inferred: bool = False

    @property
    def bpp(self) -> float | None:
        return bits_per_param(self.total_bytes, self.total_params)

    @property
    def experts_bpp(self) -> float | None:
        for component in self.components:
            if component.name == EXPERTS:
                return component.bpp
        return None

    def to_json(self) -> dict:
        return {
            "checkpoint": self.checkpoint,
            "layout": self.layout,
            "layout_inferred": self.layout_inferred,
            "total": {"bytes": self.total_bytes, "params": self.total_params, "bpp": self.bpp},
            "experts_bpp": self.experts_bpp,
            "components": [asdict(c) for c in self.components],
            "dtypes": self.dtypes,
            "unknown_tensors": self.unknown_tensors,
        }


def bits_per_param(nbytes: int, params: int) -> float | None:
    return None if params == 0 else nbytes * 8 / params


def logical_params(kind: str, dtype: str, numel: int) -> int:
    """Parameters a tensor holds (0 for quantization metadata)."""
    if kind == "packed_fp4" and dtype == "U8":
        return 2 * numel
    if kind in ("weight", "bias", "packed_fp4"):
        return numel
    return 0


def modelopt_packed_weights(ckpt: Checkpoint) -> set[str]:
    """Names of ModelOpt-style packed FP4 weights: ``U8`` ``<m>.weight`` with an FP8 ``<m>.weight_scale``."""
    dtypes = {info.name: info.dtype for _, info in ckpt.tensors() if info.dtype in ("U8", "F8_E4M3")}
    return {
        name
        for name, dtype in dtypes.items()
        if dtype == "U8" and name.endswith(".weight") and dtypes.get(name + "_scale") == "F8_E4M3"
    }


# Digit runs masked when grouping, except layer indices: next-n (MTP) layers share every other
# name shape with the trunk but belong to their own component.
_DIGITS = re.compile(r"(?<!layers\.)(?<!\d)\d+")


def masked_digits(names: list[str]) -> list[str]:
    """Every name with its digit runs masked as ``_DIGITS`` masks them, for 10^5 names at once:
    the regex over each name (or over all joined) costs as much as parsing the headers, so
    ASCII names go through C-level string operations on the joined text instead: the digits after
    ``layers.`` are set aside as control characters, every other digit becomes a marker, marker
    runs collapse to one ``#``, and the layer digits come back."""
    joined = "\n".join(names)
    if not names or not joined.isascii() or not _CONTROL.isdisjoint(joined):  # \d matches non-ASCII digits too
        return [_DIGITS.sub("#", name) for name in names]
    pieces = joined.split(_LAYERS)
    del joined
    protected: dict[str, str] = {}
    for position in range(1, len(pieces)):  # in place: 10^5 strings, one list
        piece = pieces[position]
        rest = piece.lstrip(_ASCII_DIGITS)
        head = piece[: len(piece) - len(rest)]  # the layer index
        shown = protected.get(head)
        if shown is None:
            shown = protected[head] = head.translate(_PROTECT)
        pieces[position] = shown + rest
    text = _LAYERS.join(pieces)
    del pieces
    text = text.translate(_DIGITS_TO_MARK)
    while _MARK + _MARK in text:
        text = text.replace(_MARK + _MARK, _MARK)
    masked = text.replace(_MARK, "#").translate(_UNPROTECT).split("\n")
    return masked if len(masked) == len(names) else [_DIGITS.sub("#", name) for name in names]  # a name held a newline


_LAYERS = "layers."
_ASCII_DIGITS = "0123456789"
_MARK = "\x00"
_SET_ASIDE = "".join(map(chr, range(0x10, 0x1A)))  # control characters no tensor name holds (checked)
_PROTECT = str.maketrans(_ASCII_DIGITS, _SET_ASIDE)
_UNPROTECT = str.maketrans(_SET_ASIDE, _ASCII_DIGITS)
_DIGITS_TO_MARK = str.maketrans(dict.fromkeys(_ASCII_DIGITS, _MARK))
_CONTROL = frozenset(_MARK + _SET_ASIDE)


def compute_byte_table(ckpt: Checkpoint, layout: Layout) -> ByteTable:
    with gc_paused():  # 10^5 names grouped: see gc_paused
        return _compute_byte_table(ckpt, layout)


def _compute_byte_table(ckpt: Checkpoint, layout: Layout) -> ByteTable:
    packed = modelopt_packed_weights(ckpt)
    # Real checkpoints repeat ~100 name shapes across 10^5 tensors (layers, experts): total per
    # (name with digits masked, dtype) first, then classify one representative of each.
    infos = [info for _, info in ckpt.tensors()]
    names = [info.name for info in infos]
    keys = zip(masked_digits(names), [info.dtype for info in infos], map(packed.__contains__, names))
    members: dict[tuple[str, str, bool], list[int]] = {}
    for position, key in enumerate(keys):
        found = members.get(key)
        if found is None:
            members[key] = [position]
        else:
            found.append(position)
    sizes = [info.end - info.begin for info in infos]
    numels = list(map(math.prod, (info.shape for info in infos)))
    groups = {
        key: (names[positions[0]], len(positions), sum(map(sizes.__getitem__, positions)), sum(map(numels.__getitem__, positions)), list(map(names.__getitem__, positions)))
        for key, positions in members.items()
    }

    order = layout.component_names + [KV_SCALES, UNKNOWN]
    components = {name: ComponentBytes(name) for name in order}
    dtypes: dict[str, dict[str, int]] = {}
    unknown: list[str] = []
    for (_, dtype, is_packed), (example, count, nbytes, numel, group_names) in groups.items():
        role = layout.classify(example, dtype, modelopt_packed=is_packed)
        if role.component == UNKNOWN:
            unknown.extend(group_names)
        entry = components[role.component]
        entry.tensors += count
        entry.bytes += nbytes
        entry.params += logical_params(role.kind, dtype, numel)
        by_dtype = dtypes.setdefault(dtype, {"bytes": 0, "tensors": 0})
        by_dtype["bytes"] += nbytes
        by_dtype["tensors"] += count
    total_bytes = sum(c.bytes for c in components.values())
    total_params = sum(c.params for c in components.values())
    kept = [c for c in components.values() if c.tensors]
    for c in kept:
        c.bpp = bits_per_param(c.bytes, c.params)
        c.share = c.bytes / total_bytes if total_bytes else 0.0
    return ByteTable(
        checkpoint=ckpt.display,
        layout=layout.name,
        total_bytes=total_bytes,
        total_params=total_params,
        components=kept,
        dtypes=dict(sorted(dtypes.items(), key=lambda kv: -kv[1]["bytes"])),
        unknown_tensors=sorted(unknown),
        layout_inferred=layout.inferred,
    )
