"""Fidelity of a quantized student against its BF16 teacher, both layer-streamed.

The student runs the numerics a W4A4 deployment runs, on any CPU:

* weights dequantized as vLLM's emulation does (NVFP4: ``e2m1 * fp8(block) * weight_scale_2``;
  FP8: ``fp8 * scale``), in the teacher's dtype;
* NVFP4 activations fake-quantized per 16-element block with the checkpoint's input global scale
  (``nvfp4_fake_quantize_activation``, vLLM's ``ref_nvfp4_quant_dequant``); static FP8
  activations with their input scale; FP8-dynamic per token. Fused shards (q/k/v, gate/up) use
  the group's largest amax, as vLLM takes the max. Routed experts: ``moe_input_scale``
  ``global-max`` (one scale per projection over all experts of a layer, what vLLM's FlashInfer
  and emulation MoE backends use) or ``per-expert`` (VLLM_CUTLASS);
* the KV cache fake-quantized to FP8 E4M3 with the checkpoint's k/v scales — at 1.0 when an FP8
  cache is declared without scales, which is what vLLM then does.

``numerics="w4a16"`` keeps everything but drops the NVFP4 activation quantization (what MARLIN
and HUMMING do to a W4A4 checkpoint), so W4A4 and W4A16 can be compared on the same bytes.

Reported: KL(teacher || student) per predicted position (mean, median, p99), top-1 agreement,
perplexity of both on the text's next tokens, and the relative error ``||s - t|| / ||t||`` of every
decoder layer's output (``accumulated``: the student fed its own activations; ``local``: the
student layer fed the teacher's input).

Teacher cache (``teacher_cache``): per position the teacher's top-k token ids and log-probs, ``m``
token ids sampled (with replacement, seeded) from the teacher's distribution restricted to the
remaining vocabulary, their log-probs, the remaining mass ``r``, and the log-prob of the actual
next token. KL is then estimated as

    KL ~= sum_{i in top-k} p_i (log p_i - log q_i)  +  r * mean_j (log p_{t_j} - log q_{t_j})

with ``q`` the student's full softmax, computed live. The first term is exact, the second a Monte
Carlo mean over the tail distribution ``p / r``: unbiased for each position's KL (its variance
shrinks with ``m`` and with ``r``); perplexity and top-1 agreement stay exact. Without a cache, or
while writing one, the KL is exact (full vocabulary) and the estimate is reported beside it.
"""

from __future__ import annotations

import json

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fp4forge import __version__
from fp4forge.checkpoint.codecs import Nvfp4Codec, codec
from fp4forge.model import distributed
from fp4forge.fidelity.intervals import fidelity_intervals
from fp4forge.fidelity.options import FidelityOptions
from fp4forge.fidelity.readable import check_readable
from fp4forge.model.samples import Samples, samples_for
from fp4forge.model.hooks import (
    KVCacheTap,
    NoTap,
    check_fused_experts,
    install_experts_forward,
    install_kv_tap,
    is_fused_experts,
)
from fp4forge.model.device import resolve_device
from fp4forge.model.streaming import ActivationStore, SpillSpace, StreamedModel, call_layer, embed_batches, layer_call, run_layer
from fp4forge.checkpoint.declarations import detect_format, read_declaration
from fp4forge.checkpoint.quantized import QuantizedCheckpoint, attention_layers, kv_layout
from fp4forge.checkpoint.tensor_file import load_tensors, save_tensors
from fp4forge.checkpoint.reader import Checkpoint, open_checkpoint
from fp4forge.errors import ConfigError
from fp4forge.numerics.fp8 import fp8_activation_fake_quantizer, fp8_dynamic_fake_quantize, fp8_fake_quantize
from fp4forge.numerics.nvfp4 import ct_global_scale_from_amax, nvfp4_activation_fake_quantizer, nvfp4_fake_quantize_activation

ARCHITECTURE_KEYS = ("architectures", "model_type", "num_hidden_layers", "hidden_size", "vocab_size", "num_key_value_heads")
Progress = Callable[[int, int, str], None] | None


