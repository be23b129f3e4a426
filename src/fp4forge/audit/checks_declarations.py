"""Declarations against tensors: does every Linear the quantization_config (or ModelOpt's
hf_quant_config.json) targets carry exactly its scheme's tensors, with the right dtypes and
shapes; do activation scales match W4A4 vs weight-only; do fused shards share their scales;
are the scales finite and positive; and does a declared FP8 KV cache ship one k and one v scale
per attention layer under the names vLLM loads.

Scales are read even without --deep: they are a few bytes each, read in coalesced ranges.
"""

from __future__ import annotations

import math
import re
import tomllib
from functools import lru_cache
from importlib import resources
from operator import itemgetter

from fp4forge.audit import checks_params
from fp4forge.audit.checks_params import same_shape as _same_shape
from fp4forge.audit.context import SCALE_KINDS, AuditContext, describe_value, is_finite_positive, issue, modules_noun
from fp4forge.audit.deep_scan import FP8_SCHEME, NVFP4_SCHEME, DeepValues, deep_values, magnitude_tensors
from fp4forge.audit.findings import Issue, natural_key
from fp4forge.checkpoint import vllm_ct
from fp4forge.checkpoint.codecs import codec, layout_of_suffix
from fp4forge.checkpoint.declarations import FUSED_LOADING_REFUSES_EXTRA, KEYED_FORMATS, MXFP4, NameSet, QuantDeclaration, Resolution, SchemeGroup, detect_format, resolve
from fp4forge.checkpoint.layout import PACKED_KINDS, split_suffix, vllm_remaps_kv_scales
from fp4forge.checkpoint.names import HF_QUANT_CONFIG_JSON as HF_QUANT_CONFIG
from fp4forge.checkpoint.names import PROVENANCE_JSON
from fp4forge.checkpoint.raw import FLOAT_FORMATS, SCALE_SIGNIFICAND_BITS, cast_verdict, fp8_e4m3_table, iter_values, survives_cast
from fp4forge.checkpoint.schemes import kv_scale_specs, linear_tensor_specs, scheme_table
from fp4forge.errors import ConfigError

FLOAT_WEIGHT_DTYPES = ("BF16", "F16", "F32")
INPUT_SCALE_KINDS = ("input_scale", "input_global_scale")
KV_SUFFIXES = ("k_scale", "v_scale")
EXPERTS = "routed_experts"
MISSING_TENSOR_RULES = ("scheme-tensor-missing", "moe-input-scale-invalid")
W4A4_SCHEME = "nvfp4"
CAST_CHECK_ELEMENTS = 1 << 22  # values read at once when --deep checks a cast
F32_SMALLEST_NORMAL, F32_MAX = 2.0**-126, (2 - 2.0**-23) * 2.0**127


def run(ctx: AuditContext) -> list[Issue]:
    # every small scale in a few coalesced reads, up front: the one-element ones as plain numbers
    scalars = ctx.scalar_scales
    ctx.values([n for n in ctx.small_scales if n not in scalars])
    issues = format_issues(ctx)
    decl = ctx.declaration
    if decl is None:
        issues += undeclared_quantization_issues(ctx)
    else:
        issues += [issue("quant-config-invalid", f"problems in {decl.where}", problem) for problem in decl.problems]
        issues += [issue("scheme-not-audited", "declared schemes without a tensor table", name) for name in decl.unsupported]
        issues += checks_params.format_issues(decl)
        issues += [issue("modelopt-sidecar-differs", f"{HF_QUANT_CONFIG} against config.json", difference) for difference in decl.sidecar_differences]
        issues += [issue("ct-format-string-differs", "group format strings other loaders read otherwise", difference) for difference in decl.loader_differences]
        if ctx.layout is not None and ctx.tensor_format == MXFP4:
            issues += mxfp4_issues(ctx, decl)
        elif ctx.layout is not None and ctx.tensor_format is not None:
            resolution = resolve(decl, list(ctx.linear_modules), engine_unquantized=ctx.engine_unquantized)
            issues += target_issues(ctx, decl, resolution)
            issues += fused_ignore_issues(ctx, resolution)
            issues += scheme_issues(ctx, resolution)
            issues += fused_scale_issues(ctx, resolution)
            issues += checks_params.param_issues(ctx, resolution)
            issues += expert_refusal_issues(ctx, resolution)
            issues += built_weight_issues(ctx, resolution)
        elif ctx.layout is not None and decl.format in KEYED_FORMATS:
            resolution = resolve(decl, list(ctx.linear_modules), engine_unquantized=ctx.engine_unquantized)
            issues += target_issues(ctx, decl, resolution)
            issues += checks_params.param_issues(ctx, resolution)
            for module in sorted(resolution.ignored | resolution.untargeted):
                issues += unexpected_quantization(ctx, module, "ignored" if module in resolution.ignored else "untargeted")
    issues += scale_value_issues(ctx)
    if ctx.deep:
        issues += scale_magnitude_issues(ctx)
        issues += fp8_block_scale_issues(ctx)
    issues += kv_issues(ctx)
    issues += provenance_issues(ctx)
    return issues


