"""Architecture layouts as data: which component each tensor belongs to, and what kind of
tensor it is (weight, packed FP4, bias, or quantization metadata).

The tables live in ``layouts/*.toml``. Names a table does not recognise are reported as
unknown, never guessed. An architecture without a table can still be described by the
inferred layout (``layouts/_inferred.toml``: components from common name patterns), which says
so in its ``inferred`` flag.

Patterns may use ``{mtp_layer}``: the indices of next-n / multi-token-prediction layers that
follow the trunk (``num_hidden_layers`` .. ``+ num_nextn_predict_layers - 1``), taken from the
config the layout is chosen for; without such layers it matches nothing.
"""

from __future__ import annotations

import json
import re
import tomllib
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from fp4forge.errors import LayoutError

# The tables (package data beside this module; pathlib, not importlib.resources, which alone
# imports tempfile, shutil and the compression modules into every `fp4forge bytes`).
LAYOUTS_DIR = Path(__file__).with_name("layouts")

UNKNOWN = "unknown"
KV_SCALES = "kv_cache_scales"
# Kinds whose bytes are overhead of a weight rather than parameters.
METADATA_KINDS = frozenset(
    {"weight_scale", "weight_global_scale", "input_scale", "input_global_scale", "zero_point", "kv_scale", "g_idx", "quant_state"}
)
# Kinds that hold a Linear's parameters packed several to a stored element (how many: the
# declaration's bit width, or two per byte for a U8 FP4 tensor).
PACKED_KINDS = frozenset({"packed_fp4", "packed_weight"})


@dataclass(frozen=True)
class TensorRole:
    name: str
    module: str
    suffix: str
    kind: str  # weight | one of PACKED_KINDS | bias | one of METADATA_KINDS | unknown
    component: str


@dataclass(frozen=True)
class Layout:
    name: str
    architectures: tuple[str, ...]
    model_types: tuple[str, ...]
    components: tuple[tuple[str, tuple[re.Pattern[str], ...]], ...]
    fused: dict[str, tuple[str, ...]]
    inferred: bool = False  # components guessed from name patterns, not an architecture's table
    unquantized: tuple[re.Pattern[str], ...] = ()  # Linears vLLM builds without a quant method
    derived: bool = False  # components derived from the transformers model class (layout_derive)
    expert_counts: frozenset[int] = frozenset()  # inferred layouts: the config's expert counts, for shapes
    unplaced: tuple[tuple[str, str], ...] = ()  # derived layouts: (tensor, why the derivation left it unknown)

    def component_by_shape(self, shape: tuple[int, ...]) -> str:
        """For a tensor no name pattern of an inferred layout places: fused experts are 3-D with
        the expert count first; a router's weight or bias has the expert count first (or alone
        in a [1, E] row); else unknown."""
        counts = self.expert_counts
        if not counts or not shape:
            return UNKNOWN
        if len(shape) == 3 and shape[0] in counts:
            return "routed_experts"
        if len(shape) <= 2 and (shape[0] in counts or (len(shape) == 2 and shape[0] == 1 and shape[1] in counts)):
            return "router"
        return UNKNOWN

    def unknown_reason(self, name: str) -> str:
        """Why ``name`` is unknown under this layout, in one line."""
        if self.inferred:
            return "no name pattern of the inferred layout, and no shape against the config's expert count, places it"
        if self.derived:
            return dict(self.unplaced).get(name) or f"not a tensor of the model class ({self.name}) transformers builds for this config"
        return f"no pattern of the {self.name} table matches it"

    def is_engine_unquantized(self, module: str) -> bool:
        return any(p.match(module) for p in self.unquantized)

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
        if kind == UNKNOWN and self.derived and self.component_of(name) != UNKNOWN:
            module, kind = name, "weight"  # a parameter the model class stores under its own name (DBRX's `w1`)
        if kind == "weight" and dtype == "U8" and modelopt_packed:
            kind = "packed_fp4"
        component = self.component_of(module) if kind != UNKNOWN else UNKNOWN
        if kind == "kv_scale" and component == "attention":
            component = KV_SCALES
        return TensorRole(name=name, module=module, suffix=suffix, kind=kind, component=component)

    @property
    def component_names(self) -> list[str]:
        return [c for c, _ in self.components]