# -- activation fake-quantization ------------------------------------------------------------------
ActQuant = Callable[[Tensor], Tensor]


@dataclass(frozen=True)
class ActivationScale:
    """A Linear's input quantization: ``kind`` (nvfp4 | fp8 | fp8_dynamic) and its per-tensor
    amax (what the stored input scale stands for), comparable across shards."""

    kind: str
    amax: float

    def quantizer(self, device: torch.device | str = "cpu") -> ActQuant:
        return ACTIVATION_QUANTIZERS[self.kind](self.amax, torch.device(device))


def _nvfp4_activation_on(amax: float, device: torch.device) -> ActQuant:
    """nvfp4_activation_fake_quantizer with its [1] global scale moved to ``device`` once."""
    if device.type == "cpu":
        return nvfp4_activation_fake_quantizer(amax)
    gs = ct_global_scale_from_amax(amax).to(device)
    return lambda x: nvfp4_fake_quantize_activation(x, gs)


ACTIVATION_QUANTIZERS: dict[str, Callable[[float, torch.device], ActQuant]] = {
    "nvfp4": _nvfp4_activation_on,
    "fp8": lambda amax, _device: fp8_activation_fake_quantizer(amax),  # a 0-dim scale goes with any device
    "fp8_dynamic": lambda _amax, _device: fp8_dynamic_fake_quantize,
}


def activation_scale(view: QuantizedCheckpoint, module: str) -> ActivationScale | None:
    """How vLLM quantizes this module's input (None: not at all)."""
    q = view.linears.get(module)
    if q is None:
        return None
    if view.has_input_scale(module):
        return ActivationScale(q.scheme, view.input_amax(module))
    # no stored input scale: quantized at run time (FP8 dynamic) or not at all (weight-only)
    return ActivationScale(q.scheme, 0.0) if q.codec.dynamic_activations else None


# -- the student's numerics on one layer -------------------------------------------------------------
class ExpertFakeQuant:
    """An expert tap that fake-quantizes each expert's GEMM inputs."""

    def __init__(self, gate_up: list[ActQuant | None], down: list[ActQuant | None]):
        self.gate_up = gate_up
        self.down = down

    def routed(self, counts: Tensor) -> None:
        pass

    def gate_up_input(self, expert: int, x: Tensor) -> Tensor:
        quant = self.gate_up[expert]
        return x if quant is None else quant(x)

    def down_input(self, expert: int, h: Tensor) -> Tensor:
        quant = self.down[expert]
        return h if quant is None else quant(h)

    def after_routed(self, module: nn.Module, hidden_states: Tensor) -> None:
        pass


class SharedExpertFakeQuant(ExpertFakeQuant):
    """Every expert's input quantized alike (``global-max``): all experts' rows in one call. The
    quantizers act per row (per 16-element block or per token), so this is the per-expert result."""

    def __init__(self, gate_up: ActQuant | None, down: ActQuant | None, count: int):
        super().__init__([gate_up] * count, [down] * count)
        self.shared_gate_up, self.shared_down = gate_up, down

    def gate_up_rows(self, x: Tensor, experts: Tensor) -> Tensor:
        return x if self.shared_gate_up is None else self.shared_gate_up(x)

    def down_rows(self, h: Tensor, experts: Tensor) -> Tensor:
        return h if self.shared_down is None else self.shared_down(h)


def _group_scale(scales: list[ActivationScale | None]) -> ActivationScale | None:
    """Shards vLLM fuses share the largest amax (vLLM takes the max scale)."""
    present = [s for s in scales if s is not None]
    if not present:
        return None
    return ActivationScale(present[0].kind, max(s.amax for s in present))