def built_weight_issues(ctx: AuditContext, resolution: Resolution) -> list[Issue]:
    """Every compressed-tensors Linear's stored weight against the weight parameter of the scheme
    class vLLM builds for its group (routed experts: their FusedMoE method), where that class's
    parameters are known (checkpoint/vllm_ct.py weight_dtype_built): int arguments over FP8
    codes, or float weights whose experts vLLM builds as int8, load as other numbers."""
    issues: list[Issue] = []
    for module, group in resolution.scheme_of.items():
        weight = ctx.modules.get(module, {}).get("weight")
        if group.key is None or weight is None or weight.dtype in FLOAT_WEIGHT_DTYPES or not vllm_ct.is_ct_key(group.key):
            continue  # (a float weight: unquantized, module-not-quantized's, or a copy the scheme checks judge)
        built = vllm_ct.weight_dtype_built(group.key, ctx.linear_modules.get(module) == EXPERTS)
        if built is not None and weight.dtype != built[1]:
            found = dtype_issue(ctx, f"{module}.weight", built[1], f"{group.description} (vLLM builds {built[0]})", ctx.file_of(f"{module}.weight"))
            if found.rule == "scheme-tensor-dtype":  # a cast vLLM takes unchanged is the scheme checks' warning
                issues.append(found)
    return issues


def expert_refusal_issues(ctx: AuditContext, resolution: Resolution) -> list[Issue]:
    """A group vLLM builds for Linears but whose routed experts its FusedMoE method choice refuses
    (checkpoint/vllm_ct.py moe_refusal), once per group that targets experts."""
    refused: dict[str, list[str]] = {}
    for module, group in resolution.scheme_of.items():
        if group.expert_refusal and ctx.linear_modules.get(module) == EXPERTS:
            refused.setdefault(f"{group.description}: {group.expert_refusal}", []).append(module)
    return [issue("scheme-refused-by-vllm", "declared schemes vLLM refuses", reason, detail=f"{len(modules):,} routed-expert Linears")
            for reason, modules in refused.items()]


def provenance_issues(ctx: AuditContext) -> list[Issue]:
    """fp4forge's own exports say where their activation scales came from."""
    provenance = ctx.ckpt.extra_json.get(PROVENANCE_JSON) or {}
    source = (provenance.get("activation_scales") or {})
    if source.get("source") != "constant":
        return []
    return [issue("activation-scales-constant", "activation and KV scales", f"constant amax {source.get('amax')}", file=PROVENANCE_JSON)]


# -- the declaration itself -----------------------------------------------------------------------
def format_issues(ctx: AuditContext) -> list[Issue]:
    if ctx.fmt == "auto":
        return []
    detected = detect_format(ctx.ckpt.config, ctx.ckpt.extra_json)
    if detected == ctx.fmt:
        return []
    return [issue("quant-format-conflict", "--format", f"audited as {ctx.fmt}, but the checkpoint declares {detected or 'no quantization'}")]


def undeclared_quantization_issues(ctx: AuditContext) -> list[Issue]:
    issues = []
    for module, params in ctx.modules.items():
        quantized = [s for s in params if _kind(s) in SCALE_KINDS + ("packed_fp4",)]
        if quantized:
            tensors = [f"{module}.{s}" for s in quantized]
            issues.append(issue("quantized-without-declaration", "modules with quantization tensors but no quantization_config", module, tensors=tensors, file=ctx.file_of(tensors[0])))
    return issues


def target_issues(ctx: AuditContext, decl: QuantDeclaration, resolution: Resolution) -> list[Issue]:
    issues = [issue("target-matches-nothing", "config-group targets that match no Linear", f"{group}: {target}") for group, target in resolution.unmatched_targets]
    # An ignore entry may name any real module, not only a Linear: llm-compressor's data-free path
    # lists `model.embed_tokens`, ModelOpt's exclude_modules lists norms. Only names that match no
    # module of the checkpoint at all are noise worth a warning.
    # The modules: each tensor's role module and that module's parent. The parents hold every
    # name's dotted parent (a glued ending such as `_blocks`, or an unknown name, leaves the last
    # dot inside the module), and only real modules besides (the block holding a Linear). Every way
    # an entry matches is a property of one name at a time, so the two sets are searched one after
    # the other, the parents only for the entries the role modules left.
    # The Linears among them were searched already (resolve): an unmatched entry matches none.
    roles = ctx.role_modules
    nowhere = [p for p in resolution.unmatched_ignores if p not in roles]
    if nowhere:
        names = NameSet(sorted(roles.difference(ctx.linear_modules)))
        nowhere = [p for p in nowhere if not names.matching(p, decl.matcher)]
    if nowhere:
        parents = {module.rpartition(".")[0] for module in roles} - roles  # 10^4 modules, not 10^5 names
        names = NameSet(sorted(parents))
        nowhere = [p for p in nowhere if p not in parents and not names.matching(p, decl.matcher)]
    issues += [issue("target-matches-nothing", "ignore entries that match no module", pattern) for pattern in nowhere]
    return issues


def fused_groups(ctx: AuditContext) -> list[tuple[str, str, list[str]]]:
    """(parent, group name, member modules) for every fused group whose shards all exist
    (computed once per audit: two checks walk them)."""
    cached = ctx.memo.get("fused_groups")
    if cached is None:
        cached = ctx.memo["fused_groups"] = _fused_groups(ctx)
    return cached


def _fused_groups(ctx: AuditContext) -> list[tuple[str, str, list[str]]]:
    assert ctx.layout is not None
    linears = ctx.linear_modules
    leaf_group = {leaf: (name, members) for name, members in ctx.layout.fused.items() for leaf in members}
    seen: set[tuple[str, str]] = set()
    out = []
    for module in linears:
        parent, _, leaf = module.rpartition(".")
        if leaf not in leaf_group:
            continue
        name, members = leaf_group[leaf]
        if (parent, name) in seen:
            continue
        shards = [f"{parent}.{m}" for m in members]
        if all(map(linears.__contains__, shards)):
            seen.add((parent, name))
            out.append((parent, name, shards))
    return out


