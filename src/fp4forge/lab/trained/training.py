"""Train the tiny Laguna from scratch, deterministically, and measure what training gave it.

Same architecture, tokenizer and chat template as ``testbed tiny-laguna`` (``tiny.py``); the
documents come from the caller (fp4forge generates them: ``training_corpus``). Determinism: one seed fixes the init, the data order and
every update; ``torch.use_deterministic_algorithms`` and a fixed thread count fix the arithmetic,
so the same seed, documents, config and torch build give byte-identical safetensors.

The router's ``e_score_correction_bias`` is not a gradient parameter in Laguna (nor in
DeepSeek-V3, where it comes from); it is trained the way those models do, by auxiliary-loss-free
load balancing: after every step each router's bias moves by ``router_bias_rate`` towards the
experts that got fewer tokens than average. So the bias the checkpoint ships is a real, learned
one, and a loader that drops it changes the routing.

Measured, never assumed: held-out perplexity (trained and the untrained init) and, per component,
the kurtosis and max/RMS of the weights and of the activations the Linears see.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import GenerationConfig, LagunaForCausalLM

from fp4forge.checkpoint.atomic import atomic_output_dir, write_text_atomic
from fp4forge.checkpoint.names import CALIBRATION_TEXT_FILE, HELDOUT_TEXT_FILE
from fp4forge.errors import ConfigError
from fp4forge.model.samples import text_jsonl
from fp4forge.testbed.tiny import (
    TINY_MAX_SHARD_BYTES,
    init_model,
    padded,
    quiet_transformers_progress,
    tiny_laguna_config,
)
from fp4forge.testbed.tokenizer import END_OF_TURN_TOKEN, build_tokenizer, generation_stop_ids

ASSISTANT_OPEN_TOKEN = "<assistant>"

Progress = Callable[[int, int, str], None] | None
REPORT_FILE = "fp4forge-training.json"
# The testbed ships text from its own distribution, so calibration and fidelity can be run on what
# the model knows (on foreign text a tiny model predicts no better than chance and KL says little).
# HELDOUT_TEXT_FILE: every held-out document, never trained on; CALIBRATION_TEXT_FILE: an even
# spread over the training documents (checkpoint/names.py).
CALIBRATION_DOCUMENTS = 48


@dataclass(frozen=True)
class TrainingConfig:
    # 0 writes the untrained init: the same seed, config, tokenizer and text files as the build of
    # that seed, so a quality or KL comparison against it isolates what training taught.
    steps: int = 440
    batch_size: int = 3
    # Most of the suite's prompts (tool schemas included) sit inside positions the model was
    # trained on; shorter windows than 1024 buy more steps in the same budget (git history of benchmarks/RESULTS.md).
    seq_len: int = 768
    lr: float = 3e-3
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    # No weight decay anywhere: decay pulls large weights in, and the heavy tails real models
    # have (which quantization must survive) are what this testbed is for.
    weight_decay: float = 0.0
    beta2: float = 0.95
    grad_clip: float = 1.0
    router_bias_rate: float = 2e-3
    # A fixed thread count: the reduction order of a matmul can change with it, so it is part of
    # the cache key; two uses both cores of the 2-core reference machine.
    threads: int = 2
    eval_windows: int = 24  # held-out windows of seq_len tokens scored for perplexity
    # Loss weight of the prompt side of a chat document (system prompt, tool schemas, user and
    # tool messages); the assistant's turns and plain documents weigh 1. The schemas repeat in
    # every transcript: at full weight they take most of a small budget, and what the suite
    # scores is what the assistant writes.
    context_loss_weight: float = 0.1
    # Fraction of the prompt-side positions whose logits are computed at all (drawn per step from
    # the seeded generator; each kept one weighs context_loss_weight / context_sample, so the
    # expected loss is unchanged). The LM head over a 4,096-token vocabulary at every position is
    # the largest matmul of a step, and most positions weigh only 0.1.
    context_sample: float = 0.1

    def __post_init__(self) -> None:
        if self.steps < 0:
            raise ConfigError(f"training steps must be at least 0 (0: the untrained init), got {self.steps}")
        for name in ("batch_size", "seq_len", "threads", "eval_windows"):
            if getattr(self, name) < 1:
                raise ConfigError(f"training {name} must be at least 1, got {getattr(self, name)}")
        if not (0.0 <= self.context_loss_weight <= 1.0):
            raise ConfigError(f"training context_loss_weight must be in [0, 1], got {self.context_loss_weight}")
        if not (0.0 < self.context_sample <= 1.0):
            raise ConfigError(f"training context_sample must be in (0, 1], got {self.context_sample}")
        if not (self.lr > 0):
            raise ConfigError(f"training lr must be positive, got {self.lr}")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


# -- determinism ----------------------------------------------------------------------------------
@contextlib.contextmanager
def deterministic_torch(threads: int) -> Iterator[None]:
    """Deterministic kernels and a fixed thread count for the block; the caller's settings after."""
    was_deterministic = torch.are_deterministic_algorithms_enabled()
    was_threads = torch.get_num_threads()
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(threads)
    try:
        with torch.random.fork_rng(devices=[]):
            yield
    finally:
        torch.use_deterministic_algorithms(was_deterministic)
        torch.set_num_threads(was_threads)