class StudentNumerics:
    """Hooks that make a materialised layer compute what the quantized deployment computes."""

    def __init__(self, streamed: StreamedModel, view: QuantizedCheckpoint, options: FidelityOptions):
        self.streamed = streamed
        self.view = view
        self.options = options
        self.kv_scales = _student_kv_scales(view, streamed.device)
        self.activation_quantized = 0

    def _scale(self, disk_module: str) -> ActivationScale | None:
        scale = activation_scale(self.view, disk_module)
        if scale is not None and isinstance(codec(scale.kind), Nvfp4Codec) and self.options.numerics == "w4a16":
            return None  # MARLIN / HUMMING drop the activation scales
        return scale

    def _fused_scale(self, disk_module: str) -> ActivationScale | None:
        return _group_scale([self._scale(m) for m in self.view.fused_partners(disk_module)])

    def attach(self, layer: nn.Module, prefix: str) -> Callable[[], None]:
        undo = [install_kv_tap(layer, KVCacheTap(transform=self.kv_scales.get(prefix)))]
        for name, module in layer.named_modules():
            full = f"{prefix}.{name}" if name else prefix
            if isinstance(module, nn.Linear):
                scale = self._fused_scale(self.streamed.plan.disk_module(full))
                if scale is not None:
                    undo.append(_quantize_input(module, scale.quantizer(self.streamed.device)))
                    self.activation_quantized += 1
            elif is_fused_experts(module):
                check_fused_experts(module, full)
                undo.append(install_experts_forward(module, self._expert_tap(full, module.num_experts)))
        return _undo_all(undo)

    def _expert_tap(self, experts: str, count: int) -> ExpertFakeQuant:
        plan = self.streamed.plan
        gate_up = [_group_scale([self._scale(m) for m in plan.expert_modules(f"{experts}.gate_up_proj", e)]) for e in range(count)]
        down = [_group_scale([self._scale(m) for m in plan.expert_modules(f"{experts}.down_proj", e)]) for e in range(count)]
        device = self.streamed.device
        if self.options.moe_input_scale == "global-max":
            shared = _group_scale(gate_up), _group_scale(down)
            self.activation_quantized += count * sum(s is not None for s in shared)
            return SharedExpertFakeQuant(*[s and s.quantizer(device) for s in shared], count)
        self.activation_quantized += sum(s is not None for s in gate_up + down)
        return ExpertFakeQuant([s and s.quantizer(device) for s in gate_up], [s and s.quantizer(device) for s in down])

    def attach_head(self, head: nn.Module) -> Callable[[], None]:
        scale = self._scale(self.streamed.plan.disk_module(self.streamed.head_name))
        return _quantize_input(head, scale.quantizer(self.streamed.device)) if scale is not None else (lambda: None)


def _quantize_input(module: nn.Module, quant: ActQuant) -> Callable[[], None]:
    def hook(_: nn.Module, args: tuple) -> tuple:
        return (quant(args[0]), *args[1:])

    return module.register_forward_pre_hook(hook).remove


def _fp8_kv_transform(k_scale: Tensor, v_scale: Tensor) -> Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]:
    def broadcast(scale: Tensor) -> Tensor:  # [] or [kv_heads] against [B, kv_heads, S, D]
        return scale.reshape(1, -1, 1, 1) if scale.numel() > 1 else scale.reshape(())

    k, v = broadcast(k_scale), broadcast(v_scale)
    return lambda key, value: (fp8_fake_quantize(key, k), fp8_fake_quantize(value, v))


def _student_kv_scales(view: QuantizedCheckpoint, device: torch.device | str = "cpu") -> dict[str, Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]]:
    """Per layer prefix, the FP8 KV fake-quant (absent scales of a declared cache -> 1.0, as vLLM)."""
    ckpt = view.ckpt
    declaration = read_declaration(ckpt.config, ckpt.extra_json)
    if declaration is None or declaration.kv is None:
        return {}
    if declaration.kv.algo != "fp8":
        raise ConfigError(f"fidelity emulates FP8 KV caches only, the checkpoint declares {declaration.kv.algo}", file=ckpt.display)
    layers = attention_layers(ckpt)
    found = view.kv_scales(layers)
    one = torch.ones((), dtype=torch.float32)
    out = {}
    for layer in layers:
        stored = found.get(layer, {})
        scales = [stored.get(r, one) for r in ("k_scale", "v_scale")]
        out[layer] = _fp8_kv_transform(*[(s.reshape(()) if s.numel() == 1 else s).to(device) for s in scales])
    return out


