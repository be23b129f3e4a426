"""Turn (source checkpoint headers, layout, recipe, output layout) into an export plan:
every output tensor's name, dtype and shape, and the order of work units (one fused group at
a time), all before a single value is read. The writer needs the full list up front; the
audit and the benchmarks reuse it to build shape-true quantized checkpoints without data.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fp4forge.checkpoint.layout import Layout, split_suffix
from fp4forge.checkpoint.schemes import kv_scale_specs, linear_tensor_specs
from fp4forge.checkpoint.writer import TensorSpec
from fp4forge.errors import ConfigError
from fp4forge.quantize.recipe import Recipe

ATTENTION_MODULE = "self_attn"


@dataclass(frozen=True)
class LinearTarget:
    module: str
    component: str
    scheme: str
    out_features: int
    in_features: int
    source_dtype: str


@dataclass
class WorkUnit:
    """Tensors processed together: a fused group of Linears (sharing a global scale), one
    Linear, or one pass-through tensor."""

    key: str
    linears: list[LinearTarget] = field(default_factory=list)
    passthrough: list[str] = field(default_factory=list)


@dataclass
class ExportPlan:
    layout_format: str  # "compressed-tensors" | "modelopt"
    recipe: Recipe
    units: list[WorkUnit]
    output_specs: list[TensorSpec]
    targets: dict[str, LinearTarget]
    kv_layers: list[str]  # `model.layers.N` prefixes that get k/v scales
    ignored: list[str]  # modules a rule covered but its ignore list excluded (recorded in the config)

    @property
    def fused_groups(self) -> list[list[str]]:
        return [[t.module for t in u.linears] for u in self.units if len(u.linears) > 1]


def fused_group_key(module: str, layout: Layout) -> str | None:
    """`...self_attn.k_proj` -> `...self_attn:qkv` when the layout fuses it; else None."""
    parent, _, leaf = module.rpartition(".")
    for group, members in layout.fused.items():
        if leaf in members:
            return f"{parent}:{group}"
    return None


def plan_export(
    source_specs: list[TensorSpec],
    layout: Layout,
    recipe: Recipe,
    layout_format: str,
) -> ExportPlan:
    by_name = {s.name: s for s in source_specs}
    targets: dict[str, LinearTarget] = {}
    rule_hits = [0] * len(recipe.rules)
    ignored: set[str] = set()
    for spec in source_specs:
        module, suffix, kind = split_suffix(spec.name)
        if suffix != "weight" or len(spec.shape) != 2:
            continue
        component = layout.component_of(module)
        claimed = [i for i, rule in enumerate(recipe.rules) if rule.claims(module, component)]
        if not claimed and any(component in r.components for r in recipe.rules):
            ignored.add(module)
        if len(claimed) > 1:
            raise ConfigError(
                f"recipe {recipe.name}: module {module} is claimed by rules {[recipe.rules[i].describe() for i in claimed]} (ambiguous)"
            )
        if claimed:
            rule_hits[claimed[0]] += 1
            out_features, in_features = spec.shape
            targets[module] = LinearTarget(module, component, recipe.rules[claimed[0]].scheme, out_features, in_features, spec.dtype)
    for rule, hits in zip(recipe.rules, rule_hits):
        if hits == 0:
            raise ConfigError(f"recipe {recipe.name}: rule '{rule.describe()}' targets nothing in this checkpoint")

    # Work units in source order; fused members join their group's unit.
    units: dict[str, WorkUnit] = {}
    for spec in source_specs:
        module, suffix, _ = split_suffix(spec.name)
        target = targets.get(module) if suffix == "weight" else None
        if target is None:
            units.setdefault(spec.name, WorkUnit(key=spec.name)).passthrough.append(spec.name)
            continue
        group = fused_group_key(module, layout) or module
        units.setdefault(group, WorkUnit(key=group)).linears.append(target)
    _check_fused_groups(units.values(), layout, by_name, targets)

    output_specs: list[TensorSpec] = []
    for unit in units.values():
        for target in unit.linears:
            output_specs += linear_tensor_specs(layout_format, target.scheme, target.module, target.out_features, target.in_features)
        output_specs += [by_name[n] for n in unit.passthrough]
    kv_layers: list[str] = []
    if recipe.kv_cache_scheme:
        kv_layers = sorted(
            {t.module.rsplit(f".{ATTENTION_MODULE}.", 1)[0] for t in _attention_projections(source_specs, layout)},
            key=_layer_sort_key,
        )
        for prefix in kv_layers:
            output_specs += kv_scale_specs(layout_format, prefix)
    return ExportPlan(layout_format, recipe, list(units.values()), output_specs, targets, kv_layers, sorted(ignored))


def _attention_projections(specs: list[TensorSpec], layout: Layout) -> list[LinearTarget]:
    found = []
    for spec in specs:
        module, suffix, _ = split_suffix(spec.name)
        if suffix == "weight" and module.endswith(f".{ATTENTION_MODULE}.k_proj") and layout.component_of(module) == "attention":
            found.append(LinearTarget(module, "attention", "", 0, 0, spec.dtype))
    return found


def _layer_sort_key(prefix: str) -> tuple:
    return tuple(int(p) if p.isdigit() else p for p in prefix.split("."))


def _check_fused_groups(units, layout: Layout, by_name: dict[str, TensorSpec], targets: dict[str, LinearTarget]) -> None:
    """vLLM requires every shard of a fused GEMM to use the same scheme (or all be ignored)."""
    for unit in units:
        if not unit.linears:
            continue
        group = fused_group_key(unit.linears[0].module, layout)
        if group is None:
            continue
        parent, _, group_name = group.rpartition(":")
        members = [f"{parent}.{leaf}" for leaf in layout.fused[group_name] if f"{parent}.{leaf}.weight" in by_name]
        schemes = {targets[m].scheme if m in targets else "unquantized" for m in members}
        if len(schemes) > 1:
            raise ConfigError(
                f"fused group {group} mixes schemes {sorted(schemes)}: vLLM fuses {', '.join(members)} into one GEMM "
                "and requires one scheme for all shards"
            )
