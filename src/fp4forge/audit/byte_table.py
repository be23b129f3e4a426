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

Packed weights hold as many parameters per stored element as the declaration says (GPTQ's and AWQ's
4-bit `qweight`: 8 per int32; bitsandbytes 4-bit: 2 per byte; from vLLM's parameter data,
docs/formats.md#gptq-awq-and-bitsandbytes); zero points, `g_idx`, `weight_shape` and
bitsandbytes' quantization state are overhead. Where the declared format is not understood
(``not_understood`` says why) no bits/param is given: a wrong headline is worse than none.

A checkpoint whose architecture has no layout table gets a table from the layout derived from its
transformers model class (``layout_derived``), or, for a model type transformers does not know,
from the inferred layout (components from name patterns; ``layout_inferred`` says so).
"""

from __future__ import annotations

import math
from fractions import Fraction
import re
from collections import Counter
from itertools import compress, repeat
from operator import add, methodcaller
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from fp4forge.audit.options import ByteTableOptions
from fp4forge.checkpoint.declarations import QuantDeclaration, not_understood, read_declaration, resolve
from fp4forge.checkpoint.layout import KV_SCALES, PACKED_KINDS, UNKNOWN, Layout, TensorRole
from fp4forge.checkpoint.reader import Checkpoint, gc_paused
from fp4forge.checkpoint.safetensors_format import DTYPE_BITS, INTEGER_DTYPES

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
    unknown_reasons: dict[str, str] = field(default_factory=dict)  # name pattern (digits as #) -> why unknown
    layout_inferred: bool = False
    layout_derived: bool = False
    not_understood: str | None = None  # why the declared format's parameters cannot be counted

    @property
    def bpp(self) -> float | None:
        """The headline; none where the format is not understood (a wrong number is worse)."""
        return None if self.not_understood else bits_per_param(self.total_bytes, self.total_params)

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
            "layout_derived": self.layout_derived,
            "total": {"bytes": self.total_bytes, "params": self.total_params, "bpp": self.bpp},
            "experts_bpp": self.experts_bpp,
            "components": [asdict(c) for c in self.components],
            "dtypes": self.dtypes,
            "unknown_tensors": self.unknown_tensors,
            "unknown_reasons": self.unknown_reasons,
            "not_understood": self.not_understood,
        }


def bits_per_param(nbytes: int, params: int) -> float | None:
    return None if params == 0 else nbytes * 8 / params


def logical_params(kind: str, dtype: str, numel: int, per_element: int | Fraction | None = None) -> int:
    """Parameters a tensor holds (0 for quantization metadata). ``per_element``: the declaration's
    values per stored element of a packed weight (8 for GPTQ's 4-bit values in an int32, 2 for
    bitsandbytes' 4-bit bytes); without it a U8 FP4 tensor holds two, anything else one."""
    if kind in PACKED_KINDS or (kind == "weight" and dtype in INTEGER_DTYPES):
        if per_element is not None:
            return int(per_element * numel)  # a Fraction for values straddling elements (GPTQ 3-bit)
        return 2 * numel if dtype == "U8" and kind == "packed_fp4" else numel
    if kind in ("weight", "bias"):
        return numel
    return 0


def modelopt_packed_weights(ckpt: Checkpoint) -> set[str]:
    """Names of ModelOpt-style packed FP4 weights: ``U8`` ``<m>.weight`` with an FP8 ``<m>.weight_scale``."""
    names, dtypes, _ = _columns(ckpt)
    return _packed_among(names, dtypes)


def _columns(ckpt: Checkpoint) -> tuple[list[str], list[str], list[tuple[int, ...]]]:
    """Every tensor's name, dtype and shape in ``ckpt.tensors()`` order, joined from the headers'
    columns (no per-tensor object)."""
    columns = [ckpt.headers[shard].columns for shard in ckpt.shard_names if shard in ckpt.headers]
    if len(columns) == 1:
        return columns[0].names, columns[0].dtypes, columns[0].shapes
    names: list[str] = []
    dtypes: list[str] = []
    shapes: list[tuple[int, ...]] = []
    for column in columns:
        names += column.names
        dtypes += column.dtypes
        shapes += column.shapes
    return names, dtypes, shapes


def _packed_among(names: list[str], dtypes: list[str]) -> set[str]:
    if "U8" not in dtypes or "F8_E4M3" not in dtypes:
        return set()
    u8 = list(compress(names, map("U8".__eq__, dtypes)))
    fp8 = set(compress(names, map("F8_E4M3".__eq__, dtypes)))
    if not fp8.isdisjoint(u8):  # a name stored twice, as U8 and as FP8: the later one counts,
        # as in the per-tensor dict this replaces (a repeat of the same dtype changes nothing)
        kept = {name: dtype for name, dtype in zip(names, dtypes) if dtype in _PACKED_DTYPES}
        u8 = [name for name, dtype in kept.items() if dtype == "U8"]
        fp8 = {name for name, dtype in kept.items() if dtype == "F8_E4M3"}
    weights = list(compress(u8, map(methodcaller("endswith", ".weight"), u8)))
    return set(compress(weights, map(fp8.__contains__, map(add, weights, repeat("_scale")))))


_PACKED_DTYPES = frozenset({"U8", "F8_E4M3"})


# Digit runs masked when grouping, except layer indices: next-n (MTP) layers share every other
# name shape with the trunk but belong to their own component.
_DIGITS = re.compile(r"(?<!layers\.)(?<!\d)\d+")


def masked_digits(names: list[str]) -> list[str]:
    """Every name with its digit runs masked as ``_DIGITS`` masks them."""
    return [_DIGITS.sub("#", name) for name in names]


# The same runs as _DIGITS, ASCII only, found from their first digit (so the search skips ahead
# to digits in C): a run's first digit, not preceded by "layers." or by another digit.
_RUN_START = re.compile(r"[0-9](?<!layers\.[0-9])(?<![0-9][0-9])[0-9]*")


def name_templates(names: list[str]) -> list:
    """A grouping key per name with the same equalities as ``masked_digits`` (two names share a
    key exactly when their masked names are equal), for 10^5 names in C-level passes: the names
    joined by newlines are masked in one regex pass and split again (a newline is not a digit and
    not part of "layers.", so no run or look-behind crosses it)."""
    joined = "\n".join(names)
    if not joined.isascii() or joined.count("\n") != len(names) - 1:  # \d matches non-ASCII digits too; a
        return masked_digits(names)  # name holding a newline would split apart: the plain way
    return _RUN_START.sub("#", joined).split("\n")


def _first_names(names: list[str], templates: list, dtypes: list[str], flags: list[bool], groups: dict) -> dict[tuple, str]:
    """(template, dtype, packed) -> the first name of that group: the first name of its template,
    unless the template spans several groups (then those templates' names are walked)."""
    by_template = dict(zip(reversed(templates), reversed(names)))
    per_template = Counter(template for template, _, _ in groups)
    if len(per_template) == len(groups):  # one group per template
        return {key: by_template[key[0]] for key in groups}
    split = {template for template, seen in per_template.items() if seen > 1}
    first = {key: by_template[key[0]] for key in groups if key[0] not in split}
    for name, key in zip(names, zip(templates, dtypes, flags)):
        if key[0] in split and key not in first:
            first[key] = name
    return first


def _role_of(layout: Layout, name: str, dtype: str, is_packed: bool, shape: tuple[int, ...]) -> TensorRole:
    """The layout's role for a tensor; where an inferred layout's names place nothing, its shape
    against the config's expert count (a parameter under its own name then counts as a weight)."""
    role = layout.classify(name, dtype, modelopt_packed=is_packed)
    if role.component == UNKNOWN and layout.inferred:
        by_shape = layout.component_by_shape(shape)
        if by_shape != UNKNOWN:
            role = replace(role, component=by_shape, kind=role.kind if role.kind != UNKNOWN else "weight")
    return role


def byte_table_of(location: str | Path, options: ByteTableOptions = ByteTableOptions()) -> ByteTable:
    """The bytes job (`fp4forge bytes`, the API, the pipeline): the checkpoint at ``location``
    read from its headers, by the named layout, else its config's, else one inferred."""
    from fp4forge.checkpoint.layout import layout_or_inferred
    from fp4forge.checkpoint.reader import open_checkpoint

    ckpt = open_checkpoint(location)
    return compute_byte_table(ckpt, layout_or_inferred(ckpt.config, options.layout))


def compute_byte_table(ckpt: Checkpoint, layout: Layout) -> ByteTable:
    with gc_paused():  # 10^5 names grouped: see gc_paused
        return _compute_byte_table(ckpt, layout)


def _compute_byte_table(ckpt: Checkpoint, layout: Layout) -> ByteTable:
    names, stored_dtypes, shapes = _columns(ckpt)
    declaration = read_declaration(ckpt.config, ckpt.extra_json)
    templates, flags, groups, group_shapes = _grouped(names, stored_dtypes, shapes)
    order = layout.component_names + [KV_SCALES, UNKNOWN]
    components = {name: ComponentBytes(name) for name in order}
    dtypes: dict[str, dict[str, int]] = {}
    unknown: list[str] = []
    unknown_keys = set()
    reasons: dict[str, str] = {}
    roles = {key: _role_of(layout, example, key[1], key[2], group_shapes[key]) for key, (example, *_) in groups.items()}
    per_element = _per_element(declaration, roles)
    for key, (example, tensors, nbytes, numel) in groups.items():
        dtype, role = key[1], roles[key]
        if role.component == UNKNOWN:
            unknown_keys.add(key)
            reasons[masked_digits([example])[0]] = layout.unknown_reason(example)
        entry = components[role.component]
        entry.tensors += tensors
        entry.bytes += nbytes
        entry.params += logical_params(role.kind, dtype, numel, per_element.get(key))
        by_dtype = dtypes.setdefault(dtype, {"bytes": 0, "tensors": 0})
        by_dtype["bytes"] += nbytes
        by_dtype["tensors"] += tensors
    if unknown_keys:
        unknown = list(compress(names, map(unknown_keys.__contains__, zip(templates, stored_dtypes, flags))))
    total_bytes = sum(c.bytes for c in components.values())
    total_params = sum(c.params for c in components.values())
    kept = [c for c in components.values() if c.tensors]
    unread = not_understood(declaration)
    for c in kept:
        c.bpp = None if unread else bits_per_param(c.bytes, c.params)
        c.share = c.bytes / total_bytes if total_bytes else 0.0
    return ByteTable(
        checkpoint=ckpt.display,
        layout=layout.name,
        total_bytes=total_bytes,
        total_params=total_params,
        components=kept,
        dtypes=dict(sorted(dtypes.items(), key=lambda kv: -kv[1]["bytes"])),
        unknown_tensors=sorted(unknown),
        unknown_reasons=dict(sorted(reasons.items())),
        layout_inferred=layout.inferred,
        layout_derived=layout.derived,
        not_understood=unread,
    )


def _grouped(names: list[str], stored_dtypes: list[str], shapes: list[tuple[int, ...]]) -> tuple[list, list[bool], dict, dict]:
    """Real checkpoints repeat ~100 name shapes across 10^5 tensors (layers, experts): count per
    (name template, dtype, packed, shape) in C, total per (template, dtype, packed) from the
    counts (a tensor's bytes follow from its dtype and shape: the header check made sure), and
    name the first tensor of each group (the one classified). Returns the templates, the packed
    flags, {group: (first name, tensors, bytes, elements)} and one shape per group (for an
    inferred layout's shape rules)."""
    packed = _packed_among(names, stored_dtypes)
    templates = name_templates(names)
    flags = list(map(packed.__contains__, names)) if packed else [False] * len(names)
    counts = Counter(zip(templates, stored_dtypes, flags, shapes))
    totals: dict[tuple, list[int]] = {}
    group_shapes: dict[tuple, tuple[int, ...]] = {}
    for (template, dtype, is_packed, shape), tensors in counts.items():
        total = totals.get((template, dtype, is_packed))
        if total is None:
            total = totals[template, dtype, is_packed] = [0, 0, 0]
            group_shapes[template, dtype, is_packed] = shape
        numel = math.prod(shape)
        total[0] += tensors
        total[1] += tensors * (numel * DTYPE_BITS[dtype] >> 3)
        total[2] += tensors * numel
    first = _first_names(names, templates, stored_dtypes, flags, totals)
    return templates, flags, {key: (first[key], *total) for key, total in totals.items()}, group_shapes


def _per_element(declaration: QuantDeclaration | None, roles: dict[tuple, TensorRole]) -> dict[tuple, int | None]:
    """group -> the declaration's values per stored element, for the groups holding a packed or
    integer weight: their example modules resolved against the declaration at once (a ModelOpt
    exclude list holds hundreds of entries; NameSet matches them without a pass per module)."""
    if declaration is None:
        return {}
    modules = {key: role.module for key, role in roles.items() if role.kind in PACKED_KINDS or (role.kind == "weight" and key[1] in INTEGER_DTYPES)}
    if not modules:
        return {}
    scheme_of = resolve(declaration, sorted(set(modules.values()))).scheme_of
    return {key: group.values_per_element if (group := scheme_of.get(module)) else None for key, module in modules.items()}
