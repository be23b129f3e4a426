"""Names against the architecture: every tensor must map to a parameter of the model config.json
describes, and every parameter must be present, with the shape the config implies. Expected
names come from the model class built on the meta device (``checkpoint.skeleton``): the on-disk
names save_pretrained writes (per-expert 2-D), not transformers' fused in-memory ones.

Quantized names map back to their parameter (`<m>.weight_packed`, `<m>.weight_scale`, … →
`<m>.weight`); KV scales are the declarations check's business. Misses are grouped by pattern,
and an unexpected pattern that differs from a missing one in a single name part is reported as a
rename ("`mlp.shared_mlp.*` present where `mlp.shared_expert.*` is expected").

Also here: the serving engine's known blind spots (``serving_quirks.toml``), by engine version.
"""

from __future__ import annotations

import math
import operator
import re
from itertools import compress, filterfalse
from operator import itemgetter, ne, not_
import tomllib
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from typing import Any

from fp4forge.audit.context import AuditContext, issue, modules_noun, parse_version
from fp4forge.audit.findings import Issue
from fp4forge.checkpoint import vllm_params
from fp4forge.checkpoint.declarations import not_understood
from fp4forge.checkpoint.layout import UNKNOWN, split_suffix

# Kinds that hang off a Linear's weight rather than being a parameter of their own.
WEIGHT_METADATA_KINDS = ("packed_fp4", "packed_weight", "weight_scale", "weight_global_scale", "input_scale", "input_global_scale", "zero_point", "g_idx", "quant_state")
LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")
NUMERIC_PART = re.compile(r"\.\d+(?=\.|$)")
ENGINE_NAMES = {"vllm": "vLLM", "sglang": "SGLang"}
VERSION_COMPARISONS = {"<=": operator.le, ">=": operator.ge, "==": operator.eq, "<": operator.lt, ">": operator.gt}


# -- comparison -----------------------------------------------------------------------------------
@dataclass
class NameComparison:
    unexpected: dict[str, list[str]] = field(default_factory=dict)  # parameter name -> stored tensors
    missing: list[str] = field(default_factory=list)
    wrong_shape: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = field(default_factory=list)


MTP = "mtp"


def compare(ctx: AuditContext, expected: dict[str, tuple[int, ...]], *, packing: int | None = None) -> NameComparison:
    result = NameComparison()
    mtp = ctx.mtp_tensors
    owner: dict[str, str] = {}  # module -> the parameter its metadata belongs to (a few tensors each)

    def owner_of(module: str) -> str:
        # `<m>.weight_scale` belongs to `<m>.weight`; MXFP4's `<p>_blocks` to the suffix-less `<p>`
        weight = f"{module}.weight"
        parameter = owner[module] = module if weight not in expected and module in expected else weight
        return parameter

    metadata = _METADATA_KINDS
    names = list(ctx.tensors)
    # the parameter each tensor stands for (None: KV scales and MTP layers, checked elsewhere);
    # roles holds the names in the same order: one pass, then C-level passes over the columns
    parameters = [
        None if kind == "kv_scale" or name in mtp else ((owner.get(module) or owner_of(module)) if kind in metadata else name)
        for name, (module, _, kind) in zip(names, ctx.roles.values())
    ]
    known = list(map(expected.__contains__, parameters))
    unexpected = result.unexpected
    for name, parameter in compress(zip(names, parameters), map(not_, known)):
        if parameter is not None:
            unexpected.setdefault(parameter, []).append(name)
    found = set(compress(parameters, known))
    # shapes of the tensors that are their own parameter (metadata tensors have their own shapes)
    own = [name for name, parameter, hit in zip(names, parameters, known) if hit and parameter is name]
    infos = list(map(itemgetter(1), map(ctx.tensors.__getitem__, own)))
    differs = map(ne, map(itemgetter(2), infos), map(expected.__getitem__, own))
    fits: dict[tuple, bool] = {}  # (stored shape, dtype, expected shape) -> fits: 10^4 packed weights, a few shapes
    for name, info in compress(zip(own, infos), differs):
        signature = (info.shape, info.dtype, expected[name])
        fit = fits.get(signature)
        if fit is None:
            fit = fits[signature] = _shape_fits(*signature, packing)
        if not fit:
            result.wrong_shape.append((name, tuple(info.shape), expected[name]))
    result.missing = list(filterfalse(found.__contains__, expected))
    return result


