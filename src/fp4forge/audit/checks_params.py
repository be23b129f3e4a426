"""Declarations against tensors, judged by vLLM's own parameter data: every Linear a declaration
resolves to a scheme that vLLM's quant methods create parameters for (GPTQ, AWQ, compressed-tensors
int and float schemes, fp8 per tensor, ...) must store exactly those parameters, with their
shapes (``checkpoint/vllm_params.py`` evaluates vLLM's formulas at the Linear's size) and dtypes.
Each finding says what vLLM 0.32 does with the mismatch: refuses to start (a parameter no tensor
fills, a tensor no parameter takes, a shape its weight loader rejects), or casts the stored
values into its parameter's dtype (other numerics).

The schemes fp4forge writes (``_schemes.toml``) keep their own checks in ``checks_declarations``;
this module judges the other groups, and says so where it cannot (a scheme vLLM's data lacks).
"""

from __future__ import annotations

from fp4forge.audit.context import AuditContext, issue, modules_noun
from fp4forge.audit.findings import Issue
from fp4forge.checkpoint import vllm_params
from fp4forge.checkpoint.declarations import QuantDeclaration, Resolution, SchemeGroup, not_understood
from fp4forge.checkpoint.vllm_params import MODEL_DTYPE, ExpectedTensor

FLOAT_DTYPES = frozenset({"BF16", "F16", "F32", "F64"})
EXPERTS = "routed_experts"


def format_issues(decl: QuantDeclaration) -> list[Issue]:
    """A quant_method vLLM has no config class for (it refuses to start), and one fp4forge
    cannot judge (its tensors are then not compared, nor their names)."""
    issues = []
    if not vllm_params.vllm_knows_method(decl.format):
        issues.append(issue("quant-method-unknown-to-vllm", f"quant_method vLLM {vllm_params.vllm_version()} has no config class for",
                            decl.format))
    if not decl.groups and not_understood(decl) is not None:  # (a known method's unjudged schemes: scheme-not-audited)
        issues.append(issue("format-not-judged", "declarations fp4forge cannot judge", not_understood(decl)))
    return issues


def judged_groups(resolution: Resolution) -> dict[str, SchemeGroup]:
    """The modules this module judges: resolved to a group without a tensor table of fp4forge's
    own but with a scheme key."""
    return {m: g for m, g in resolution.scheme_of.items() if g.scheme is None and g.key is not None}


def param_issues(ctx: AuditContext, resolution: Resolution) -> list[Issue]:
    issues: list[Issue] = []
    refused: dict[str, list[str]] = {}
    clean: set[tuple] = set()  # (key, shape, expert, stored signature) found clean once
    for module, group in judged_groups(resolution).items():
        entry = vllm_params.scheme_entry(group.key)
        if entry is None:
            continue  # a scheme vLLM's data lacks: scheme-not-audited says so
        if "refused" in entry:
            refused.setdefault(f"{group.description}: {entry['refused']}", []).append(module)
            continue
        params = ctx.modules.get(module)
        if params is None:
            continue  # absent module (a names finding)
        shape = ctx.linear_shape(module)
        signature = (group.key, shape, ctx.linear_modules.get(module) == EXPERTS, tuple((s, i.dtype, tuple(i.shape)) for s, i in params.items()))
        if signature in clean:
            continue
        found = module_param_issues(ctx, module, group, entry, shape)
        if not found:
            clean.add(signature)
        issues += found
    for reason, modules in refused.items():
        issues.append(issue("scheme-refused-by-vllm", "declared schemes vLLM refuses", reason, detail=f"{len(modules):,} Linears"))
    return issues


