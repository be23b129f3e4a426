"""What every audit check looks at: the opened checkpoint, its layout and declaration, computed
views of its tensors (computed once), and the small helpers the checks share. The checks
(``checks_integrity``, ``checks_declarations``, ``checks_names``) import this module; the engine
imports them; nothing here imports a check."""

from __future__ import annotations

import math
import re
import sys
from array import array
from dataclasses import dataclass, field
from functools import cached_property
from itertools import compress
from operator import itemgetter, not_
from typing import Any

from fp4forge.audit.findings import Issue
from fp4forge.audit.options import parse_version as parse_version  # the checks read it here
from fp4forge.checkpoint.declarations import READ_FORMATS, QuantDeclaration
from fp4forge.checkpoint.layout import UNKNOWN, Layout, split_suffix, split_suffixes
from fp4forge.checkpoint.names import CONFIG_JSON
from fp4forge.checkpoint.raw import can_decode, decode, decode_all, read_coalesced, read_many_small, tensor_index
from fp4forge.checkpoint.reader import Checkpoint
from fp4forge.checkpoint.safetensors_format import DTYPE_BITS, TensorInfo
from fp4forge.checkpoint.skeleton_cache import expected_shapes_or_reason

# Components whose 2-D weights are Linear layers (vLLM builds routers and lm_head as Linears too,
# so a "Linear" target reaches them unless they are ignored). Embeddings and norms are not.
LINEAR_COMPONENTS = ("attention", "routed_experts", "shared_expert", "dense_mlp", "router", "lm_head")
# How messages name each component's modules.
COMPONENT_NOUNS = {
    "routed_experts": "routed-expert Linears",
    "shared_expert": "shared-expert Linears",
    "attention": "attention Linears",
    "dense_mlp": "dense-MLP Linears",
    "router": "routers",
    "lm_head": "lm_head",
    "embeddings": "embeddings",
    "norms": "norms",
}
WEIGHT_SUFFIXES = ("weight", "weight_packed")
SCALE_KINDS = ("weight_scale", "weight_global_scale", "input_scale", "input_global_scale")
SMALL_SCALE_MAX_ELEMENTS = 1 << 16
_SCALE_KIND_SET = frozenset(SCALE_KINDS)
# A numbered or named back-reference: group numbers shift when patterns are joined into one.
_BACKREFERENCE = re.compile(r"\\[1-9]|\(\?P=")


def modules_noun(component: str) -> str:
    return COMPONENT_NOUNS.get(component, f"{component} modules")