BNB_SERIALIZED = "_bnb_serialized.json"  # written by scripts/bnb_serialized_names.py
QUANT_STATE = "quant_state"


@lru_cache(maxsize=1)
def bnb_serialized_names() -> dict[str, dict[str, list[str]]]:
    """{`4bit` | `8bit`: {parameter: [names save_pretrained writes for it]}}, from transformers'
    bitsandbytes quantizers (their `serialized_names`)."""
    return json.loads((LAYOUTS_DIR / BNB_SERIALIZED).read_text(encoding="utf-8"))["serialized_names"]


@lru_cache(maxsize=1)
def derived_suffix_kinds() -> tuple[dict[str, str], dict[str, str]]:
    """({suffix: kind}, {tail: kind}) taken from the authorities rather than written here: the
    GPTQ / AWQ parameters vLLM creates (``vllm_params.packed_int_suffix_kinds``) and the names
    transformers' bitsandbytes quantizers serialize beside a quantized `weight` (one part: a
    suffix of the module, `weight_format`; several: a tail of the weight, `weight.absmax`), all
    quantization state."""
    from fp4forge.checkpoint import vllm_params  # it reads LAYOUTS_DIR from this module

    suffixes = vllm_params.packed_int_suffix_kinds()
    tails: dict[str, str] = {}
    for names in bnb_serialized_names().values():
        for parameter, stored in names.items():
            for name in stored:
                if name != parameter:
                    (tails if "." in name else suffixes).setdefault(name, QUANT_STATE)
    return suffixes, tails


@lru_cache(maxsize=1)
def _suffix_kinds() -> dict[str, str]:
    """The derived suffixes, then `_common.toml`'s entries (which override: each one that
    differs from the derivation says why, tests/test_layouts_real.py)."""
    doc = _load_toml("_common.toml")
    return derived_suffix_kinds()[0] | {entry["suffix"]: entry["kind"] for entry in doc["suffixes"]}


@lru_cache(maxsize=1)
def _tail_kinds() -> dict[str, tuple[tuple[str, str], ...]]:
    """last dotted part -> ((tail, kind), ...): suffixes of several dotted parts (bitsandbytes'
    `weight.absmax`), whose module is the name before the whole tail."""
    out: dict[str, list[tuple[str, str]]] = {}
    kinds = derived_suffix_kinds()[1] | {entry["tail"]: entry["kind"] for entry in _load_toml("_common.toml").get("tails", ())}
    for tail, kind in kinds.items():
        out.setdefault(tail.rpartition(".")[2], []).append((tail, kind))
    return {last: tuple(tails) for last, tails in out.items()}


@lru_cache(maxsize=1)
def _ending_kinds() -> tuple[tuple[str, str], ...]:
    doc = _load_toml("_common.toml")
    return tuple((entry["ending"], entry["kind"]) for entry in doc.get("endings", ()))


def split_suffix(name: str) -> tuple[str, str, str]:
    """`a.b.weight_scale` -> (`a.b`, `weight_scale`, kind). Suffixes are whole dotted parts;
    a few formats glue an ending to the module instead (`experts.gate_up_proj_blocks` ->
    (`experts.gate_up_proj`, `blocks`, packed_fp4))."""
    module, _, last = name.rpartition(".")
    for tail, tail_kind in _tail_kinds().get(last, ()):
        if name.endswith("." + tail):
            return name[: -len(tail) - 1], tail, tail_kind
    kind = _suffix_kinds().get(last)
    if kind is not None:
        return module, last, kind
    for ending, ending_kind in _ending_kinds():
        if last.endswith(ending) and len(last) > len(ending):
            return name[: -len(ending)], ending[1:], ending_kind
    return name, "", UNKNOWN