# -- metrics --------------------------------------------------------------------------------------
@dataclass
class PositionMetrics:
    """Per predicted position (all samples, positions 0..S-2), F32 on the CPU."""

    kl: list[Tensor] = field(default_factory=list)
    kl_estimate: list[Tensor] = field(default_factory=list)
    agree: list[Tensor] = field(default_factory=list)
    teacher_nll: list[Tensor] = field(default_factory=list)
    student_nll: list[Tensor] = field(default_factory=list)

    @staticmethod
    def _cat(parts: list[Tensor]) -> Tensor:
        return torch.cat([p.reshape(-1).cpu() for p in parts]) if parts else torch.empty(0)

    def summary(self, samples: Samples, seed: int = 0) -> dict[str, Any]:
        """The run's numbers, each with its bootstrap interval over documents (fidelity/intervals.py)."""
        exact = self._cat(self.kl)
        estimate = self._cat(self.kl_estimate)
        kl = exact if exact.numel() else estimate
        parts = self.kl if exact.numel() else self.kl_estimate
        out: dict[str, Any] = {
            "positions": int(kl.numel()),
            # One mean per sample (a row of the batch); the intervals resample documents (fidelity/intervals.py).
            "kl_per_sample": [float(row.to(torch.float64).mean()) for part in parts for row in part.reshape(part.shape[0], -1)],
            "kl": _distribution(kl) | {"estimator": "exact (full vocabulary)" if exact.numel() else "top-k + sampled tail (unbiased)"},
            "top1_agreement": float(self._cat(self.agree).float().mean()),
            "perplexity": {"teacher": math.exp(float(self._cat(self.teacher_nll).mean())), "student": math.exp(float(self._cat(self.student_nll).mean()))},
        }
        if exact.numel() and estimate.numel():
            out["kl_cache_estimate"] = _distribution(estimate)
        per_position = {"kl": kl, "agree": self._cat(self.agree), "teacher_nll": self._cat(self.teacher_nll), "student_nll": self._cat(self.student_nll)}
        return out | fidelity_intervals({k: v.to(torch.float64).numpy() for k, v in per_position.items()}, samples.document_ids.numpy(), seed=seed)

    def gathered(self, ranks: distributed.Ranks) -> PositionMetrics:
        """Every rank's positions, in batch order (the ranks hold contiguous blocks of batches),
        so medians and quantiles are those of one process."""
        if not ranks.distributed:
            return self
        names = ("kl", "kl_estimate", "agree", "teacher_nll", "student_nll")
        mine = {name: self._cat(getattr(self, name)).cpu() for name in names}  # objects travel via the host
        every = ranks.all_gather_object(mine)
        return PositionMetrics(**{name: [part[name] for part in every if part[name].numel()] for name in names})


def _distribution(values: Tensor) -> dict[str, float]:
    values = values.to(torch.float64)
    return {"mean": float(values.mean()), "median": float(values.median()), "p99": float(torch.quantile(values, 0.99))}


@dataclass
class TeacherEntry:
    """The teacher's view of one batch [B, S-1 predicted positions]."""

    topk_ids: Tensor  # int64 [B, P, k]
    topk_logp: Tensor  # F32
    tail_ids: Tensor  # int64 [B, P, m]
    tail_logp: Tensor  # F32
    tail_mass: Tensor  # F32 [B, P]
    target_logp: Tensor  # F32 [B, P]
    argmax: Tensor  # int64 [B, P]