def fused_ignore_issues(ctx: AuditContext, resolution: Resolution) -> list[Issue]:
    issues = []
    if not resolution.ignored:
        return issues
    # a group ignored in part has an ignored shard, and so one of the ignored Linears' parents
    parents = {module.rpartition(".")[0] for module in resolution.ignored}
    for parent, name, shards in fused_groups(ctx):
        if parent not in parents:
            continue
        ignored = [s for s in shards if s in resolution.ignored]
        if ignored and len(ignored) != len(shards):
            leaves = ", ".join(s.rpartition(".")[2] for s in ignored)
            issues.append(issue("fused-ignore-inconsistent", f"fused {name} groups ignored in part", f"{parent}.{name}", detail=f"ignored: {leaves}"))
    return issues


# -- per-module tensor sets -----------------------------------------------------------------------
def scheme_issues(ctx: AuditContext, resolution: Resolution) -> list[Issue]:
    issues: list[Issue] = []
    missing_inputs: list[Issue] = []
    w4a4_modules = 0
    w4a4_with_inputs = 0
    # A module's findings depend on its name only through the names they carry: 10^5 Linears
    # share a few hundred (scheme, component, shape, stored tensors) signatures, and a signature
    # found clean once is clean for every module carrying it.
    clean: set[tuple] = set()
    modules, linear_modules = ctx.modules, ctx.linear_modules
    with_inputs: dict[tuple[str, ...], bool] = {}  # stored suffixes -> whether one is an input scale
    expected_shapes, linear_shape = ctx.expected_shapes, ctx.linear_shape
    for module, group in resolution.scheme_of.items():
        if group.scheme is None:
            continue  # unsupported scheme (reported)
        params = modules.get(module)
        if params is None:
            continue  # absent module (a names finding)
        suffixes = tuple(params)
        # linear_shape(module), with its usual case (a 2-D expected weight) inline
        shape = expected_shapes.get(module + ".weight")
        shape = shape if shape is not None and len(shape) == 2 else linear_shape(module)
        signature = (id(group), linear_modules.get(module, ""), shape, suffixes, tuple(map(_DTYPE_AND_SHAPE, params.values())))
        if signature in clean:
            module_issues = []
        else:
            module_issues = module_scheme_issues(ctx, module, group)
            if not module_issues:
                clean.add(signature)
        if group.scheme == W4A4_SCHEME:
            w4a4_modules += 1
            has_inputs = with_inputs.get(suffixes)
            if has_inputs is None:
                has_inputs = with_inputs[suffixes] = any(_kind(s) in INPUT_SCALE_KINDS for s in suffixes)
            w4a4_with_inputs += has_inputs
        for found in module_issues:
            (missing_inputs if _is_missing_input_scale(found) else issues).append(found)
    if w4a4_modules and not w4a4_with_inputs:
        issues.append(issue("w4a4-without-activation-scales", "declared NVFP4 W4A4", f"{w4a4_modules:,} Linears declare 4-bit activations and none carries an input scale"))
    else:
        issues += missing_inputs
    for module in sorted(resolution.ignored | resolution.untargeted):
        issues += unexpected_quantization(ctx, module, "ignored" if module in resolution.ignored else "untargeted")
    return issues


_DTYPE_AND_SHAPE = itemgetter(1, 2)  # TensorInfo.dtype, .shape


def _is_missing_input_scale(found: Issue) -> bool:
    return found.rule in MISSING_TENSOR_RULES and _kind(found.tensors[0].rpartition(".")[2]) in INPUT_SCALE_KINDS


@lru_cache(maxsize=None)
def _kind(suffix: str) -> str:
    return split_suffix(f"m.{suffix}")[2]


def module_scheme_issues(ctx: AuditContext, module: str, group: SchemeGroup) -> list[Issue]:
    fmt, scheme = ctx.tensor_format, group.scheme
    component = ctx.linear_modules.get(module, "")
    params = ctx.modules[module]
    table = scheme_table()[fmt][scheme]
    file = ctx.file_of(f"{module}.{next(iter(params))}")
    if _stored_unquantized(params, table):
        dtype = params["weight"].dtype
        return [issue("module-not-quantized", f"{modules_noun(component)} targeted as {scheme} by {group.description}, stored {dtype}", module, tensors=[f"{module}.weight"], file=file)]
    shape = ctx.linear_shape(module)
    issues: list[Issue] = []
    try:
        expected = scheme_template(fmt, scheme, *shape, group.block) if shape else {}
    except ConfigError as exc:
        return [issue("scheme-tensor-shape", f"{scheme} Linears whose shape the scheme cannot hold", module, detail=exc.message.partition(": ")[2], file=file)]
    for suffix, (dtype, expected_shape) in expected.items():
        info = params.get(suffix)
        name = f"{module}.{suffix}"
        if info is None:
            issues.append(_missing_tensor(module, suffix, scheme, component, file))
        elif info.dtype != dtype and info.dtype not in table[suffix].get("accept", ()):
            issues.append(dtype_issue(ctx, name, dtype, f"{scheme} {suffix}", file))
        elif not (_same_shape(info.shape, expected_shape) or (component == EXPERTS and _expert_scalar(info.shape, expected_shape))):
            issues.append(issue("scheme-tensor-shape", f"{scheme} {suffix} tensors with the wrong shape", name, tensors=[name], detail=f"{list(info.shape)}, expected {list(expected_shape)}", file=file))
    for suffix in params:
        if suffix in table or suffix == "bias" or _kind(suffix) == "kv_scale":  # ModelOpt hangs KV scales on k/v_proj
            continue
        name = f"{module}.{suffix}"
        if _kind(suffix) in INPUT_SCALE_KINDS and not any(_kind(s) in INPUT_SCALE_KINDS for s in table):
            rule = "weight-only-scales-refused" if fmt in FUSED_LOADING_REFUSES_EXTRA and _fused_or_stacked(ctx, module) else "weight-only-with-activation-scales"
            issues.append(issue(rule, f"{suffix} tensors on Linears declared {scheme} (no static activation scale)", module, tensors=[name], file=file))
        else:
            issues.append(issue("scheme-tensor-foreign", f"tensors a {fmt} {scheme} Linear does not have ({suffix})", name, tensors=[name], file=file))
    return issues