@dataclass
class AuditContext:
    """Everything a check may look at, computed once."""

    ckpt: Checkpoint
    layout: Layout | None
    declaration: QuantDeclaration | None
    deep: bool
    fmt: str
    vllm_version: tuple[int, ...]
    trust_remote_code: bool = False
    device: str | None = None  # where --deep reduces the values (model/device.py; None: a GPU if torch sees one)
    _values: dict[str, Any] = field(default_factory=dict, repr=False)
    memo: dict[str, Any] = field(default_factory=dict, repr=False)  # what a check computes once for another

    @cached_property
    def tensors(self) -> dict[str, tuple[str, TensorInfo]]:
        return tensor_index(self.ckpt)

    @cached_property
    def roles(self) -> dict[str, tuple[str, str, str]]:
        """name -> (module, suffix, kind), split once (10^5 names)."""
        return split_suffixes(self.tensors)

    @cached_property
    def mtp_tensors(self) -> frozenset[str]:
        """Tensors of next-n (MTP) layers, by the layout's `mtp` component."""
        patterns = dict(self.layout.components).get("mtp", ()) if self.layout else ()
        if not patterns:
            return frozenset()
        # one alternation matched at the start is any one pattern matched there: one C-level call
        # per module (fewer modules than names), and the names picked by C-level passes
        either = re.compile("|".join(f"(?:{p.pattern})" for p in patterns))
        mtp = set(filter(either.match, self.role_modules))
        if not mtp:
            return frozenset()
        roles = self.roles
        return frozenset(compress(roles, map(mtp.__contains__, map(itemgetter(0), roles.values()))))

    @cached_property
    def role_modules(self) -> set[str]:
        """The module part of every tensor's role (unknown names are their own module)."""
        return set(map(itemgetter(0), self.roles.values()))

    def kind(self, name: str) -> str:
        return self.roles[name][2]

    @cached_property
    def modules(self) -> dict[str, dict[str, TensorInfo]]:
        """module -> {parameter suffix: header entry}, for names with a known suffix."""
        out: dict[str, dict[str, TensorInfo]] = {}
        for (_, info), (module, suffix, kind) in zip(self.tensors.values(), self.roles.values()):  # same order
            if kind != UNKNOWN:
                params = out.get(module)
                if params is None:
                    out[module] = {suffix: info}
                else:
                    params[suffix] = info
        return out

    @property
    def tensor_format(self) -> str | None:
        """compressed-tensors, modelopt, fp8 (block-wise) or mxfp4: whose tensor names the declaration implies."""
        return self.declaration.format if self.declaration and self.declaration.format in READ_FORMATS else None

    def file_of(self, name: str) -> str | None:
        entry = self.tensors.get(name)
        return entry[0] if entry else None

    def component(self, module: str) -> str:
        return self.layout.component_of(module) if self.layout else UNKNOWN

    @cached_property
    def expected(self) -> tuple[dict[str, tuple[int, ...]] | None, str | None]:
        """({on-disk name: shape} of what save_pretrained writes for config.json, None), or
        (None, why not)."""
        if not self.ckpt.config:
            return None, f"no {CONFIG_JSON}"
        return expected_shapes_or_reason(self.ckpt.config, trust_remote_code=self.trust_remote_code)

    @property
    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        return self.expected[0] or {}

    @cached_property
    def linear_modules(self) -> dict[str, str]:
        """Linear module -> component: present with a 2-D weight, or expected by the architecture."""
        out: dict[str, str] = {}
        component = self.component
        for module, params in self.modules.items():
            weight = params.get("weight")  # WEIGHT_SUFFIXES, in order
            if weight is None:
                weight = params.get("weight_packed")
            if weight is not None and len(weight.shape) == 2:
                found = component(module)
                if found in LINEAR_COMPONENTS:
                    out[module] = found
        # Only names ending in "weight" can split to the suffix "weight" (a dotted part or a glued
        # ending); those ending in ".weight" split at that dot, and most name a module seen above.
        # Which name adds a module does not matter (its component depends on the module alone):
        # only the names whose module is not a Linear found above are looked at.
        expected = self.expected_shapes
        ending = [name for name in expected if name.endswith("weight")]
        dotted = [name for name in ending if name.endswith(".weight")] if split_suffix("m.weight")[:2] == ("m", "weight") else []
        glued = [name for name in ending if not name.endswith(".weight")] if dotted else ending
        candidates = [(module, name) for name in dotted if (module := name[:-7]) not in out]
        candidates += [(module, name) for name, (module, suffix, _) in split_suffixes(glued).items() if suffix == "weight"]
        for module, name in candidates:
            if module not in out and len(expected[name]) == 2:
                found = component(module)
                if found in LINEAR_COMPONENTS:
                    out[module] = found
        return dict(sorted(out.items()))

    @cached_property
    def engine_unquantized(self) -> set[str]:
        """Linears vLLM builds without a quantization method whatever is declared: routers and
        lm_head, and the modules the layout lists (``unquantized``)."""
        if self.layout is None:
            return set()
        linears = self.linear_modules
        out = {m for m, c in linears.items() if c in ("router", "lm_head")}
        patterns = self.layout.unquantized
        if not patterns:
            return out
        either = None
        if len({p.flags for p in patterns}) == 1 and not any(_BACKREFERENCE.search(p.pattern) for p in patterns):
            try:  # one alternation matched at the start is any one pattern matched there: one C call per module
                either = re.compile("|".join(f"(?:{p.pattern})" for p in patterns), patterns[0].flags)
            except re.error:  # (e.g. an inline global flag, valid only at the start of a whole pattern)
                either = None
        out.update(filter(either.match, linears) if either is not None else filter(self.layout.is_engine_unquantized, linears))
        return out

    def linear_shape(self, module: str) -> tuple[int, int] | None:
        """[out, in] of a Linear: from the architecture, else from the stored weight."""
        expected = self.expected_shapes.get(f"{module}.weight")
        if expected is not None and len(expected) == 2:
            return expected[0], expected[1]
        params = self.modules.get(module, {})
        if "weight_packed" in params and len(params["weight_packed"].shape) == 2:
            out_features, half = params["weight_packed"].shape
            return out_features, half * 2
        weight = params.get("weight")
        if weight is None or len(weight.shape) != 2:
            return None
        if weight.dtype == "U8":  # ModelOpt's packed FP4: two values per byte
            return weight.shape[0], weight.shape[1] * 2
        return weight.shape[0], weight.shape[1]

    # -- values -------------------------------------------------------------------------------
    @cached_property
    def small_scales(self) -> list[str]:
        """Per-tensor and per-channel scales: read even without --deep. Block scales (NVFP4's F8
        per 16 values, MXFP4's U8 exponents, block-wise FP8's 2-D weight_scale_inv) are not:
        together they are megabytes, read with the weights by --deep."""
        return self._small_scales[0]

    @cached_property
    def _small_scales(self) -> tuple[list[str], list[str], list[tuple[str, TensorInfo]]]:
        """(small_scales, the one-element ones among them, their (shard, entry)): one pass."""
        names = []
        single_names = []
        single_entries = []
        small: dict[tuple, tuple[bool, bool]] = {}  # (kind, dtype, shape) -> (read, one element): 10^5 scales, a few signatures
        scale_kinds = _SCALE_KIND_SET
        # roles holds the names of tensors in the same order: one pass, no lookups
        for (name, (_, _, kind)), entry in zip(self.roles.items(), self.tensors.values()):
            if kind in scale_kinds:
                info = entry[1]
                signature = (kind, info.dtype, info.shape)
                read = small.get(signature)
                if read is None:
                    read = small[signature] = (info.numel <= SMALL_SCALE_MAX_ELEMENTS and not is_block_scale(kind, info), math.prod(info.shape) == 1)
                if read[0]:
                    names.append(name)
                    if read[1]:
                        single_names.append(name)
                        single_entries.append(entry)
        return names, single_names, single_entries

    @cached_property
    def scalar_scales(self) -> dict[str, float]:
        """name -> value of every one-element small scale (10^5 in a large MoE), in small_scales
        order: read in coalesced ranges and decoded in one call per dtype, with no array per name."""
        _, names, entries = self._small_scales
        blobs = read_many_small(self.ckpt, entries)
        dtypes = list(map(itemgetter(1), map(itemgetter(1), entries)))  # TensorInfo.dtype
        by_dtype: dict[str, tuple[list[str], list[bytes]]] = {}
        if len(set(dtypes)) == 1:  # the usual case: every scale F32
            by_dtype[dtypes[0]] = (names, blobs)
        else:
            for name, dtype, blob in zip(names, dtypes, blobs):
                members = by_dtype.get(dtype)
                if members is None:
                    members = by_dtype[dtype] = ([], [])
                members[0].append(name)
                members[1].append(blob)
        out: dict[str, float] = {}
        for dtype, (members, member_blobs) in by_dtype.items():
            width = DTYPE_BITS.get(dtype, 0) // 8
            native = dtype == "F32" and sys.byteorder == "little"  # the usual scale dtype: no numpy needed
            if not width or any(len(blob) != width for blob in member_blobs) or not (native or can_decode(dtype)):
                continue  # torn or undecodable: values() reads these one by one and says why
            joined = b"".join(member_blobs)
            out.update(zip(members, array("f", joined).tolist() if native else decode(dtype, joined).tolist()))
        if len(by_dtype) == 1 and len(out) == len(names):
            return out  # one dtype, every value decoded: already in small_scales order
        return {n: out[n] for n in names if n in out}

    def values(self, names: list[str]) -> dict[str, Any]:
        """Flat float32 numpy arrays for small tensors, read in coalesced byte ranges."""
        stored = self._values
        absent = list(compress(names, map(not_, map(stored.__contains__, names))))
        if absent and "scalar_scales" in self.__dict__:  # decoded already: no second read
            import numpy as np

            scalars = self.scalar_scales
            stored.update((n, np.array([scalars[n]], dtype=np.float32)) for n in absent if n in scalars)
            absent = [n for n in absent if n not in stored]
        wanted = [n for n in absent if n in self.tensors]
        if wanted:
            stored.update(decode_all(read_coalesced(self.ckpt, [self.tensors[n] for n in wanted])))
        kept = list(compress(names, map(stored.__contains__, names))) if absent else names
        return dict(zip(kept, map(stored.__getitem__, kept)))