def teacher_entry(logp: Tensor, targets: Tensor, top_k: int, tail_samples: int, generator: torch.Generator) -> TeacherEntry:
    """Top-k, a seeded sample of the tail distribution, and the exact target log-prob."""
    topk_logp, topk_ids = logp.topk(top_k, dim=-1)
    tail = logp.exp().scatter(-1, topk_ids, 0.0)
    tail_mass = tail.sum(-1)
    flat = tail.reshape(-1, tail.shape[-1])
    rows_with_tail = flat.sum(-1) > 0
    draws = torch.zeros(flat.shape[0], tail_samples, dtype=torch.int64, device=logp.device)
    if bool(rows_with_tail.any()):
        draws[rows_with_tail] = torch.multinomial(flat[rows_with_tail], tail_samples, replacement=True, generator=generator)
    tail_ids = draws.reshape(*logp.shape[:-1], tail_samples)
    return TeacherEntry(
        topk_ids=topk_ids,
        topk_logp=topk_logp,
        tail_ids=tail_ids,
        tail_logp=logp.gather(-1, tail_ids),
        tail_mass=tail_mass,
        target_logp=logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1),
        argmax=topk_ids[..., 0],
    )


def estimated_kl(entry: TeacherEntry, student_logp: Tensor) -> Tensor:
    """sum_top-k p (log p - log q) + r * mean over tail samples of (log p - log q)."""
    head = (entry.topk_logp.exp() * (entry.topk_logp - student_logp.gather(-1, entry.topk_ids))).sum(-1)
    tail = (entry.tail_logp - student_logp.gather(-1, entry.tail_ids)).mean(-1)
    return head + entry.tail_mass * tail


def exact_kl(teacher_logp: Tensor, student_logp: Tensor) -> Tensor:
    return (teacher_logp.exp() * (teacher_logp - student_logp)).sum(-1)


def log_probs(logits: Tensor) -> Tensor:
    """Log-softmax over the vocabulary of all but the last position (they predict the next token)."""
    return F.log_softmax(logits[:, :-1].to(torch.float32), dim=-1)


# -- the teacher cache ------------------------------------------------------------------------------
TEACHER_CACHE_MARKER = "fp4forge_teacher_cache"
CACHE_FIELDS = ("topk_ids", "topk_logp", "tail_ids", "tail_logp", "tail_mass", "target_logp", "argmax")


def save_teacher_cache(path: Path, entries: list[TeacherEntry], samples: Samples, meta: dict[str, Any]) -> None:
    tensors = {name: torch.cat([getattr(e, name).cpu() for e in entries]) for name in CACHE_FIELDS}
    tensors["input_ids"] = samples.input_ids
    save_tensors(path, tensors, metadata={TEACHER_CACHE_MARKER: "1", "meta": json.dumps(meta, sort_keys=True)})


def load_teacher_cache(path: Path, batch_size: int) -> tuple[list[TeacherEntry], Tensor, dict[str, Any]]:
    tensors, metadata = load_tensors(path, (*CACHE_FIELDS, "input_ids"))
    if TEACHER_CACHE_MARKER not in metadata:
        raise ConfigError("not an fp4forge teacher cache", file=str(path))
    split = {name: tensors[name].split(batch_size) for name in CACHE_FIELDS}
    entries = [TeacherEntry(**{name: split[name][i] for name in CACHE_FIELDS}) for i in range(len(split["argmax"]))]
    return entries, tensors["input_ids"], json.loads(metadata["meta"])


# -- the run ------------------------------------------------------------------------------------------
@dataclass
class FidelityReport:
    teacher: str
    student: str
    numerics: str
    moe_input_scale: str
    data: dict[str, Any]
    metrics: dict[str, Any]
    layers: list[dict[str, Any]]
    kv_cache: str
    activation_quantized_gemm_inputs: int
    teacher_cache: dict[str, Any] | None
    seconds: float

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class _LayerError:
    err_sq: float = 0.0
    ref_sq: float = 0.0
    local_err_sq: float = 0.0

    def add(self, student: Tensor, teacher: Tensor, local: Tensor | None) -> None:
        t = teacher.to(torch.float32)
        self.err_sq += float((student.to(torch.float32) - t).pow(2).sum())
        self.ref_sq += float(t.pow(2).sum())
        if local is not None:
            self.local_err_sq += float((local.to(torch.float32) - t).pow(2).sum())

    def to_json(self, layer: str) -> dict[str, Any]:
        ref = math.sqrt(self.ref_sq) or 1.0
        return {"layer": layer, "relative_error": math.sqrt(self.err_sq) / ref, "local_relative_error": math.sqrt(self.local_err_sq) / ref}


