"""Architecture layouts as data: which component each tensor belongs to, and what kind of
tensor it is (weight, packed FP4, bias, or quantization metadata).

The tables live in ``layouts/*.toml``. Names no table recognises are reported as unknown,
never guessed.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from typing import Any

from fp4forge.errors import LayoutError

UNKNOWN = "unknown"
KV_SCALES = "kv_cache_scales"
# Kinds whose bytes are overhead of a weight rather than parameters.
METADATA_KINDS = frozenset(
    {"weight_scale", "weight_global_scale", "input_scale", "input_global_scale", "zero_point", "kv_scale"}
)


@dataclass(frozen=True)
class TensorRole:
    name: str
    module: str
    suffix: str
    kind: str  # weight | packed_fp4 | bias | one of METADATA_KINDS | unknown
    component: str

    @property
    def is_parameter(self) -> bool:
        return self.kind in ("weight", "packed_fp4", "bias")


@dataclass(frozen=True)
class Layout:
    name: str
    architectures: tuple[str, ...]
    model_types: tuple[str, ...]
    components: tuple[tuple[str, tuple[re.Pattern[str], ...]], ...]
    fused: dict[str, tuple[str, ...]]

    def component_of(self, module: str) -> str:
        match = self._combined.match(module)
        return self._group_component[match.lastgroup] if match else UNKNOWN

    def __post_init__(self) -> None:
        # All patterns as one alternation (first match wins, as in the table): one regex call
        # per name instead of one per pattern, for 10^5-tensor checkpoints.
        alternatives, owners = [], {}
        for number, (component, patterns) in enumerate(self.components):
            for k, pattern in enumerate(patterns):
                owners[f"g{number}_{k}"] = component
                alternatives.append(f"(?P<g{number}_{k}>{pattern.pattern})")
        object.__setattr__(self, "_combined", re.compile("|".join(alternatives)))
        object.__setattr__(self, "_group_component", owners)

    def classify(self, name: str, dtype: str | None = None, *, modelopt_packed: bool = False) -> TensorRole:
        """Role of one tensor. ``modelopt_packed``: a U8 ``.weight`` is ModelOpt's packed FP4."""
        module, suffix, kind = split_suffix(name)
        if kind == "weight" and dtype == "U8" and modelopt_packed:
            kind = "packed_fp4"
        component = self.component_of(module) if kind != UNKNOWN else UNKNOWN
        if kind == "kv_scale" and component == "attention":
            component = KV_SCALES
        return TensorRole(name=name, module=module, suffix=suffix, kind=kind, component=component)

    @property
    def component_names(self) -> list[str]:
        return [c for c, _ in self.components]


@lru_cache(maxsize=1)
def _suffix_kinds() -> dict[str, str]:
    doc = _load_toml("_common.toml")
    return {entry["suffix"]: entry["kind"] for entry in doc["suffixes"]}


def split_suffix(name: str) -> tuple[str, str, str]:
    """`a.b.weight_scale` -> (`a.b`, `weight_scale`, kind). Suffixes are whole dotted parts."""
    module, _, last = name.rpartition(".")
    kind = _suffix_kinds().get(last)
    return (module, last, kind) if kind is not None else (name, "", UNKNOWN)


def _load_toml(file_name: str) -> dict[str, Any]:
    text = resources.files("fp4forge.checkpoint").joinpath("layouts", file_name).read_text(encoding="utf-8")
    return tomllib.loads(text)


@lru_cache(maxsize=None)
def all_layouts() -> tuple[Layout, ...]:
    layouts = []
    directory = resources.files("fp4forge.checkpoint").joinpath("layouts")
    for entry in sorted(directory.iterdir(), key=lambda e: e.name):
        if not entry.name.endswith(".toml") or entry.name.startswith("_"):
            continue
        doc = tomllib.loads(entry.read_text(encoding="utf-8"))
        layouts.append(
            Layout(
                name=doc["name"],
                architectures=tuple(doc.get("architectures", ())),
                model_types=tuple(doc.get("model_types", ())),
                components=tuple(
                    (component, tuple(re.compile(p) for p in patterns)) for component, patterns in doc["components"].items()
                ),
                fused={k: tuple(v) for k, v in doc.get("fused", {}).items()},
            )
        )
    return tuple(layouts)


def layout_by_name(name: str) -> Layout:
    for layout in all_layouts():
        if layout.name == name:
            return layout
    raise LayoutError(f"no layout named {name!r}; known: {', '.join(l.name for l in all_layouts())}")


def layout_for_config(config: dict[str, Any] | None) -> Layout:
    """Pick the layout from config.json's `architectures` / `model_type`."""
    if not config:
        raise LayoutError("no config.json: pass the architecture layout explicitly (--layout)")
    architectures = config.get("architectures") or []
    model_type = config.get("model_type")
    for layout in all_layouts():
        if any(a in layout.architectures for a in architectures) or model_type in layout.model_types:
            return layout
    known = ", ".join(a for l in all_layouts() for a in l.architectures)
    raise LayoutError(f"no layout for architecture {architectures or model_type!r}; known: {known}")