def split_suffixes(names) -> dict[str, tuple[str, str, str]]:
    """``split_suffix`` of every name (10^5 of them): the split depends only on the last dotted
    part, so it is worked out once per distinct last part (a few dozen) and applied by slicing."""
    rules: dict[str, tuple[int | None, str, str]] = {}  # last part -> (chars cut from the end | None for the dot, suffix, kind)
    out: dict[str, tuple[str, str, str]] = {}
    tails = _tail_kinds()
    for name in names:
        module, _, last = name.rpartition(".")
        if last in tails:  # a suffix of several parts: split name by name
            out[name] = split_suffix(name)
            continue
        rule = rules.get(last)
        if rule is None:
            split_module, suffix, kind = split_suffix(last)
            if not suffix:  # unknown: the whole name is the module
                cut: int | None = 0
            elif suffix == last:  # a whole dotted part
                cut = None
            else:  # an ending glued to the module
                cut = len(last) - len(split_module)
            rule = rules[last] = (cut, suffix, kind)
        cut, suffix, kind = rule
        out[name] = (module if cut is None else name[: len(name) - cut], suffix, kind)
    return out


def _load_toml(file_name: str) -> dict[str, Any]:
    text = (LAYOUTS_DIR / file_name).read_text(encoding="utf-8")
    return tomllib.loads(text)


NEVER = "(?!)"  # a regex that matches nothing


def mtp_layer_pattern(config: dict[str, Any] | None) -> str:
    """Regex alternation of the next-n (MTP) layer indices a config declares, or NEVER."""
    text = (config or {}).get("text_config") if isinstance((config or {}).get("text_config"), dict) else None
    source = text or config or {}
    first, count = source.get("num_hidden_layers"), source.get("num_nextn_predict_layers")
    if not isinstance(first, int) or not isinstance(count, int) or count < 1:
        return NEVER
    return "(?:" + "|".join(str(first + k) for k in range(count)) + ")"


def _build(doc: dict[str, Any], mtp: str = NEVER, *, inferred: bool = False, derived: bool = False, expert_counts: frozenset[int] = frozenset()) -> Layout:
    return Layout(
        name=doc["name"],
        architectures=tuple(doc.get("architectures", ())),
        model_types=tuple(doc.get("model_types", ())),
        components=tuple(
            (component, tuple(re.compile(p.replace("{mtp_layer}", mtp)) for p in patterns))
            for component, patterns in doc["components"].items()
        ),
        fused={k: tuple(v) for k, v in doc.get("fused", {}).items()},
        inferred=inferred,
        unquantized=tuple(re.compile(p.replace("{mtp_layer}", mtp)) for p in doc.get("unquantized", ())),
        derived=derived,
        expert_counts=expert_counts,
        unplaced=tuple(sorted(doc.get("unplaced", {}).items())),
    )


@lru_cache(maxsize=None)
def _layout_docs() -> tuple[dict[str, Any], ...]:
    docs = []
    directory = LAYOUTS_DIR
    for entry in sorted(directory.iterdir(), key=lambda e: e.name):
        if not entry.name.endswith(".toml") or entry.name.startswith("_"):
            continue
        docs.append(tomllib.loads(entry.read_text(encoding="utf-8")))
    return tuple(docs)


@lru_cache(maxsize=1)
def quantizable_components() -> tuple[str, ...]:
    """The components a recipe may quantize (their modules are Linears), as ``_common.toml`` lists them."""
    names = tuple(_load_toml("_common.toml")["quantizable_components"])
    defined = {component for doc in _layout_docs() for component in doc["components"]}
    undefined = [name for name in names if name not in defined]
    if undefined:
        raise LayoutError(f"layouts/_common.toml: quantizable components {undefined} are components of no architecture table")
    return names


@lru_cache(maxsize=None)
def all_layouts() -> tuple[Layout, ...]:
    """Every table, without config-specific parts (no MTP layers)."""
    return tuple(_build(doc) for doc in _layout_docs())


@lru_cache(maxsize=64)
def _specialised(name: str, mtp: str) -> Layout:
    doc = next(d for d in _layout_docs() if d["name"] == name)
    return _build(doc, mtp)