def _check_pair(teacher: Checkpoint, student: Checkpoint, dense_student: bool = False) -> str:
    if teacher.config is None or student.config is None:
        raise ConfigError("teacher and student both need a config.json")
    differing = [k for k in ARCHITECTURE_KEYS if teacher.config.get(k) != student.config.get(k)]
    if differing:
        raise ConfigError(f"student and teacher differ in {differing}: not the same model", file=student.display)
    if detect_format(teacher.config, teacher.extra_json) is not None:
        raise ConfigError("the teacher must be the unquantized checkpoint", file=teacher.display)
    layout = kv_layout(student)
    if layout is None:
        if dense_student:
            return "compressed-tensors"  # nothing declared: every Linear runs as stored
        raise ConfigError("the student declares no quantization", file=student.display)
    return layout


@contextlib.contextmanager
def _attached(detach: Callable[[], None]) -> Iterator[None]:
    try:
        yield
    finally:
        detach()


def _teacher_attach(layer: nn.Module) -> Callable[[], None]:
    """The teacher runs the same eager expert loop as the student, untapped."""
    return _undo_all([install_experts_forward(m, NoTap()) for m in layer.modules() if is_fused_experts(m)])


def _undo_all(steps: list[Callable[[], None]]) -> Callable[[], None]:
    def undo() -> None:
        for step in steps:
            step()

    return undo


def _stream_layers(teacher: StreamedModel | None, student: StreamedModel, numerics: StudentNumerics, batches: list[Tensor],
                   space: SpillSpace, errors: list[_LayerError], progress: Progress, total: int) -> tuple[ActivationStore, ActivationStore | None]:
    """Both models layer by layer (the teacher untapped, the student with its numerics), each
    student layer also fed the teacher's input for its local error; the final activations."""
    s_store, s_calls = embed_batches(student, batches, space, "s-in")
    t_store, t_calls = embed_batches(teacher, batches, space, "t-in") if teacher else (None, None)
    for index in range(student.num_layers):
        if progress:
            progress(index + 1, total, f"layer {index + 1}/{student.num_layers}")
        t_out = ActivationStore(space, f"t{index}") if teacher else None
        if teacher:
            with teacher.layer(index) as layer, _attached(_teacher_attach(layer)):
                run_layer(layer, index, t_store, batches, t_calls, t_out, drop_inputs=False)
        s_out = ActivationStore(space, f"s{index}")
        with student.layer(index) as layer, _attached(numerics.attach(layer, student.layer_prefix(index))):
            for number, ids in enumerate(batches):
                call = layer_call(s_calls, ids, index)
                s_out.put(number, call_layer(layer, s_store.get(number), call))
                if teacher:
                    local = call_layer(layer, t_store.get(number), call)
                    errors[index].add(s_out.get(number), t_out.get(number), local)
                s_store.drop(number)
                if teacher:
                    t_store.drop(number)
        s_store, t_store = s_out, t_out
    return s_store, t_store