# -- data -----------------------------------------------------------------------------------------
def pack_windows(token_docs: list[list[int]] | list[list[float]], seq_len: int, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """Concatenate documents (each opens with BOS) and cut windows of ``seq_len + 1`` tokens."""
    stream = [token for doc in token_docs for token in doc]
    count = (len(stream) - 1) // seq_len
    if count < 1:
        raise ConfigError(f"the corpus holds {len(stream)} tokens, fewer than one window of {seq_len + 1}")
    windows = [stream[i * seq_len : i * seq_len + seq_len + 1] for i in range(count)]
    return torch.tensor(windows, dtype=dtype)


def token_weights(token_docs: list[list[int]], open_id: int, close_id: int, context_weight: float, plain_weight: float = 1.0) -> list[list[float]]:
    """Per token, the loss weight of predicting it: 1 inside an assistant turn (after ``open_id``
    up to and including ``close_id``), ``plain_weight`` in documents with no turn at all, else
    ``context_weight``."""
    weights = []
    for doc in token_docs:
        if open_id not in doc:
            weights.append([plain_weight] * len(doc))
            continue
        inside, doc_weights = False, []
        for token in doc:
            doc_weights.append(1.0 if inside else context_weight)
            if token == open_id:
                inside = True
            elif token == close_id:
                inside = False
        weights.append(doc_weights)
    return weights


def weighted_loss(logits: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    losses = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none")
    flat = weights.reshape(-1)
    return (losses * flat).sum() / flat.sum()


def sampled_loss(model: torch.nn.Module, batch: torch.Tensor, weights: torch.Tensor, context_weight: float, context_sample: float,
                 generator: torch.Generator) -> torch.Tensor:
    """The weighted next-token loss with logits only where they count: every position of weight
    other than ``context_weight`` (the assistant's turns, plain documents) and a ``context_sample``
    fraction of the prompt-side ones, reweighted by 1/``context_sample`` so the expectation is the
    full weighted loss. Normalised by the full weight sum, as ``weighted_loss``."""
    targets, target_weights = batch[:, 1:], weights[:, 1:]
    if context_sample >= 1.0:
        return weighted_loss(model(input_ids=batch[:, :-1], use_cache=False).logits, targets, target_weights)
    draw = torch.rand(target_weights.shape, generator=generator).to(target_weights.device)
    context = target_weights == context_weight
    keep = ~context | (draw < context_sample)
    kept_weights = torch.where(context, target_weights / context_sample, target_weights)[keep]
    hidden = model.model(input_ids=batch[:, :-1], use_cache=False).last_hidden_state
    logits = model.lm_head(hidden[keep])
    losses = torch.nn.functional.cross_entropy(logits, targets[keep], reduction="none")
    return (losses * kept_weights).sum() / target_weights.sum()


def tokenize_documents(tokenizer: Any, documents: list[str]) -> list[list[int]]:
    # Documents carry their own BOS (the chat template writes it), so no special tokens are added.
    return [tokenizer(doc, add_special_tokens=False).input_ids for doc in documents]


def text_corpus_files(train_documents: list[str], heldout_documents: list[str]) -> dict[str, str]:
    """The JSONL files (``{"text": ...}`` per line, as ``--calib-text`` / ``--fidelity-text`` read them)
    the testbed ships beside its weights: all held-out documents, and a calibration set taken at an
    even stride through the training documents so every family is in it."""
    stride = max(1, len(train_documents) // CALIBRATION_DOCUMENTS)
    calibration = train_documents[::stride][:CALIBRATION_DOCUMENTS]
    return {HELDOUT_TEXT_FILE: text_jsonl(heldout_documents), CALIBRATION_TEXT_FILE: text_jsonl(calibration)}


def _lr_at(step: int, config: TrainingConfig) -> float:
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    progress = (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps)
    floor = config.lr * config.min_lr_ratio
    return floor + (config.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))


# -- router bias: auxiliary-loss-free balancing -----------------------------------------------------
class RouterLoads:
    """Counts, per router, how many tokens chose each expert during one step's forward."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.routers = [m for _, m in sorted(model.named_modules()) if hasattr(m, "e_score_correction_bias") and hasattr(m, "top_k")]
        self.counts: dict[int, torch.Tensor] = {}
        self.handles = [router.register_forward_hook(self._hook) for router in self.routers]

    def _hook(self, module: torch.nn.Module, _inputs: Any, output: Any) -> None:
        selected = output[2]
        counts = torch.bincount(selected.reshape(-1), minlength=module.num_experts).float()
        self.counts[id(module)] = self.counts.get(id(module), 0) + counts

    def update_biases(self, rate: float) -> None:
        with torch.no_grad():
            for router in self.routers:
                load = self.counts.get(id(router))
                if load is None:
                    continue
                router.e_score_correction_bias.add_(rate * torch.sign(load.mean() - load))
        self.counts.clear()

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


def _device_of(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


# -- statistics -----------------------------------------------------------------------------------
def tail_stats(tensor: torch.Tensor) -> dict[str, float]:
    """Pearson kurtosis (a Gaussian has 3) and max|x| / RMS of one tensor's elements."""
    x = tensor.detach().double().reshape(-1)
    centred = x - x.mean()
    variance = centred.pow(2).mean()
    rms = x.pow(2).mean().sqrt()
    return {
        "kurtosis": float(centred.pow(4).mean() / variance.pow(2)) if variance > 0 else float("nan"),
        "max_over_rms": float(x.abs().max() / rms) if rms > 0 else float("nan"),
    }


def weight_component(name: str) -> str | None:
    if "e_score_correction_bias" in name or name.endswith("norm.weight") or "layernorm" in name:
        return None  # vectors, not matrices a quantizer packs
    if "embed_tokens" in name:
        return "embeddings"
    if name.startswith("lm_head"):
        return "lm_head"
    if ".self_attn." in name:
        return "attention"
    if ".mlp.experts." in name:
        return "routed_experts"
    if ".mlp.shared_experts." in name:
        return "shared_expert"
    if ".mlp.gate." in name:
        return "router"
    if ".mlp." in name:
        return "dense_mlp"
    return None


def _summarise(per_tensor: dict[str, list[dict[str, float]]]) -> dict[str, dict[str, float]]:
    summary = {}
    for component, stats in sorted(per_tensor.items()):
        kurtosis = sorted(s["kurtosis"] for s in stats)
        ratio = sorted(s["max_over_rms"] for s in stats)
        summary[component] = {
            "tensors": len(stats),
            "kurtosis_median": kurtosis[len(kurtosis) // 2],
            "kurtosis_max": kurtosis[-1],
            "max_over_rms_median": ratio[len(ratio) // 2],
            "max_over_rms_max": ratio[-1],
        }
    return summary


def weight_tail_stats(model: torch.nn.Module) -> dict[str, dict[str, float]]:
    per_tensor: dict[str, list[dict[str, float]]] = {}
    for name, param in model.named_parameters():
        component = weight_component(name)
        if component is None:
            continue
        if param.dim() == 3:  # fused experts: one matrix per expert
            for matrix in param:
                per_tensor.setdefault(component, []).append(tail_stats(matrix))
        else:
            per_tensor.setdefault(component, []).append(tail_stats(param))
    return _summarise(per_tensor)


# Activation taps: the input each kind of Linear sees (what activation quantization scales).
ACTIVATION_TAPS = {
    "attention.qkv_input": lambda n: n.endswith("self_attn.q_proj"),
    "attention.o_input": lambda n: n.endswith("self_attn.o_proj"),
    "moe.experts_input": lambda n: n.endswith("mlp.experts"),
    "shared_expert.down_input": lambda n: n.endswith("mlp.shared_experts.down_proj"),
    "dense_mlp.down_input": lambda n: n.endswith("mlp.down_proj") and ".experts" not in n and "shared" not in n,
    "lm_head.input": lambda n: n == "lm_head",
}


def activation_tail_stats(model: torch.nn.Module, windows: torch.Tensor) -> dict[str, dict[str, float]]:
    per_tensor: dict[str, list[dict[str, float]]] = {}
    handles = []
    for name, module in model.named_modules():
        for component, matches in ACTIVATION_TAPS.items():
            if matches(name):
                def hook(_module: Any, inputs: Any, _output: Any, component: str = component) -> None:
                    per_tensor.setdefault(component, []).append(tail_stats(inputs[0].float()))
                handles.append(module.register_forward_hook(hook))
    try:
        with torch.no_grad():
            model(input_ids=windows[:, :-1].to(_device_of(model)))
    finally:
        for handle in handles:
            handle.remove()
    return _summarise(per_tensor)


def perplexity(model: torch.nn.Module, windows: torch.Tensor, batch_size: int, mask: torch.Tensor | None = None) -> tuple[float, float | None]:
    """exp(mean next-token NLL) over every token, and over the tokens where ``mask`` (per window
    token) is 1 (None without a mask): one forward pass for both."""
    total, tokens, masked_total, masked_tokens = 0.0, 0, 0.0, 0.0
    with torch.no_grad():
        for start in range(0, len(windows), batch_size):
            batch = windows[start : start + batch_size].to(_device_of(model))
            logits = model(input_ids=batch[:, :-1]).logits.float()
            losses = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1), reduction="none")
            total += float(losses.sum())
            tokens += losses.numel()
            if mask is not None:
                keep = mask[start : start + batch_size, 1:].reshape(-1).to(losses.device)
                masked_total += float((losses * keep).sum())
                masked_tokens += float(keep.sum())
    return math.exp(total / tokens), (math.exp(masked_total / masked_tokens) if masked_tokens else None)


# -- training -------------------------------------------------------------------------------------
@dataclass
class TrainingResult:
    path: Path
    report: dict[str, Any]


def train_laguna(
    out: Path,
    train_documents: list[str],
    heldout_documents: list[str],
    *,
    seed: int = 0,
    config: TrainingConfig = TrainingConfig(),
    progress: Progress = None,
    extra_report: dict[str, Any] | None = None,
    device: str = "cpu",
    tokenizer: Any = None,
) -> TrainingResult:
    """Train the tiny Laguna on the documents and write it (bf16, sharded) with a JSON report.

    ``device`` other than the CPU is for exploring recipes fast (``fp4forge.lab.diagnostics.sweep_trained``):
    its arithmetic differs, so its bytes are not the CPU build's and the cache never holds one."""
    out = Path(out)
    with atomic_output_dir(out) as staging, deterministic_torch(config.threads):
        tokenizer = tokenizer if tokenizer is not None else build_tokenizer()
        stop_ids = generation_stop_ids(tokenizer)
        model_config = tiny_laguna_config(padded(len(tokenizer), 64), tokenizer.bos_token_id, stop_ids, tokenizer.pad_token_id, dense=False)
        model = init_model(LagunaForCausalLM, model_config, seed)

        if progress is not None:
            progress(0, config.steps, "tokenizing the corpus")
        windows = _windows(tokenizer, train_documents, heldout_documents, config)
        if progress is not None:
            progress(0, config.steps, "scoring the untrained init")
        untrained = {"perplexity": perplexity(model, windows.heldout, config.batch_size, windows.heldout_assistant),  # the fp32 init
                     "weights": weight_tail_stats(model)}
        model = model.to(device)
        model.train()
        run = _optimize(model, windows, config, seed, device, progress)

        if progress is not None:
            progress(config.steps, config.steps, "measuring perplexity and tails")
        model = model.to(torch.bfloat16).eval()  # what ships, so what is measured
        report = {**_report(model, windows, run, untrained, seed=seed, config=config, vocab_size=model_config.vocab_size), **(extra_report or {})}
        model = model.to("cpu")
        model.generation_config = GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=stop_ids, pad_token_id=tokenizer.pad_token_id)
        with quiet_transformers_progress():
            model.save_pretrained(staging, max_shard_size=TINY_MAX_SHARD_BYTES)
        tokenizer.save_pretrained(staging)
        for name, text in text_corpus_files(train_documents, heldout_documents).items():
            write_text_atomic(staging / name, text)
        write_text_atomic(staging / REPORT_FILE, json.dumps(report, indent=2, sort_keys=True) + "\n")
    return TrainingResult(out, report)


@dataclass
class _Windows:
    train: torch.Tensor
    train_weights: torch.Tensor  # the loss weight of each training token
    heldout: torch.Tensor
    heldout_assistant: torch.Tensor  # 1 on the assistant's held-out tokens


def _windows(tokenizer: Any, train_documents: list[str], heldout_documents: list[str], config: TrainingConfig) -> _Windows:
    train_docs = tokenize_documents(tokenizer, train_documents)
    train_windows = pack_windows(train_docs, config.seq_len)
    open_id, close_id = (tokenizer.convert_tokens_to_ids(t) for t in (ASSISTANT_OPEN_TOKEN, END_OF_TURN_TOKEN))
    train_weights = pack_windows(token_weights(train_docs, open_id, close_id, config.context_loss_weight), config.seq_len, torch.float32)
    heldout_docs = tokenize_documents(tokenizer, heldout_documents)
    heldout_windows = pack_windows(heldout_docs, config.seq_len)[: config.eval_windows]
    # 1 on the assistant's tokens of chat documents (weight 0 elsewhere): what the suite scores.
    heldout_assistant = pack_windows(token_weights(heldout_docs, open_id, close_id, 0.0, 0.0), config.seq_len, torch.float32)[: config.eval_windows]
    return _Windows(train_windows, train_weights, heldout_windows, heldout_assistant)


@dataclass
class _Run:
    losses: list[float]
    seconds: float
    cpu_seconds: float
    routers: list[torch.nn.Module]  # whose learned biases the report summarises


def _optimize(model: torch.nn.Module, windows: _Windows, config: TrainingConfig, seed: int, device: str, progress: Progress) -> _Run:
    """``config.steps`` AdamW steps over seeded batches, each followed by the routers' bias update."""
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=config.lr, betas=(0.9, config.beta2), weight_decay=config.weight_decay
    )
    loads = RouterLoads(model)
    order = torch.randperm(len(windows.train), generator=generator)
    cursor, losses = 0, []
    started, cpu_started = time.monotonic(), time.process_time()
    for step in range(config.steps):
        if cursor + config.batch_size > len(order):
            order, cursor = torch.randperm(len(windows.train), generator=generator), 0
        picked = order[cursor : cursor + config.batch_size]
        batch, batch_weights = windows.train[picked].to(device), windows.train_weights[picked].to(device)
        cursor += config.batch_size
        for group in optimizer.param_groups:
            group["lr"] = _lr_at(step, config)
        loss = sampled_loss(model, batch, batch_weights, config.context_loss_weight, config.context_sample, generator)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loads.update_biases(config.router_bias_rate)
        losses.append(loss.item())
        if progress is not None:
            cpu = time.process_time() - cpu_started
            progress(step + 1, config.steps, f"training: step {step + 1}/{config.steps} loss {losses[-1]:.3f} cpu {cpu / (step + 1):.2f} s/step")
    train_seconds, train_cpu_seconds = time.monotonic() - started, time.process_time() - cpu_started
    loads.close()
    return _Run(losses, train_seconds, train_cpu_seconds, loads.routers)