def infer_layout(config: dict[str, Any] | None = None) -> Layout:
    """The fallback layout: components from common name patterns, marked ``inferred``."""
    doc = dict(_load_toml("_inferred.toml"))
    architectures = (config or {}).get("architectures") or []
    label = architectures[0] if architectures else (config or {}).get("model_type")
    doc["name"] = f"inferred ({label})" if label else "inferred"
    return _build(doc, mtp_layer_pattern(config), inferred=True, expert_counts=expert_counts(config))


def layout_or_inferred(config: dict[str, Any] | None, name: str | None = None) -> Layout:
    """The named layout, else the config's table, else the layout derived from the transformers
    model class (:func:`derived_layout`), else the inferred layout: never a refusal, for read-only
    reports (bytes, audit). Writers (quantize) use :func:`layout_for_config`, which refuses."""
    if name:
        return layout_by_name(name, config)
    try:
        table = layout_for_config(config)
    except LayoutError:
        return derived_layout(config) or infer_layout(config)
    if _names_table(table, config):
        return table
    # A table found through the text model's type only (a wrapper no table lists: Kimi-K2.5 over
    # Kimi-K2) was written for the text model's names, not the wrapper's prefixes.
    return derived_layout(config) or table


def _names_table(table: Layout, config: dict[str, Any] | None) -> bool:
    """The table lists the config's own architecture or model type (not only its text model's)."""
    config = config or {}
    architectures = config.get("architectures") or []
    return config.get("model_type") in table.model_types or any(a in table.architectures for a in architectures if isinstance(a, str))


# -- derived layouts --------------------------------------------------------------------------------
# The routed-expert count under every spelling transformers' config classes use.
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
DERIVED_CACHE_VERSION = 1
VLLM_PACKED = "_vllm_packed.json"
_WHOLE_NUMBER_PART = re.compile(r"(?<=\\\.)\d+(?=\\\.|$)")  # a dotted part that is a number, in an escaped name


def expert_counts(config: dict[str, Any] | None) -> frozenset[int]:
    """Every routed-expert count a config (and its nested configs) states, counts above 1."""
    found: set[int] = set()
    for key, value in (config or {}).items():
        if isinstance(value, dict):
            found |= expert_counts(value)
        elif key in EXPERT_COUNT_KEYS and type(value) is int and value > 1:
            found.add(value)
    return frozenset(found)


@lru_cache(maxsize=1)
def _vllm_packed_data() -> dict[str, Any]:
    import json

    return json.loads((LAYOUTS_DIR / VLLM_PACKED).read_text(encoding="utf-8"))


def vllm_packed_groups() -> dict[str, dict[str, list[str]]]:
    """Architecture -> vLLM's fused groups (scripts/vllm_packed_modules.py writes the data)."""
    return _vllm_packed_data()["architectures"]


def vllm_remaps_kv_scales(architecture: str | None) -> bool:
    """Whether vLLM's loader for this architecture lands either layout's KV-scale names on the
    attention layer (the same data: AutoWeightsLoader or maybe_remap_kv_scale_name)."""
    return architecture in _vllm_packed_data().get("kv_scales_remapped", ())


def _vllm_groups(*architectures: str) -> dict[str, list[str]]:
    """vLLM's fused groups for the first of these class names vLLM's table gives groups for; a
    wrapper without any there falls back to its text model's causal LM."""
    table = vllm_packed_groups()
    named = [a for a in architectures if isinstance(a, str)]
    names = [*named, *(a.replace("ForConditionalGeneration", "ForCausalLM") for a in named)]
    return next((table[n] for n in names if table.get(n)), {})


def module_templates(components: dict[str, str]) -> dict[str, list[str]]:
    """On-disk tensor name -> component, turned into per-component regexes over module names:
    numbered parts (layers, experts) generalised, except where one template would hold modules
    of two components (those keep their exact names)."""
    by_template: dict[str, dict[str, set[str]]] = {}
    for name, component in components.items():
        module, _, kind = split_suffix(name)
        escaped = re.escape(module if kind != UNKNOWN else name)
        by_template.setdefault(_WHOLE_NUMBER_PART.sub(r"\\d+", escaped), {}).setdefault(component, set()).add(escaped)
    out: dict[str, list[str]] = {}
    for template, owners in by_template.items():
        for component, exact in owners.items():
            patterns = [template] if len(owners) == 1 else sorted(exact)
            out.setdefault(component, []).extend(f"^{p}$" for p in patterns)
    return {component: sorted(patterns) for component, patterns in out.items()}