@torch.inference_mode()
def evaluate(teacher_src: str | Path, student_src: str | Path, options: FidelityOptions = FidelityOptions(), *, progress: Progress = None) -> FidelityReport:
    started = time.perf_counter()
    teacher_ckpt, student_ckpt = open_checkpoint(teacher_src), open_checkpoint(student_src)
    layout = _check_pair(teacher_ckpt, student_ckpt, options.dense_student)
    cached = options.teacher_cache is not None and options.teacher_cache.is_file()
    samples = samples_for(options, teacher_ckpt, student_ckpt, split="heldout", unowned="refuse")
    # Under a launcher each rank evaluates one contiguous block of the batches (from ``first``).
    ranks = distributed.current()
    all_batches = samples.batches(options.batch_size)
    ranks.require_share(len(all_batches), "fidelity batches", option="samples")
    first = ranks.share_range(len(all_batches)).start
    batches = ranks.share(all_batches)
    progress = progress if ranks.is_main else None

    device = resolve_device(options.device)
    teacher = None if cached else StreamedModel.from_checkpoint(teacher_ckpt, device=device)
    view = QuantizedCheckpoint(student_ckpt, layout)
    # vLLM's emulation formula, both layouts, in the teacher's dtype
    student = StreamedModel(student_ckpt.config, view.dequantized(_model_dtype(teacher_ckpt), formula="multiply"), device=device)
    numerics = StudentNumerics(student, view, options)
    space = SpillSpace(options.ram_budget_bytes, options.spill_dir, device=device, activation_budget_bytes=options.activation_budget_bytes)
    errors = [_LayerError() for _ in range(student.num_layers)]
    total = student.num_layers + 2
    try:
        s_store, t_store = _stream_layers(teacher, student, numerics, batches, space, errors, progress, total)
        positions, entries, cache_info = _head(teacher, student, numerics, batches, first, s_store, t_store, samples, options, teacher_ckpt)
    except BaseException:
        ranks.fail("fidelity")
        raise
    finally:
        student.close()
        if teacher is not None:
            teacher.close()
        space.close()
    ranks.agree(True, "fidelity")
    metrics = _scored(positions.gathered(ranks), samples, options, teacher_ckpt)
    if teacher and ranks.distributed:  # squared-error sums: SUM over the ranks' batches
        sums = ranks.all_reduce_sum(torch.tensor([[e.err_sq, e.ref_sq, e.local_err_sq] for e in errors], dtype=torch.float64))
        errors = [_LayerError(*map(float, row)) for row in sums.tolist()]
    if teacher is not None and options.teacher_cache is not None:
        on_host = [TeacherEntry(**{name: getattr(e, name).cpu() for name in CACHE_FIELDS}) for e in entries]
        every = [e for part in ranks.all_gather_object(on_host) for e in part]
        cache_info = ranks.on_main(lambda: _save_cache(options.teacher_cache, every, samples, teacher_ckpt, options), "writing the teacher cache")
    if progress:
        progress(total, total, "done")
    return FidelityReport(
        teacher=teacher_ckpt.display,
        student=student_ckpt.display,
        numerics=options.numerics,
        moe_input_scale=options.moe_input_scale,
        data=samples.describe(),
        metrics=metrics,
        layers=[e.to_json(student.layer_prefix(i)) for i, e in enumerate(errors)] if teacher else [],
        kv_cache=_describe_kv(view),
        activation_quantized_gemm_inputs=numerics.activation_quantized,
        teacher_cache=cache_info,
        seconds=time.perf_counter() - started,
    )


def _scored(positions: PositionMetrics, samples: Samples, options: FidelityOptions, teacher_ckpt: Checkpoint) -> dict[str, Any]:
    """The metrics with their intervals, checked before anything is written (the teacher cache):
    text the teacher cannot read is not scored unless ``allow_unreadable``."""
    metrics = positions.summary(samples, options.seed)
    metrics["readability"] = check_readable(metrics["perplexity"]["teacher"], _vocab_size(teacher_ckpt), options.allow_unreadable, file=teacher_ckpt.display)
    return metrics


def _vocab_size(ckpt: Checkpoint) -> int | None:
    config = ckpt.config or {}
    return config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")


def _model_dtype(ckpt: Checkpoint) -> torch.dtype:
    name = (ckpt.config or {}).get("dtype") or (ckpt.config or {}).get("torch_dtype") or "bfloat16"
    return getattr(torch, name)