def module_param_issues(ctx: AuditContext, module: str, group: SchemeGroup, entry: dict, shape: tuple[int, int] | None) -> list[Issue]:
    """One Linear's stored tensors against the parameters vLLM creates for it."""
    params = ctx.modules[module]
    component = ctx.linear_modules.get(module, "")
    file = ctx.file_of(f"{module}.{next(iter(params))}")
    expert = component == EXPERTS
    expected = vllm_params.expected_tensors(group.key, shape[1], shape[0], expert=expert) if shape else None
    records = vllm_params.scheme_params(group.key, expert=expert)
    names = {p["name"] for p in records}
    weight = next(p for p in entry["params"] if p.get("weight"))
    if "weight" in params and params["weight"].dtype in FLOAT_DTYPES and (weight["name"] != "weight" or _dtype_changes_values(params["weight"].dtype, weight["dtype"])):
        return [issue("module-not-quantized", f"{modules_noun(component)} targeted as {group.description}, stored {params['weight'].dtype}",
                      module, tensors=[f"{module}.weight"], file=file)]
    issues = []
    tolerated = set(entry.get("discarded", ())) | set(entry.get("ignored_if_unexpected", ())) | {"bias"}
    for suffix in params:
        if suffix not in names and suffix not in tolerated:
            name = f"{module}.{suffix}"
            issues.append(issue("vllm-param-unexpected", f"tensors no parameter of vLLM's {entry['method']} takes ({suffix})", name, tensors=[name], file=file,
                                note=f"vLLM's {group.description} Linear has {', '.join(sorted(names))}"))
    built = vllm_params.config_built_params()
    for tensor in expected or [_shapeless(p) for p in records]:
        if tensor.suffix in built and tensor.suffix not in params:
            continue  # vLLM fills it from the quantization config
        issues += _tensor_issues(module, tensor, params.get(tensor.suffix), group, file)
    return issues


def _shapeless(param: dict) -> ExpectedTensor:
    return ExpectedTensor(param["name"], param["dtype"], None, param.get("values_per_element", 1), bool(param.get("weight")))


def _tensor_issues(module: str, tensor: ExpectedTensor, info, group: SchemeGroup, file: str | None) -> list[Issue]:
    name = f"{module}.{tensor.suffix}"
    if info is None:
        return [issue("vllm-param-missing", f"{group.description} parameters vLLM creates that no tensor fills ({tensor.suffix})", name, tensors=[name], file=file)]
    if tensor.shape is not None and not same_shape(info.shape, tensor.shape):
        return [issue("vllm-param-shape", f"{group.description} {tensor.suffix} tensors whose shape differs from vLLM's parameter", name, tensors=[name], file=file,
                      detail=f"{list(info.shape)}, vLLM creates {list(tensor.shape)}")]
    if _dtype_changes_values(info.dtype, tensor.dtype):
        return [issue("vllm-param-dtype", f"{group.description} {tensor.suffix} tensors stored in another dtype than vLLM's parameter", name, tensors=[name], file=file,
                      detail=f"{info.dtype}, vLLM creates {tensor.dtype if tensor.dtype != MODEL_DTYPE else 'the model dtype'}")]
    return []


def same_shape(stored: tuple[int, ...], expected: tuple[int, ...]) -> bool:
    """Per-tensor scales may be 0-d or [1]: vLLM loads either (docs/formats.md#fp8-e4m3); a
    [1, 1] one fails vLLM's fused q/k/v loader (docs/audit.md#agreement-with-vllm)."""
    scalar = ((), (1,))
    return tuple(stored) == tuple(expected) or (tuple(stored) in scalar and tuple(expected) in scalar)


def _dtype_changes_values(stored: str, expected: str) -> bool:
    """A float stored for a float parameter is cast without changing what it means; anything
    else (integer codes, FP8, a float where codes belong) is read as other numbers."""
    if expected == MODEL_DTYPE or expected in FLOAT_DTYPES:
        return stored not in FLOAT_DTYPES
    return stored != expected and (stored, expected) not in TRUNCATION_KEEPS_WORDS


# (stored, parameter) integer dtypes whose copy keeps every word: vLLM copies an I64 tensor into
# its I32 parameter with a truncating cast, which keeps the low 32 bits (the packed word a sign- or
# zero-extending widening put there); the oracle measures the same values after loading
# (docs/audit.md#agreement-with-vllm)
TRUNCATION_KEEPS_WORDS = frozenset({("I64", "I32")})