# Next-n (MTP) layers transformers does not build (DeepSeek's layer 61, Qwen's `mtp.*`): matched
# before the derived templates, whose layer index would take them for trunk layers.
MTP_PATTERNS = (r"^(.+\.)?layers\.{mtp_layer}(\..+)?$", r"^(.+\.)?mtp(\..+)?$")


def _with_mtp_first(components: dict[str, list[str]]) -> dict[str, list[str]]:
    return {"mtp": [*MTP_PATTERNS, *components.pop("mtp", [])], **components}


def _derived_doc(config: dict[str, Any]) -> dict[str, Any] | None:
    """The derived layout's table for ``config``, through the on-disk cache; None when
    transformers cannot build the model."""
    import json

    from fp4forge.checkpoint import skeleton_cache
    from fp4forge.errors import Fp4forgeError

    config = {k: v for k, v in config.items() if k != "quantization_config"}
    key = skeleton_cache.cache_key(config, extra=("layout_derive.py", "layout.py", f"layouts/{VLLM_PACKED}", DERIVED_CACHE_VERSION))
    path = skeleton_cache.cache_dir().parent / "layouts" / f"{key}.json"
    try:
        cached = json.loads(path.read_text(encoding="utf-8"))
        return None if "underivable" in cached else cached
    except (OSError, ValueError, TypeError):
        pass
    try:
        from fp4forge.checkpoint.layout_derive import derive_components

        derived = derive_components(config)
    except (Fp4forgeError, ImportError, ValueError, KeyError, TypeError, AttributeError, RuntimeError) as exc:
        # remembered, so a model type transformers does not know costs the torch import once
        skeleton_cache.write_json(path, {"underivable": f"{type(exc).__name__}: {exc}"})
        return None
    architectures = config.get("architectures") or [derived.architecture]
    doc = {
        "name": f"derived ({architectures[0]})",
        "architectures": [architectures[0]],
        "components": _with_mtp_first(module_templates(derived.components)),
        "fused": _vllm_groups(architectures[0], derived.architecture),
        "unplaced": derived.reasons,
    }
    skeleton_cache.write_json(path, doc)
    return doc


def derived_layout(config: dict[str, Any] | None) -> Layout | None:
    """The layout derived from the transformers model class of ``config`` (cached), or None."""
    if not config or not isinstance(config.get("model_type"), str):
        return None
    doc = _derived_doc(config)
    if doc is None:
        return None
    return _build(doc, mtp_layer_pattern(config), derived=True)


def layout_by_name(name: str, config: dict[str, Any] | None = None) -> Layout:
    for doc in _layout_docs():  # the tables' text: only the chosen one's patterns are compiled
        if doc["name"] == name:
            return _specialised(name, mtp_layer_pattern(config))
    raise LayoutError(f"no layout named {name!r}; known: {', '.join(l.name for l in all_layouts())}")


def layout_for_config(config: dict[str, Any] | None) -> Layout:
    """Pick the layout from config.json's `architectures` / `model_type`."""
    if not config:
        raise LayoutError("no config.json: name the architecture layout explicitly", option="layout")
    architectures = config.get("architectures") or []
    model_types = {config.get("model_type")}
    if isinstance(config.get("text_config"), dict):  # wrappers name the text model's type inside
        model_types.add(config["text_config"].get("model_type"))
    for doc in _layout_docs():  # the tables' text: only the chosen one's patterns are compiled
        if any(a in doc.get("architectures", ()) for a in architectures) or model_types & set(doc.get("model_types", ())):
            return _specialised(doc["name"], mtp_layer_pattern(config))
    known = ", ".join(a for l in all_layouts() for a in l.architectures)
    raise LayoutError(f"no layout for architecture {architectures or config.get('model_type')!r}; known: {known}", option="layout")