def dtype_issue(ctx: AuditContext, name: str, expected: str, what: str, file: str | None) -> Issue:
    """A tensor stored in another dtype than its format's, judged by what vLLM loads: its weight
    loaders copy_ the tensor into the parameter they created, casting it (e.g.
    `param.data.copy_(loaded_weight)` in vLLM 0.32's model_executor/parameter.py). Where every
    value survives that cast and a scale keeps BF16's precision, vLLM serves the numbers the
    format meant (a warning: other loaders and the byte count differ); where values must be read
    to know, --deep reads them; integer codes where floats belong, or a scale rounded to fewer
    bits, change the numbers (an error)."""
    stored = ctx.tensors[name][1].dtype
    verdict = cast_verdict(stored, expected)
    group = f"{what} tensors stored as {stored} instead of {expected}"
    narrow_scale = verdict == "exact" and FLOAT_FORMATS.get(stored, (0, 0))[0] < SCALE_SIGNIFICAND_BITS
    if verdict == "values" and ctx.deep:
        lost = _values_lost_in_cast(ctx, name, expected)
        if lost:
            return issue("scheme-tensor-dtype", group, name, tensors=[name], file=file, detail=f"{lost:,} values change when cast to {expected}")
        verdict = "exact"
    if verdict in ("bits", "exact") and not narrow_scale:
        note = "vLLM casts them into its parameter unchanged" + (" (read with --deep)" if ctx.deep and cast_verdict(stored, expected) == "values" else "")
        return issue("scheme-tensor-dtype-cast", group, name, tensors=[name], file=file, note=note)
    detail = {"values": "only --deep can tell whether every value survives the cast", "integers": "integer codes are cast as numbers"}.get(verdict, f"{FLOAT_FORMATS.get(stored, (0,))[0]} significant bits")
    return issue("scheme-tensor-dtype", group, name, tensors=[name], file=file, detail=detail)


def _values_lost_in_cast(ctx: AuditContext, name: str, expected: str) -> int:
    shard, info = ctx.tensors[name]
    return sum(int((~survives_cast(chunk, expected)).sum()) for chunk in iter_values(ctx.ckpt, shard, info, CAST_CHECK_ELEMENTS))


def _expert_scalar(stored: tuple[int, ...], expected: tuple[int, ...]) -> bool:
    """A per-tensor scale of any one-element shape ([1, 1] too): vLLM 0.32's FusedMoE loader
    takes each expert's per-tensor scale through `_to_scalar(loaded_weight)`
    (fused_moe/routed_experts.py `_load_per_tensor_weight_scale`); its fused q/k/v loader asserts
    on the shape instead."""
    return tuple(expected) in ((), (1,)) and math.prod(stored) == 1


def _fused_or_stacked(ctx: AuditContext, module: str) -> bool:
    """A shard vLLM loads into a fused Linear (q/k/v, gate/up) or a routed expert it stacks into
    a FusedMoE parameter: where a checkpoint tensor without a parameter fails vLLM 0.32's
    compressed-tensors loading (docs/audit.md#agreement-with-vllm), a plain Linear's is skipped."""
    leaf = module.rpartition(".")[2]
    return ctx.linear_modules.get(module) == EXPERTS or any(leaf in members and len(members) > 1 for members in ctx.layout.fused.values())


@lru_cache(maxsize=None)
def scheme_template(fmt: str, scheme: str, out_features: int, in_features: int, block: tuple[int, int] | None = None) -> dict[str, tuple[str, tuple[int, ...]]]:
    """suffix -> (dtype, shape) a [out, in] Linear stores under ``scheme`` (the same for every
    module of that shape, so computed once per shape, not per module)."""
    return {spec.name.rpartition(".")[2]: (spec.dtype, tuple(spec.shape)) for spec in linear_tensor_specs(fmt, scheme, "m", out_features, in_features, block)}


# -- MXFP4 experts (GPT-OSS) ------------------------------------------------------------------------
MXFP4_BLOCK = 32  # values per E8M0 exponent
MXFP4_EXPERT_PARAMS = (".experts.gate_up_proj", ".experts.down_proj")


