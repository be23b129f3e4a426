"""Write (or check) fp4forge's table of the parameters vLLM creates per quantized Linear, per
quantization method and scheme, from vLLM itself: src/fp4forge/checkpoint/layouts/_vllm_quant_params.json.

    python scripts/vllm_quant_params.py            # print the table the installed vLLM gives
    python scripts/vllm_quant_params.py --write    # and write it to the data file

Run it with the vLLM environment's interpreter (e.g. `.venv-vllm/bin/python`). Every probe is a
`quantization_config` a checkpoint can declare; its config class (`get_quantization_config(method)
.from_config`) is built and a `ReplicatedLinear` is made on the meta device with it, so vLLM's own
`get_quant_method` picks the scheme and its `create_weights` creates the parameters. That is done
at three sizes (in, out), (2 in, out), (in, 2 out) and at two model dtypes: each dimension is solved
as `a * in + b * out + c` (checked at a fourth size), each dtype is fixed or the model's. Where vLLM
refuses a declaration (its config class or scheme choice raises), the reason is recorded instead:
that is what a server would do. The probes are keyed by fp4forge's own scheme keys
(`fp4forge.checkpoint.vllm_params`), so the product looks up exactly what this script measured.
"""

from __future__ import annotations

import itertools
import sys
import tempfile
from fractions import Fraction
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
from fp4forge.checkpoint import vllm_params as vp  # noqa: E402 - the product's keys, from the source tree

DATA = ROOT / "src/fp4forge/checkpoint/layouts" / vp.VLLM_QUANT_PARAMS
SIZES = ((1024, 512), (2048, 512), (1024, 1536))
CHECK_SIZE = (3072, 2560)
PREFIX = "model.layers.0.mlp.down_proj"
GROUPS = (32, 64, 128, -1)
ST_DTYPES = {"torch.bfloat16": "BF16", "torch.float16": "F16", "torch.float32": "F32", "torch.int32": "I32",
             "torch.int64": "I64", "torch.uint8": "U8", "torch.int8": "I8", "torch.float8_e4m3fn": "F8_E4M3",
             "torch.float8_e8m0fnu": "F8_E8M0", "torch.int16": "I16"}


def _ct(weights: dict, inputs: dict | None, fmt: str) -> tuple[str, dict]:
    group = {"targets": ["Linear"], "weights": weights, "input_activations": inputs, "format": fmt}
    return vp.ct_key(group, fmt), {"quant_method": "compressed-tensors", "format": fmt, "config_groups": {"group_0": group}}


def ct_probes() -> list[tuple[str, dict]]:
    """The schemes compressed-tensors' config class accepts: weight-only int (pack-quantized,
    4/8 bits, group/channel, symmetric or with zero points), W8A8 int (tensor/channel weights,
    static/dynamic per-tensor/token inputs), FP8 (tensor/channel/block, static/dynamic), NVFP4
    W4A4/W4A16, MXFP4, FP8 weight-only."""
    out = []
    for bits, group, sym, actorder in itertools.product((4, 8), GROUPS, (True, False), (None, "weight")):
        strategy = "channel" if group == -1 else "group"
        if actorder and strategy != "group":
            continue
        weights = {"num_bits": bits, "type": "int", "symmetric": sym, "strategy": strategy, "group_size": None if group == -1 else group, "actorder": actorder}
        out.append(_ct(weights, None, "pack-quantized"))
    for strategy, (in_strategy, dynamic), sym in itertools.product(("tensor", "channel"), (("tensor", False), ("token", True), ("tensor", True)), (True, False)):
        weights = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": strategy}
        out.append(_ct(weights, {"num_bits": 8, "type": "int", "symmetric": sym, "strategy": in_strategy, "dynamic": dynamic}, "int-quantized"))
    for strategy, (in_strategy, dynamic) in itertools.product(("tensor", "channel"), (("tensor", False), ("token", True), ("tensor", True))):
        weights = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": strategy}
        out.append(_ct(weights, {"num_bits": 8, "type": "float", "symmetric": True, "strategy": in_strategy, "dynamic": dynamic}, "float-quantized"))
        out.append(_ct(weights, None, "float-quantized"))
    block = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "block", "block_structure": [128, 128]}
    out.append(_ct(block, {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "group", "group_size": 128, "dynamic": True}, "float-quantized"))
    out.append(_ct(block, None, "float-quantized"))
    nvfp4 = {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "tensor_group", "group_size": 16}
    out.append(_ct(nvfp4, {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "tensor_group", "group_size": 16, "dynamic": "local"}, "nvfp4-pack-quantized"))
    out.append(_ct(nvfp4, None, "nvfp4-pack-quantized"))
    mxfp4 = {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "group", "group_size": 32}
    out.append(_ct(mxfp4, {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "group", "group_size": 32, "dynamic": True}, "mxfp4-pack-quantized"))
    out.append(_ct(mxfp4, None, "mxfp4-pack-quantized"))
    return out