def _describe_kv(view: QuantizedCheckpoint) -> str:
    ckpt = view.ckpt
    declaration = read_declaration(ckpt.config, ckpt.extra_json)
    if declaration is None or declaration.kv is None:
        return "not quantized (no FP8 KV declared)"
    found = view.kv_scale_names(attention_layers(ckpt))
    return "fp8 with the checkpoint's k/v scales" if found else "fp8 at scale 1.0 (declared without scales, as vLLM runs it)"


def _head(
    teacher: StreamedModel | None,
    student: StreamedModel,
    numerics: StudentNumerics,
    batches: list[Tensor],
    first: int,
    s_store: ActivationStore,
    t_store: ActivationStore | None,
    samples: Samples,
    options: FidelityOptions,
    teacher_ckpt: Checkpoint,
) -> tuple[PositionMetrics, list[TeacherEntry], dict[str, Any] | None]:
    """Logits of both, per batch (``batches`` are numbers ``first``, ``first + 1``, ... of the
    run), with the teacher either live or from the cache; returns the positions' metrics and the
    teacher entries to cache."""
    metrics = PositionMetrics()
    device = student.device
    entries: list[TeacherEntry] = []
    cache_info: dict[str, Any] | None = None
    if teacher is None:
        entries, cached_ids, meta = load_teacher_cache(options.teacher_cache, options.batch_size)
        if not torch.equal(cached_ids, samples.input_ids):
            raise ConfigError("the teacher cache was made on other text (samples, seq_len or files differ)", file=str(options.teacher_cache))
        if meta.get("teacher_digest") != _digest(teacher_ckpt):
            raise ConfigError("the teacher cache was made from another teacher checkpoint", file=str(options.teacher_cache))
        cache_info = {"path": str(options.teacher_cache), "used": True, **meta}
    with contextlib.ExitStack() as stack:
        s_norm, s_head = stack.enter_context(student.final_norm()), stack.enter_context(student.lm_head())
        stack.enter_context(_attached(numerics.attach_head(s_head)))
        t_norm = t_head = None
        if teacher is not None:
            t_norm, t_head = stack.enter_context(teacher.final_norm()), stack.enter_context(teacher.lm_head())
        for number, ids in enumerate(batches):
            targets = ids[:, 1:].to(device)
            student_logp = log_probs(s_head(s_norm(s_store.get(number))))
            if teacher is not None:
                teacher_logp = log_probs(t_head(t_norm(t_store.get(number))))
                entry = teacher_entry(teacher_logp, targets, options.top_k, options.tail_samples, _tail_generator(options.seed, first + number, device))
                metrics.kl.append(exact_kl(teacher_logp, student_logp))
                if options.teacher_cache is not None:
                    entries.append(entry)
            else:
                entry = TeacherEntry(**{name: getattr(entries[first + number], name).to(device) for name in CACHE_FIELDS})
            if teacher is None or options.teacher_cache is not None:
                metrics.kl_estimate.append(estimated_kl(entry, student_logp))
            metrics.agree.append(entry.argmax == student_logp.argmax(-1))
            metrics.teacher_nll.append(-entry.target_logp)
            metrics.student_nll.append(-student_logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1))
    return metrics, entries if teacher is not None else [], cache_info


def _tail_generator(seed: int, batch: int, device: torch.device) -> torch.Generator:
    """The tail sample's generator (on the compute device), seeded per batch so the draws do not
    depend on how many ranks share the batches."""
    return torch.Generator(device=device).manual_seed(seed * 1_000_003 + batch)


def _save_cache(path: Path, entries: list[TeacherEntry], samples: Samples, teacher_ckpt: Checkpoint, options: FidelityOptions) -> dict[str, Any]:
    meta = {"teacher": teacher_ckpt.display, "teacher_digest": _digest(teacher_ckpt), "top_k": options.top_k, "tail_samples": options.tail_samples, "seed": options.seed, "fp4forge_version": __version__}
    save_teacher_cache(path, entries, samples, meta)
    return {"path": str(path), "used": False, "written": True, **meta}


def _digest(ckpt: Checkpoint) -> str:
    return ckpt.header_digest()