def _report(model: torch.nn.Module, windows: _Windows, run: _Run, untrained: dict[str, Any], *, seed: int, config: TrainingConfig,
            vocab_size: int) -> dict[str, Any]:
    """The training report of the trained (bf16) ``model``, beside the ``untrained`` init's measures."""
    trained_ppl, trained_assistant_ppl = perplexity(model, windows.heldout, config.batch_size, windows.heldout_assistant)
    untrained_ppl, untrained_assistant_ppl = untrained["perplexity"]
    losses = run.losses
    return {
        "format": "fp4forge-trained-testbed/1",
        "seed": seed,
        "training": config.to_json(),
        "torch": torch.__version__,
        "vocab_size": vocab_size,
        "train_tokens_seen": config.steps * config.batch_size * config.seq_len,
        "train_windows": len(windows.train),
        "heldout_tokens": int(windows.heldout[:, 1:].numel()),
        "loss_first": losses[0] if losses else None,  # None: --steps 0, the untrained init
        "loss_last_10_mean": sum(losses[-10:]) / len(losses[-10:]) if losses else None,
        "heldout_perplexity": trained_ppl,
        "untrained_heldout_perplexity": untrained_ppl,
        # Over the assistant's tokens only (reasoning, answers, tool-call markup): what the suite scores.
        "heldout_assistant_perplexity": trained_assistant_ppl,
        "untrained_heldout_assistant_perplexity": untrained_assistant_ppl,
        # Wall clock of this build: informative only, the one value that differs between builds.
        # CPU seconds (all threads) say what the steps cost on an idle machine when the host is shared.
        "timing": {"train_seconds": round(run.seconds, 1), "seconds_per_step": round(run.seconds / config.steps, 3) if config.steps else None,
                   "train_cpu_seconds": round(run.cpu_seconds, 1), "cpu_seconds_per_step": round(run.cpu_seconds / config.steps, 3) if config.steps else None},
        "router_bias_abs_mean": float(torch.cat([r.e_score_correction_bias.float().abs() for r in run.routers]).mean()),
        "weights": weight_tail_stats(model),
        "untrained_weights": untrained["weights"],
        "activations": activation_tail_stats(model, windows.heldout[: config.batch_size]),
    }


__all__ = ["CALIBRATION_TEXT_FILE", "HELDOUT_TEXT_FILE", "REPORT_FILE", "TrainingConfig", "TrainingResult", "deterministic_torch", "tail_stats", "text_corpus_files", "train_laguna"]