def other_probes() -> list[tuple[str, dict]]:
    out = []
    for bits, group, desc_act, sym in itertools.product((2, 3, 4, 8), GROUPS, (False, True), (True, False)):
        qc = {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": desc_act, "sym": sym}
        out.append((vp.gptq_key(qc), qc))
    for bits, group, zero_point in itertools.product((2, 3, 4, 8), GROUPS, (True, False)):
        qc = {"quant_method": "awq", "w_bit": bits, "q_group_size": group, "zero_point": zero_point, "version": "gemm"}
        out.append((vp.awq_key(qc), qc))
    for scheme, block in itertools.product(("dynamic", "static"), (None, [128, 128])):
        qc = {"quant_method": "fp8", "activation_scheme": scheme, "weight_block_size": block}
        out.append((vp.fp8_key(qc), qc))
    for algo, group in (("FP8", None), ("FP8_PER_CHANNEL_PER_TOKEN", None), ("FP8_PB_WO", None), ("MXFP8", None), ("MXFP8", 32),
                        ("NVFP4", 16), ("W4A16_NVFP4", 16), ("NVFP4_W4A16", 16)):
        qc = {"quant_method": "modelopt", "quant_algo": algo, "group_size": group, "kv_cache_quant_algo": None, "exclude_modules": []}
        out.append((vp.modelopt_key(algo, group), qc))
    return out


def _params(cfg, in_features: int, out_features: int, dtype) -> dict[str, tuple[str, tuple[int, ...], int | None]]:
    import torch
    from vllm.model_executor.layers.linear import ReplicatedLinear

    with torch.device("meta"):
        layer = ReplicatedLinear(in_features, out_features, bias=False, quant_config=cfg, prefix=PREFIX, params_dtype=dtype)
    out = {}
    for name, param in layer.named_parameters():
        packed = getattr(param, "packed_factor", None)
        out[name] = (str(param.dtype), tuple(param.shape), int(packed) if packed is not None else None)
    return out


def _solve(shapes: list[tuple[int, ...]]) -> list | None:
    """Each dimension as [[a_num, a_den], [b_num, b_den], c] from the three probe sizes."""
    (i0, o0), (i1, _), (_, o2) = SIZES
    if len({len(s) for s in shapes}) != 1:
        return None
    formulas = []
    for d0, d1, d2 in zip(*shapes):
        a, b = Fraction(d1 - d0, i1 - i0), Fraction(d2 - d0, o2 - o0)
        c = d0 - a * i0 - b * o0
        if c.denominator != 1:
            return None
        formulas.append([[a.numerator, a.denominator], [b.numerator, b.denominator], int(c)])
    return formulas


_BITS = {"BF16": 16, "F16": 16, "F32": 32, "I32": 32, "I64": 64, "U8": 8, "I8": 8, "F8_E4M3": 8, "F8_E8M0": 8, "I16": 16}


def _measure(cfg) -> dict:
    """The parameters ``cfg``'s Linear method creates, as formulas; or why they cannot be written so."""
    import torch

    runs = [_params(cfg, i, o, torch.bfloat16) for i, o in SIZES]
    other_dtype = _params(cfg, *SIZES[0], torch.float16)
    check = _params(cfg, *CHECK_SIZE, torch.bfloat16)
    if len({tuple(r) for r in (*runs, other_dtype, check)}) != 1:
        return {"refused": "the parameter names change with the Linear's size"}
    params = []
    for name in runs[0]:
        formula = _solve([run[name][1] for run in runs])
        dtype = runs[0][name][0]
        if formula is None or list(check[name][1]) != [vp._dimension(f, *CHECK_SIZE) for f in formula]:
            return {"refused": f"{name}'s shape is not linear in the Linear's size"}
        follows = dtype == "torch.bfloat16" and other_dtype[name][0] == "torch.float16"
        params.append({"name": name, "dtype": vp.MODEL_DTYPE if follows else ST_DTYPES.get(dtype, dtype), "shape": formula})
    i0, o0 = SIZES[0]
    stored = {p["name"]: runs[0][p["name"]][1] for p in params}

    def nbits(p):
        numel = 1
        for d in stored[p["name"]]:
            numel *= d
        return numel * _BITS.get(p["dtype"], 16), numel

    weight = max(params, key=lambda p: nbits(p)[0])
    ratio = Fraction(i0 * o0, nbits(weight)[1])
    weight["weight"] = True
    weight["values_per_element"] = int(ratio) if ratio.denominator == 1 else float(ratio)
    mapper = cfg.get_checkpoint_weight_mapper()
    return {"method": type(cfg).__name__, "params": params,
            # checkpoint tensor suffixes vLLM drops before loading (GPTQ's g_idx), and those it
            # skips when no parameter takes them (KV scales)
            "discarded": sorted(k.lstrip(".") for k, v in mapper.orig_to_new_suffix.items() if v is None),
            "ignored_if_unexpected": sorted(s.lstrip(".") for s in cfg._ignore_unexpected_suffixes)}


EXPERTS = 4
_moe_layers = iter(range(10**6))  # vLLM registers each MoE layer by name: one fresh prefix per build


def _expert_params(cfg, hidden: int, inter: int) -> dict[str, tuple[str, tuple[int, ...]]]:
    import torch
    from vllm.model_executor.layers.fused_moe.layer import FusedMoEFactory

    with torch.device("meta"):
        layer = FusedMoEFactory(num_experts=EXPERTS, top_k=2, hidden_size=hidden, intermediate_size=inter, quant_config=cfg,
                                prefix=f"model.layers.{next(_moe_layers)}.mlp.experts", params_dtype=torch.bfloat16)
    return {name.rpartition(".")[2]: (str(p.dtype), tuple(p.shape)) for name, p in layer.named_parameters()}


def _per_linear(formulas: list, gate_up: bool) -> list:
    """A stacked expert parameter's dimensions (after the expert one), solved in (hidden, inter),
    as one expert Linear's (in, out) formulas: down_proj (w2) reads in = inter, out = hidden; gate
    and up (w13) read in = hidden, out = inter, each half of the stacked 2 * inter, and a dimension
    of 2 alone is one entry per shard."""
    out = []
    for (a, b, c) in formulas:
        hidden_coef, inter_coef = Fraction(*a), Fraction(*b)
        if not gate_up:
            out.append([[inter_coef.numerator, inter_coef.denominator], [hidden_coef.numerator, hidden_coef.denominator], c])
        elif inter_coef == 0 and hidden_coef == 0 and c == 2:
            continue
        elif c != 0 and inter_coef != 0:
            return None
        else:
            half = inter_coef / 2
            out.append([[hidden_coef.numerator, hidden_coef.denominator], [half.numerator, half.denominator], c])
    return out


def _measure_experts(cfg) -> dict:
    """The parameters vLLM's MoE method for ``cfg`` creates per expert, as one expert Linear's
    (in, out) formulas per suffix (w13_ gate/up and w2_ down must agree; biases left out)."""
    runs = [_expert_params(cfg, h, i) for h, i in SIZES]
    out: dict[str, dict] = {}
    for name, (dtype, shape) in runs[0].items():
        stack, _, suffix = name.partition("_")
        if suffix == "bias" or shape[:1] != (EXPERTS,):
            continue
        formulas = _solve([run[name][1][1:] for run in runs])
        linear = _per_linear(formulas, stack == "w13") if formulas is not None else None
        entry = {"dtype": ST_DTYPES.get(dtype, dtype), "shape": linear}
        if out.get(suffix, entry) != entry:
            return {"unavailable": f"{suffix}: gate/up and down give different per-Linear parameters"}
        out[suffix] = entry
    return {"params": [{"name": k, **v} for k, v in sorted(out.items())]}


def _resolved_method(qc: dict) -> str:
    """The config class vLLM picks for a checkpoint's declaration: the first method whose
    ``override_quantization_method`` claims it (ModelOpt NVFP4 -> modelopt_fp4), else its own."""
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS, get_quantization_config

    for name in QUANTIZATION_METHODS:
        try:
            claimed = get_quantization_config(name).override_quantization_method(qc, None)
        except Exception:  # noqa: BLE001 - a config class that cannot judge this declaration does not claim it
            continue
        if claimed:
            return claimed
    return qc["quant_method"]


def probe(qc: dict) -> dict:
    from vllm.model_executor.layers.quantization import get_quantization_config

    try:
        cfg = get_quantization_config(_resolved_method(qc)).from_config(qc)
        measured = _measure(cfg)
    except Exception as exc:  # noqa: BLE001 - whatever vLLM raises is what a server would do
        return {"refused": f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"}
    if "params" not in measured:
        return measured
    try:
        measured["experts"] = _measure_experts(cfg)
    except Exception as exc:  # noqa: BLE001 - a MoE backend this CPU build lacks: not known here
        measured["experts"] = {"unavailable": f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"}
    return measured


class _StubKernel:
    """Stands for a GEMM kernel: this CPU build has none of the GPU kernels a scheme picks in its
    create_weights, and the parameters it creates do not depend on which kernel runs them."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def __getattr__(self, name):
        return lambda *args, **kwargs: None


def _stub_kernels() -> None:
    """Every kernel chooser (``choose_*_kernel`` returns a class, ``init_*_kernel`` an instance) and
    Marlin's support check, replaced wherever a module imported them."""
    import vllm.model_executor.kernels.linear as kernels  # noqa: F401 - loads the choosers' users
    from vllm.model_executor.layers.quantization import get_quantization_config

    for method in ("compressed-tensors", "gptq", "awq", "fp8", "modelopt", "modelopt_fp4", "mxfp4", "moe_wna16"):
        get_quantization_config(method)  # import every config module before patching
    for module in [m for name, m in sys.modules.items() if name.startswith("vllm.model_executor") and m is not None]:
        for name in list(vars(module)):
            if name.endswith("_kernel") and name.startswith("choose_"):
                setattr(module, name, lambda *a, **k: _StubKernel)
            elif name.endswith("_kernel") and name.startswith("init_"):
                setattr(module, name, lambda *a, **k: _StubKernel())
            elif name == "verify_marlin_supported":
                setattr(module, name, lambda *a, **k: None)


def _environment():
    """vLLM's config context (a model dtype) and a one-process group, as a server sets them up
    before building layers; GPU kernel choosers stubbed (see _StubKernel)."""
    import types

    import torch
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    config = VllmConfig()
    _stub_kernels()
    context = set_current_vllm_config(config)
    context.__enter__()
    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                 distributed_init_method=f"file://{tempfile.mktemp()}")
    initialize_model_parallel(1, 1)
    config.model_config = types.SimpleNamespace(dtype=torch.bfloat16, is_moe=False)
    return context


def required_keys(method: str) -> list[list[str]]:
    """The declaration keys the config class of ``method`` cannot do without: each
    ``get_from_keys(config, [alternatives])`` of its ``from_config`` (``get_from_keys_or`` has a
    default), read from vLLM's source; vLLM raises "Cannot find any of [...]" when none is present."""
    import ast
    import inspect
    import textwrap

    from vllm.model_executor.layers.quantization import get_quantization_config

    tree = ast.parse(textwrap.dedent(inspect.getsource(get_quantization_config(method).from_config)))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "get_from_keys" and len(node.args) >= 2:
            try:
                keys = ast.literal_eval(node.args[1])
            except ValueError:
                continue  # keys computed at run time: not a fixed requirement
            if keys not in out:
                out.append(keys)
    return out


def table() -> dict:
    import vllm

    _environment()
    schemes = {}
    probes = [*ct_probes(), *other_probes()]
    for key, qc in probes:
        schemes[key] = {"declaration": qc, **probe(qc)}
    # per quant_method the GPTQ / AWQ probes declare: the keys its config class requires
    declared = {qc["quant_method"]: _resolved_method(qc) for _, qc in probes if qc["quant_method"] in (*vp.GPTQ_METHODS, *vp.AWQ_METHODS)}
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS

    from vllm.model_executor.model_loader.default_loader import _CONFIG_BUILT_PARAMS

    return {"vllm": vllm.__version__, "methods": sorted(QUANTIZATION_METHODS),
            "config_built": sorted(_CONFIG_BUILT_PARAMS), "sizes": [list(s) for s in SIZES], "schemes": dict(sorted(schemes.items())),
            "required_keys": {method: required_keys(resolved) for method, resolved in sorted(declared.items())}}


def main(argv: list[str]) -> int:
    from vllm_packed_modules import emit  # the sibling script (its directory is on sys.path)

    return emit(table(), DATA, argv)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
