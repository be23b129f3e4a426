"""Where the bytes are: stored bytes and logical parameters per component and per dtype,
computed from shard headers alone.

Accounting rules (stated, because headline bpp numbers are only comparable under them):
- a packed-FP4 ``U8`` byte holds two parameters (compressed-tensors ``weight_packed``;
  ModelOpt's ``U8`` ``weight`` with an FP8 ``weight_scale`` beside it); an ``F4`` header
  already counts logical elements;
- scales, global scales, input scales and zero points are overhead: their bytes count
  toward their weight's component, their elements are not parameters;
- KV-cache scales form their own component.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from fp4forge.checkpoint.layout import KV_SCALES, UNKNOWN, Layout
from fp4forge.checkpoint.reader import Checkpoint

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
    dtypes = {info.name: info.dtype for _, info in ckpt.tensors()}
    return {
        name
        for name, dtype in dtypes.items()
        if dtype == "U8" and name.endswith(".weight") and dtypes.get(name[: -len("weight")] + "weight_scale") == "F8_E4M3"
    }


def compute_byte_table(ckpt: Checkpoint, layout: Layout) -> ByteTable:
    packed = modelopt_packed_weights(ckpt)
    order = layout.component_names + [KV_SCALES, UNKNOWN]
    components = {name: ComponentBytes(name) for name in order}
    dtypes: dict[str, dict[str, int]] = {}
    unknown: list[str] = []
    for _, info in ckpt.tensors():
        role = layout.classify(info.name, info.dtype, modelopt_packed=info.name in packed)
        if role.component == UNKNOWN:
            unknown.append(info.name)
        entry = components[role.component]
        entry.tensors += 1
        entry.bytes += info.nbytes
        entry.params += logical_params(role.kind, info.dtype, info.numel)
        by_dtype = dtypes.setdefault(info.dtype, {"bytes": 0, "tensors": 0})
        by_dtype["bytes"] += info.nbytes
        by_dtype["tensors"] += 1
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
    )