def mxfp4_issues(ctx: AuditContext, decl: QuantDeclaration) -> list[Issue]:
    """GPT-OSS as released: each fused expert parameter `<p>` (transformers [E, in, out]) is stored
    as `<p>_blocks` U8 [E, out, in/32, 16] (two E2M1 codes per byte) and `<p>_scales` U8
    [E, out, in/32] (E8M0); vLLM's Mxfp4Config quantizes nothing else."""
    issues: list[Issue] = []
    experts = {n: s for n, s in ctx.expected_shapes.items() if n.endswith(MXFP4_EXPERT_PARAMS) and len(s) == 3}
    for module, (count, rows_in, cols_out) in sorted(experts.items()):
        params = ctx.modules.get(module, {})
        stored = ctx.tensors.get(module)
        if stored is not None and not params:
            issues.append(issue("module-not-quantized", f"routed-expert parameters declared mxfp4, stored {stored[1].dtype}", module, tensors=[module], file=stored[0]))
            continue
        if rows_in % MXFP4_BLOCK:
            issues.append(issue("scheme-tensor-shape", "mxfp4 experts whose input size is not a multiple of 32", module, detail=f"input size {rows_in}"))
            continue
        blocks = rows_in // MXFP4_BLOCK
        for suffix, shape in (("blocks", (count, cols_out, blocks, MXFP4_BLOCK // 2)), ("scales", (count, cols_out, blocks))):
            name = f"{module}_{suffix}"
            info = params.get(suffix)
            if info is None:
                issues.append(issue("scheme-tensor-missing", f"mxfp4 experts lacking _{suffix}", module, tensors=[name]))
            elif info.dtype != "U8":
                issues.append(issue("scheme-tensor-dtype", f"mxfp4 _{suffix} tensors stored as {info.dtype} instead of U8", name, tensors=[name], file=ctx.file_of(name)))
            elif tuple(info.shape) != shape:
                issues.append(issue("scheme-tensor-shape", f"mxfp4 _{suffix} tensors with the wrong shape", name, tensors=[name], detail=f"{list(info.shape)}, expected {list(shape)}", file=ctx.file_of(name)))
    for module in ctx.linear_modules:  # Linears stay unquantized under mxfp4
        issues += unexpected_quantization(ctx, module, "untargeted")
    return issues


def _stored_unquantized(params: dict, table: dict) -> bool:
    """A plain float weight and none of the scheme's scales: the quantizer never touched it."""
    weight = params.get("weight")
    if weight is None or weight.dtype not in FLOAT_WEIGHT_DTYPES:
        return False
    scheme_weight = table.get("weight") or table.get("weight_packed")
    return scheme_weight["dtype"] not in FLOAT_WEIGHT_DTYPES and not any(_kind(s) in SCALE_KINDS for s in params)


def _missing_tensor(module: str, suffix: str, scheme: str, component: str, file: str | None) -> Issue:
    name = f"{module}.{suffix}"
    if _kind(suffix) in INPUT_SCALE_KINDS:
        rule = "moe-input-scale-invalid" if component == EXPERTS else "scheme-tensor-missing"
        return issue(rule, f"{modules_noun(component)} declared W4A4 but lacking {suffix}", module, tensors=[name], file=file)
    return issue("scheme-tensor-missing", f"{scheme} Linears lacking {suffix}", module, tensors=[name], file=file)


def unexpected_quantization(ctx: AuditContext, module: str, why: str) -> list[Issue]:
    params = ctx.modules.get(module, {})
    weight = params.get("weight")
    scales = [s for s in params if _kind(s) in SCALE_KINDS or _kind(s) in PACKED_KINDS]
    quantized_weight = weight is not None and weight.dtype not in FLOAT_WEIGHT_DTYPES
    if not scales and not quantized_weight:
        return []
    tensors = [f"{module}.{s}" for s in scales] + ([f"{module}.weight"] if quantized_weight else [])
    phrase = "ignored Linears carrying quantized tensors" if why == "ignored" else "Linears no config group targets carrying quantized tensors"
    return [issue("quantized-but-not-targeted", phrase, module, tensors=tensors, file=ctx.file_of(tensors[0]))]


# -- fused groups ---------------------------------------------------------------------------------
# vLLM quantizes a fused layer's input with the max of its shards' input scales (vLLM 0.32
# compressed_tensors_w8a8_fp8.py `layer.input_scale.max()`, compressed_tensors_w4a4_nvfp4.py
# `input_global_scale.max()`, modelopt.py likewise): shards that read one input and were
# calibrated on it agree; 8x apart (three binades of E4M3's range) is no calibration's spread.
FUSED_INPUT_SCALE_ERROR_RATIO = 8.0
FUSED_SCALE_RULES = ((("weight_global_scale",), "fused-weight-scale-mismatch"), (INPUT_SCALE_KINDS, "fused-input-scale-mismatch"))


def fused_scale_issues(ctx: AuditContext, resolution: Resolution) -> list[Issue]:
    issues = []
    compared = []
    scheme_of, modules = resolution.scheme_of, ctx.modules
    # the shards' stored suffix lists -> (rule, the scale suffix of each shard) for every rule whose
    # scales all exist (a missing scale is its own finding): 10^4 groups share a few such plans
    plans: dict[tuple[tuple[str, ...], ...], list[tuple[str, list[str]]]] = {}
    for parent, name, shards in fused_groups(ctx):
        if not all(map(scheme_of.__contains__, shards)):
            continue
        stored = tuple([tuple(modules.get(shard, ())) for shard in shards])
        plan = plans.get(stored)
        if plan is None:
            found = [[_first_of_kinds(suffixes, kinds) for kinds, _ in FUSED_SCALE_RULES] for suffixes in stored]
            per_rule = [(rule, [scales[position] for scales in found]) for position, (_, rule) in enumerate(FUSED_SCALE_RULES)]
            plan = plans[stored] = [(rule, suffixes) for rule, suffixes in per_rule if None not in suffixes]
        for rule, suffixes in plan:
            compared.append((parent, name, shards, rule, [f"{shard}.{suffix}" for shard, suffix in zip(shards, suffixes)]))
    scalars = ctx.scalar_scales  # 10^4 groups' scales: plain numbers, read once
    loaded = ctx.values([n for *_, names in compared for n in names if n not in scalars])  # one batch, not one per group

    def single(n: str) -> float | None:
        value = scalars.get(n)
        if value is None and n in loaded and loaded[n].size == 1:
            value = float(loaded[n][0])
        return value

    for parent, name, shards, rule, names in compared:
        floats = list(map(scalars.get, names))  # single(), in its usual case
        if None in floats:
            floats = [single(n) for n in names]
            if None in floats:
                continue
        if len(set(floats)) > 1 and min(floats) > 0:
            kind = "weight global scales" if rule.startswith("fused-weight") else "input scales"
            if rule == "fused-input-scale-mismatch" and max(floats) / min(floats) >= FUSED_INPUT_SCALE_ERROR_RATIO:
                rule = "fused-input-scale-divergent"
            issues.append(issue(rule, f"fused {name} groups whose {kind} differ", f"{parent}.{{{','.join(s.rpartition('.')[2] for s in shards)}}}", tensors=names, detail=f"ratio {max(floats) / min(floats):.4g}×", file=ctx.file_of(names[0])))  # type: ignore[arg-type]
    return issues


@lru_cache(maxsize=4096)
def _first_of_kinds(suffixes: tuple[str, ...], kinds: tuple[str, ...]) -> str | None:
    """The first stored suffix of one of ``kinds`` (10^5 modules share a few suffix lists)."""
    return next((suffix for suffix in suffixes if _kind(suffix) in kinds), None)


# -- scale values ---------------------------------------------------------------------------------
# A per-tensor NVFP4 weight scale implies the weight's amax: 2688 / weight_global_scale (CT) or
# weight_scale_2 * 2688 (ModelOpt). An amax above 2688 (the value 1 on either side) is no LLM
# weight's, so a value past 1 on the wrong side was written in the other convention.
IMPLAUSIBLE_SCALE_SIDE = {"weight_global_scale": "below", "weight_scale_2": "above"}
# An FP8 weight scale (per tensor, channel or 128x128 block) is amax / 448: above 6 (= 2688 / 448)
# it implies the same impossible amax, a scale stored inverted (448 / amax) or for other codes.
FP8_WEIGHT_SCALE_CEILING = 6.0
FP8_WEIGHT_SCALE_SUFFIXES = ("weight_scale", "weight_scale_inv")


def _implausible(ctx: AuditContext, name: str, largest: float, smallest: float) -> bool:
    """A scale on the side of 1 no LLM weight's amax puts it (NVFP4's per-tensor scales), or an
    FP8 weight scale past FP8_WEIGHT_SCALE_CEILING."""
    module, suffix, _ = ctx.roles[name]
    side = IMPLAUSIBLE_SCALE_SIDE.get(suffix)
    if side is not None:
        return (side == "below" and largest < 1.0) or (side == "above" and smallest > 1.0)
    if largest <= FP8_WEIGHT_SCALE_CEILING or suffix not in FP8_WEIGHT_SCALE_SUFFIXES:
        return False  # the usual case, decided without a lookup
    weight = ctx.modules.get(module, {}).get("weight")
    float_scale = ctx.tensors[name][1].dtype in FLOAT_WEIGHT_DTYPES  # MXFP8's U8 E8M0 exponents are no amax / 448
    return float_scale and weight is not None and weight.dtype == "F8_E4M3"


def scale_value_issues(ctx: AuditContext) -> list[Issue]:
    issues = []
    scalars = ctx.scalar_scales  # the 10^5 one-element scales as plain numbers; the others as arrays
    arrays = ctx.values([n for n in ctx.small_scales if n not in scalars])
    roles = ctx.roles
    for name in ctx.small_scales:
        value = scalars.get(name)
        if value is not None:
            if 0 < value < math.inf:  # NaN compares false
                if value < F32_SMALLEST_NORMAL:
                    issues.append(_subnormal_issue(ctx, name, _as_array(value)))
                elif _implausible(ctx, name, value, value):
                    issues.append(_convention_issue(ctx, name, _as_array(value)))
                continue
            values = _as_array(value)
        else:
            values = arrays.get(name)
            if values is None:
                continue
            if is_finite_positive(values):
                if float(values.min()) < F32_SMALLEST_NORMAL:
                    issues.append(_subnormal_issue(ctx, name, values))
                elif _implausible(ctx, name, float(values.max()), float(values.min())):
                    issues.append(_convention_issue(ctx, name, values))
                continue
        module, suffix, kind = roles[name]
        if kind in INPUT_SCALE_KINDS and ctx.component(module) == EXPERTS:
            issues.append(issue("moe-input-scale-invalid", f"routed experts whose {suffix} is not finite and positive", module, tensors=[name], detail=describe_value(values), file=ctx.file_of(name)))
        else:
            issues.append(issue("scale-invalid", f"{suffix} tensors that are NaN, Inf, zero or negative", name, tensors=[name], detail=describe_value(values), file=ctx.file_of(name)))
    return issues


def fp8_block_scale_issues(ctx: AuditContext) -> list[Issue]:
    """--deep: block-wise FP8 weight scales (2-D, read only with the values) past the ceiling the
    per-tensor and per-channel ones are held to without --deep (scale_value_issues)."""
    small = set(ctx.small_scales)
    names = [f"{module}.{suffix}" for module, params in ctx.modules.items() if (params.get("weight") is not None and params["weight"].dtype == "F8_E4M3")
             for suffix in FP8_WEIGHT_SCALE_SUFFIXES if suffix in params and f"{module}.{suffix}" not in small]
    issues = []
    for name, values in ctx.values(names).items():
        if values.size and is_finite_positive(values) and _implausible(ctx, name, float(values.max()), float(values.min())):
            issues.append(_convention_issue(ctx, name, values))
    return issues


def _as_array(value: float):
    import numpy as np  # only for a finding: a clean audit of F32 scales never imports numpy

    return np.array([value], dtype=np.float32)


def _subnormal_issue(ctx: AuditContext, name: str, values) -> Issue:
    """A scale below float32's smallest normal: the range it implies over- or underflows."""
    suffix = ctx.roles[name][1]
    return issue("scale-invalid", f"{suffix} tensors that are subnormal (below 2^-126)", name, tensors=[name], detail=describe_value(values) if values.size == 1 else f"smallest {float(values.min()):.4g}", file=ctx.file_of(name))


def _convention_issue(ctx: AuditContext, name: str, values) -> Issue:
    suffix = ctx.roles[name][1]
    what = "in the other layout's convention" if suffix in IMPLAUSIBLE_SCALE_SIDE else "implying FP8 weights above 2688 (stored inverted?)"
    return issue("scale-convention", f"{suffix} values {what}", name, tensors=[name], detail=describe_value(values) if values.size == 1 else f"largest {float(values.max()):.4g}", file=ctx.file_of(name))


# -- scale magnitude against the weights (--deep) ------------------------------------------------------
# The largest dequantized value of a quantized weight must reach the amax its scales imply: NVFP4
# codes x E4M3 block scale x the per-tensor multiplier (1/weight_global_scale or weight_scale_2)
# against 6 x 448 x that multiplier; FP8 codes x scale against 448 x scale. An exporter that
# scales correctly puts the weight's largest value on the top code of the top block (ratio 1,
# up to F32 rounding); E4M3's 448 and E2M1's 6 cap it at 1. Below MAGNITUDE_MIN_RATIO the block
# scales or codes were written for another scale (no global scale applied, the other layout's
# convention): served, the weights come out that many times too small. The tolerance is wide on
# purpose: shards of one fused GEMM share a global scale (judged together, the largest shard
# reaches 1) and clipping exporters lower the top block a little; the defects are off by 10^2+.
MAGNITUDE_MIN_RATIO = 0.25
MAGNITUDE_MAX_RATIO = 1.0 + 2.0**-10


@lru_cache(maxsize=1)
def shard_min_ratio() -> float:
    """One shard of a fused group (sharing the group's per-tensor scale) below this share of the
    group's implied amax would need block scales under E4M3's smallest normal even for its
    largest block (2^-6 over 448, from the format's own table): no export writes that; its block
    scales were stored inverted or for another global scale."""
    import numpy as np

    table = fp8_e4m3_table()
    return float(table[0x08] / np.nanmax(table))  # 0x08: exponent field 1, mantissa 0


def _magnitude_of(ctx: AuditContext, module: str, values: DeepValues) -> tuple[float, float, str] | None:
    """(largest dequantized |value|, the amax the scales imply, family) of one quantized Linear,
    or None when it is not NVFP4 / FP8 with readable scales. Which scheme is told by the stored
    dtypes; the values come from the one scan (``deep_scan``), finished by the scheme's codec."""
    found = magnitude_tensors(ctx.modules.get(module, {}))
    if found is None:
        return None
    scheme, suffixes = found
    if scheme == FP8_SCHEME:
        peek = codec(FP8_SCHEME).peek_finish(values.fp8_top(f"{module}.weight"))
    else:
        per_tensor = ctx.values([f"{module}.{suffixes['global_scale']}"])
        pair = values.nvfp4(f"{module}.{suffixes['packed']}")
        if pair is None or not per_tensor or not next(iter(per_tensor.values())).size:
            return None  # sizes that do not pair up, or a torn scalar: findings of their own
        value = float(next(iter(per_tensor.values()))[0])
        peek = codec(NVFP4_SCHEME).peek_finish(*pair, value, layout_of_suffix(NVFP4_SCHEME, "global_scale", suffixes["global_scale"]))
    return None if peek is None else (peek.largest, peek.implied_amax, peek.family)


def scale_magnitude_issues(ctx: AuditContext) -> list[Issue]:
    if ctx.layout is None:
        return []
    measured: dict[str, tuple[float, float, str]] = {}
    values = deep_values(ctx)
    for module in ctx.modules:
        found = _magnitude_of(ctx, module, values)
        if found is not None:
            measured[module] = found
    # shards vLLM serves as one GEMM (gate/up, q/k/v, ...) are judged together
    leaf_group = {leaf: members for members in ctx.layout.fused.values() for leaf in members}
    judged: set[str] = set()
    issues = []
    for module in sorted(measured, key=natural_key):
        if module in judged:
            continue
        parent, _, leaf = module.rpartition(".")
        shards = [s for s in (f"{parent}.{m}" for m in leaf_group.get(leaf, (leaf,))) if s in measured] or [module]
        judged.update(shards)
        dequantized = max(measured[s][0] for s in shards)
        implied = max(measured[s][1] for s in shards)
        ratio = dequantized / implied if implied > 0 else float("nan")
        in_range = MAGNITUDE_MIN_RATIO <= ratio <= MAGNITUDE_MAX_RATIO
        # a subnormal (or huge) per-tensor scale keeps the ratio but not the weights: BF16 GEMMs flush them to zero
        representable = F32_SMALLEST_NORMAL <= dequantized <= F32_MAX
        faint = [s for s in shards if len(shards) > 1 and implied > 0 and measured[s][0] / implied < shard_min_ratio()]
        if not (in_range and representable) or faint:
            family = measured[module][2]
            names = [f"{s}.{suffix}" for s in shards for suffix in ctx.modules[s] if _kind(suffix) in ("weight_scale", "weight_global_scale", "packed_fp4") or suffix == "weight"]
            detail = f"largest dequantized value {dequantized:.4g}, implied amax {implied:.4g}, ratio {ratio:.3g}"
            detail += "" if not in_range or faint else ", not a normal float32: served, these weights are zero or infinite"
            detail += "".join(f"; {s.rpartition('.')[2]} reaches {measured[s][0] / implied:.3g} of it" for s in faint)
            issues.append(issue("scale-magnitude", f"{family.upper()} weights whose scales imply a range their values do not reach", ", ".join(shards) if len(shards) > 1 else module, tensors=names, detail=detail, file=ctx.file_of(names[0]) if names else None))
    return issues


# -- KV cache scales ------------------------------------------------------------------------------
@lru_cache(maxsize=1)
def kv_scale_remaps() -> tuple[tuple[re.Pattern[str], str], ...]:
    text = resources.files("fp4forge.audit").joinpath("serving_quirks.toml").read_text(encoding="utf-8")
    return tuple((re.compile(r["pattern"]), r["replacement"]) for r in tomllib.loads(text)["kv_scale_remap"])


def vllm_kv_target(name: str) -> str | None:
    """The parameter vLLM's cache-scale remapper turns a checkpoint name into (first rule wins)."""
    for pattern, replacement in kv_scale_remaps():
        if pattern.search(name):
            return pattern.sub(replacement, name, count=1)
    return None


def attention_layers(ctx: AuditContext) -> list[str]:
    """`model.layers.N` prefixes of every attention module, present or expected."""
    names = list(ctx.tensors) + list(ctx.expected_shapes)
    return sorted({n.split(".self_attn.")[0] for n in names if ".self_attn." in n and not n.endswith(KV_SUFFIXES)}, key=natural_key)


def kv_issues(ctx: AuditContext) -> list[Issue]:
    endings = tuple("." + s for s in KV_SUFFIXES)
    present = {n for n in ctx.tensors if n.endswith(endings)}
    kv = ctx.declaration.kv if ctx.declaration else None
    if kv is None:
        note = "vLLM keeps a BF16 cache and never reads them"
        return [issue("kv-scale-undeclared", "KV scales without an FP8 KV declaration", n, tensors=[n], file=ctx.file_of(n), note=note) for n in sorted(present, key=natural_key)]
    if kv.dynamic or ctx.tensor_format is None:
        return []  # nothing to calibrate, or a format without a KV naming table
    issues: list[Issue] = []
    expected: dict[str, tuple[str, str]] = {}
    for layer in attention_layers(ctx):
        for spec in kv_scale_specs(ctx.tensor_format, layer):
            expected[spec.name] = (layer, spec.name.rpartition(".")[2])
    attributed: set[str] = set()
    for name, (layer, suffix) in expected.items():
        if name in present:
            continue
        stand_ins = sorted(n for n in present - expected.keys() if n.startswith(layer + ".") and n.endswith("." + suffix))
        if stand_ins:
            attributed.update(stand_ins)
            issues += [_misnamed(ctx, n, layer, name) for n in stand_ins]
        else:
            issues.append(issue("kv-scale-absent", f"attention layers without {suffix} ({kv.algo.upper()} KV declared in {kv.where})", layer, tensors=[name], note="vLLM runs this layer's cache at scale 1.0"))
    for name in sorted(present - expected.keys() - attributed, key=natural_key):
        issues.append(_misnamed(ctx, name, None, None))
    issues += kv_value_issues(ctx, sorted(present & expected.keys(), key=natural_key))
    return issues


def _misnamed(ctx: AuditContext, name: str, layer: str | None, expected_name: str | None) -> Issue:
    layer_attention = f"{layer}.self_attn.attn." if layer else None
    target = name if layer_attention and name.startswith(layer_attention) else vllm_kv_target(name)  # vLLM's own parameter name
    remapped = bool(target and layer_attention and target.startswith(layer_attention))
    detail = f"expected {expected_name}" if expected_name else "no attention layer expects it"
    architecture = next(iter((ctx.ckpt.config or {}).get("architectures") or []), None)
    if remapped and vllm_remaps_kv_scales(architecture):
        group = f"KV scales in another layout's spelling, which vLLM's {architecture} loader remaps"
        note = "vLLM lands it on the attention layer (its cache-scale mapper); other engines and loaders may drop it"
        return issue("kv-scale-other-spelling", group, name, tensors=[name], detail=detail, file=ctx.file_of(name), note=note)
    if remapped:
        group = f"KV scales in another layout's spelling (the {ctx.tensor_format} loader expects its own)"
        note = "vLLM's generic remapper rescues this spelling only for models loaded through AutoWeightsLoader; this architecture's loader and other engines drop it"
    else:
        group = "KV scales under names no vLLM remapping rule reaches (dropped silently)"
        note = "the FP8 cache of those layers runs at scale 1.0"
    return issue("kv-scale-misnamed", group, name, tensors=[name], detail=detail, file=ctx.file_of(name), note=note)


def kv_value_issues(ctx: AuditContext, names: list[str]) -> list[Issue]:
    kv = ctx.declaration.kv  # type: ignore[union-attr]
    heads = (ctx.ckpt.config or {}).get("num_key_value_heads") or 1
    elements = heads if kv.strategy == "attn_head" else 1
    issues = []
    ok_values = []
    for name in names:
        info = ctx.tensors[name][1]
        if info.numel != elements or info.dtype not in FLOAT_WEIGHT_DTYPES:
            issues.append(issue("kv-scale-invalid", "KV scales of the wrong size or dtype", name, tensors=[name], detail=f"{info.dtype}{list(info.shape)}, expected {elements} float element(s)", file=ctx.file_of(name)))
    values = ctx.values([n for n in names if ctx.tensors[n][1].numel == elements])
    for name, value in values.items():
        if is_finite_positive(value):
            ok_values.append(value)
        else:
            issues.append(issue("kv-scale-invalid", "KV scales that are NaN, Inf, zero or negative", name, tensors=[name], detail=describe_value(value), file=ctx.file_of(name)))
    if ok_values and len(ok_values) == len(names) and all(bool((v == 1.0).all()) for v in ok_values):
        issues.append(issue("kv-scale-uncalibrated", "KV scales", f"all {len(names):,} k/v scales are exactly 1.0", tensors=names))
    return issues