_METADATA_KINDS = frozenset(WEIGHT_METADATA_KINDS)


def _shape_fits(stored: tuple[int, ...], dtype: str, expected: tuple[int, ...], packing: int | None = None) -> bool:
    if tuple(stored) == tuple(expected):
        return True
    if packing and dtype in ("U8", "I8") and math.prod(stored) * packing == math.prod(expected):
        return True  # bitsandbytes stores its packed values flat ([n / 2, 1])
    if packing and len(expected) == 2 and tuple(stored) == (expected[0], expected[1] // packing):
        return True  # packed codes in another dtype than the format's: the declaration checks judge the dtype
    # ModelOpt stores packed FP4 as a U8 `.weight` of [out, in/2].
    return dtype == "U8" and len(expected) == 2 and tuple(stored) == (expected[0], expected[1] // 2)


def pattern_of(name: str) -> str:
    return NUMERIC_PART.sub(".*", name)


def find_renames(unexpected: list[str], missing: list[str]) -> dict[str, tuple[str, int]]:
    """unexpected name -> (the missing name it stands for, differing part index), where the two
    differ in exactly one non-numeric dotted part."""
    index: dict[tuple[int, int, tuple[str, ...]], str] = {}
    for name in missing:
        parts = name.split(".")
        for i, part in enumerate(parts):
            if not part.isdigit():
                index.setdefault((len(parts), i, tuple(parts[:i] + parts[i + 1 :])), name)
    renames: dict[str, tuple[str, int]] = {}
    taken: set[str] = set()
    for name in unexpected:
        parts = name.split(".")
        for i, part in enumerate(parts):
            target = index.get((len(parts), i, tuple(parts[:i] + parts[i + 1 :])))
            if target is not None and not part.isdigit() and target not in taken:
                renames[name] = (target, i)
                taken.add(target)
                break
    return renames


def _rename_phrase(old: str, new: str, position: int) -> str:
    old_parts, new_parts = old.split("."), new.split(".")
    before = old_parts[position - 1] if position > 0 and not old_parts[position - 1].isdigit() else None
    after = ".*" if position < len(old_parts) - 1 else ""
    lead = f"{before}." if before else ""
    return f"`{lead}{old_parts[position]}{after}` present where `{lead}{new_parts[position]}{after}` is expected"


def _layers(names: list[str]) -> set[str]:
    return {m.group(1) for n in names if (m := LAYER_INDEX.search(n))}


MAX_PREFIX_PARTS = 3  # wrapper prefixes are short: `model.language_model.`, `language_model.model.`


def find_prefix_rename(unexpected: list[str], missing: list[str]) -> tuple[str, str, dict[str, str]] | None:
    """(stored prefix, expected prefix, {unexpected: missing}) when one prefix change explains
    most names: a wrapper's `model.language_model.` stored for a text model's `model.` or the
    reverse. Tried by dropping up to three leading parts on each side; the best mapping wins."""
    if not unexpected or not missing:
        return None
    best: tuple[str, str, dict[str, str]] | None = None
    for drop_missing in range(MAX_PREFIX_PARTS + 1):
        tails: dict[str, str] = {}
        for name in missing:
            parts = name.split(".")
            if len(parts) > drop_missing + 1:
                tails.setdefault(".".join(parts[drop_missing:]), name)
        for drop_stored in range(MAX_PREFIX_PARTS + 1):
            if drop_stored == drop_missing == 0:
                continue
            pairs: dict[tuple[str, str], dict[str, str]] = {}
            for name in unexpected:
                parts = name.split(".")
                if len(parts) <= drop_stored + 1:
                    continue
                target = tails.get(".".join(parts[drop_stored:]))
                if target is not None:
                    key = (".".join(parts[:drop_stored]), ".".join(target.split(".")[:drop_missing]))
                    pairs.setdefault(key, {})[name] = target
            for (old, new), mapping in pairs.items():
                if old != new and (best is None or len(mapping) > len(best[2])):
                    best = (old, new, mapping)
    if best is None or len(best[2]) < max(2, len(unexpected) // 2):
        return None
    return best


def _dotted(prefix: str) -> str:
    return f"{prefix}." if prefix else "(no prefix)"


def name_issues(ctx: AuditContext, comparison: NameComparison, architecture: str) -> list[Issue]:
    issues: list[Issue] = []
    prefix = find_prefix_rename(list(comparison.unexpected), comparison.missing)
    if prefix is not None:
        old, new, mapping = prefix
        stored = [t for n in mapping for t in comparison.unexpected[n]]
        # One finding for the whole prefix: a wrapper/text-model mismatch, not dozens of renames.
        issues.append(issue("tensor-misnamed", "a name prefix that differs from the model class's", f"`{_dotted(old)}*` present where `{_dotted(new)}*` is expected", tensors=stored, detail=_count(len(mapping), "parameter"), file=ctx.file_of(stored[0]), note=f"{architecture} would load none of them under this prefix; rename the tensors, or name the model class that stores them so"))
        taken = set(mapping.values())
        comparison = NameComparison({n: t for n, t in comparison.unexpected.items() if n not in mapping}, [n for n in comparison.missing if n not in taken], comparison.wrong_shape)
    renames = find_renames(list(comparison.unexpected), comparison.missing)
    by_phrase: dict[str, list[tuple[str, str]]] = {}
    for old, (new, position) in renames.items():
        by_phrase.setdefault(_rename_phrase(old, new, position), []).append((old, new))
    for phrase, pairs in by_phrase.items():
        new_names = [new for _, new in pairs]
        component = ctx.component(split_suffix(new_names[0])[0])
        layers = _layers(new_names)
        scope = f"{len(layers):,} layers' {modules_noun(component)}" if layers else modules_noun(component)
        note = f"{scope} would stay uninitialised ({len(pairs):,} parameters)"
        for old, new in pairs:
            issues.append(issue("tensor-misnamed", phrase, old, tensors=comparison.unexpected[old], file=ctx.file_of(comparison.unexpected[old][0]), note=note))
    rest_unexpected = [n for n in comparison.unexpected if n not in renames]
    renamed_targets = {new for new, _ in renames.values()}
    rest_missing = [n for n in comparison.missing if n not in renamed_targets]
    for pattern, names in _by_pattern(rest_unexpected).items():
        stored = [t for n in names for t in comparison.unexpected[n]]
        issues.append(issue("tensor-unexpected", f"tensors matching no parameter of {architecture}", pattern, tensors=stored, detail=_count(len(stored), "tensor"), file=ctx.file_of(stored[0])))
    for pattern, names in _by_pattern(rest_missing).items():
        component = ctx.component(split_suffix(names[0])[0])
        detail = _count(len(names), "parameter") + (f", {modules_noun(component)}" if component != UNKNOWN else "")
        issues.append(issue("parameter-missing", f"parameters of {architecture} absent from the checkpoint", pattern, tensors=names, detail=detail, note="they would stay uninitialised at serve time"))
    for name, stored, expected in comparison.wrong_shape:
        issues.append(issue("parameter-shape-mismatch", "tensors whose shape differs from config.json's", name, tensors=[name], detail=f"{list(stored)}, expected {list(expected)}", file=ctx.file_of(name)))
    return issues


def _by_pattern(names: list[str]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for name in names:
        out.setdefault(pattern_of(name), []).append(name)
    return out


def _count(n: int, noun: str) -> str:
    return f"{n:,} {noun}{'s' if n != 1 else ''}"


# -- serving engine blind spots -------------------------------------------------------------------
@dataclass(frozen=True)
class Quirk:
    id: str
    engine: str
    affects: str
    architectures: tuple[str, ...]
    tensors: re.Pattern[str]
    effect: str
    workaround: str
    source: str
    when_config: dict[str, Any]

    def applies_to(self, version: tuple[int, ...], config: dict[str, Any]) -> bool:
        if not version_matches(version, self.affects):
            return False
        if not set(config.get("architectures") or []) & set(self.architectures):
            return False
        return all(config.get(key) == value for key, value in self.when_config.items())


@lru_cache(maxsize=1)
def serving_quirks() -> tuple[Quirk, ...]:
    text = resources.files("fp4forge.audit").joinpath("serving_quirks.toml").read_text(encoding="utf-8")
    return tuple(
        Quirk(
            id=q["id"],
            engine=q["engine"],
            affects=q["affects"],
            architectures=tuple(q["architectures"]),
            tensors=re.compile(q["tensors"]),
            effect=q["effect"],
            workaround=q["workaround"],
            source=q["source"],
            when_config=dict(q.get("when_config", {})),
        )
        for q in tomllib.loads(text)["quirk"]
    )


def version_matches(version: tuple[int, ...], spec: str) -> bool:
    """`(0, 32)` against `"<=0.32"` / `">=0.30,<0.34"`."""
    for clause in (c.strip() for c in spec.split(",") if c.strip()):
        op = next(o for o in VERSION_COMPARISONS if clause.startswith(o))
        bound = parse_version(clause[len(op) :])
        width = max(len(version), len(bound))
        if not VERSION_COMPARISONS[op](version + (0,) * (width - len(version)), bound + (0,) * (width - len(bound))):
            return False
    return True


def quirk_issues(ctx: AuditContext) -> list[Issue]:
    config = ctx.ckpt.config or {}
    version = ".".join(map(str, ctx.vllm_version))
    issues = []
    for quirk in serving_quirks():
        if not quirk.applies_to(ctx.vllm_version, config):
            continue
        note = f"{quirk.effect}. Workaround: {quirk.workaround} (source: {quirk.source})"
        for name in (n for n in ctx.tensors if quirk.tensors.fullmatch(n)):
            issues.append(issue("serving-blind-spot", f"tensors {ENGINE_NAMES.get(quirk.engine, quirk.engine)} {version} mishandles ({quirk.id})", name, tensors=[name], file=ctx.file_of(name), note=note))
    return issues


# -- entry point ----------------------------------------------------------------------------------
def run(ctx: AuditContext) -> list[Issue]:
    issues = quirk_issues(ctx)
    if not ctx.ckpt.config:
        return issues  # config-missing is reported by the integrity checks
    expected, reason = ctx.expected
    architecture = ", ".join(ctx.ckpt.config.get("architectures") or []) or str(ctx.ckpt.config.get("model_type"))
    if expected is None:
        hint = "" if ctx.trust_remote_code else " (a remote-code model needs --trust-remote-code)"
        return issues + [issue("names-not-checked", "expected names", architecture, detail=(reason or "unknown reason") + hint)]
    if ctx.declaration is not None and not ctx.declaration.groups and not_understood(ctx.declaration):
        return issues  # a format fp4forge cannot judge names its tensors its own way (format-not-judged says so)
    comparison = compare(ctx, expected, packing=declared_packing(ctx.declaration))
    issues += skipped_by_vllm_issues(ctx, comparison, architecture)
    issues += name_issues(ctx, comparison, architecture)
    return issues + mtp_issues(ctx)


def skipped_by_vllm_issues(ctx: AuditContext, comparison: NameComparison, architecture: str) -> list[Issue]:
    """Unexpected tensors vLLM's loader for this architecture skips rather than refuses (the zero
    `.bias` every AutoGPTQ QuantLinear stores, docs/formats.md#tensors-vllms-loader-skips): taken
    out of ``comparison`` and named once, as information."""
    suffixes = tuple(f".{s}" for s in vllm_params.suffixes_skipped_by_loader(ctx.ckpt.config.get("architectures") or []))
    skipped = [name for name in comparison.unexpected if name.endswith(suffixes)] if suffixes else []
    if not skipped:
        return []
    stored = [t for name in skipped for t in comparison.unexpected.pop(name)]
    patterns = ", ".join(_by_pattern(skipped))
    return [issue("tensor-skipped-by-vllm", f"tensors no parameter of {architecture} takes, which vLLM {vllm_params.vllm_version()}'s loader skips", patterns,
                  tensors=stored, detail=_count(len(stored), "tensor"), file=ctx.file_of(stored[0]))]


def declared_packing(decl) -> int | None:
    """Values per stored element of a quantized weight stored under its own name (bitsandbytes'
    U8 `weight`), where every group of the declaration agrees; None otherwise."""
    packings = {group.values_per_element for group in decl.groups} if decl is not None else set()
    return packings.pop() if len(packings) == 1 else None


def mtp_issues(ctx: AuditContext) -> list[Issue]:
    """Next-n (multi-token-prediction) layers: their own component, not part of the model's
    forward pass; named here once rather than checked against the trunk's skeleton."""
    if not ctx.mtp_tensors:
        return []
    names = sorted(ctx.mtp_tensors)
    layers = sorted({m.group(1) for n in names if (m := LAYER_INDEX.search(n))}, key=int) or ["mtp"]
    return [issue("mtp-layers", "next-n (MTP) layers", ", ".join(f"layer {x}" if x.isdigit() else x for x in layers), tensors=names, detail=_count(len(names), "tensor"), file=ctx.file_of(names[0]))]