def is_block_scale(kind: str, info: TensorInfo) -> bool:
    """One scale per block of weights, not per tensor or per output channel."""
    if kind != "weight_scale":
        return False
    if info.dtype in ("F8_E4M3", "U8"):
        return True
    return len(info.shape) == 2 and info.shape[1] > 1  # per-channel scales are [out, 1]


def is_finite_positive(values) -> bool:
    """Every value finite and > 0 (NaN compares false, so `> 0` alone misses only +Inf)."""
    return values.size > 0 and bool((values > 0).all()) and bool((values < math.inf).all())


def describe_value(values) -> str:
    """A short text for a scale's value(s): `0`, `nan`, `-1.5`, or `3 of 128 non-finite or ≤ 0`."""
    import numpy as np

    if values.size == 1:
        value = float(values[0])
        return "nan" if math.isnan(value) else f"{value:g}"
    bad = int((~(np.isfinite(values) & (values > 0))).sum())
    return f"{bad:,} of {values.size:,} values non-finite or ≤ 0"


def issue(rule: str, group: str, subject: str, **kwargs: Any) -> Issue:
    """Shorthand used by the checks."""
    tensors = kwargs.pop("tensors", ())
    return Issue(rule=rule, group=group, subject=subject, tensors=tuple(tensors), **kwargs)
