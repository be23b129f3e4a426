"""The calibration run: activation and KV statistics from data, layer-streamed from the checkpoint.

``calibrate_checkpoint(src, options)`` runs the calibration samples through a model one decoder
layer at a time (:mod:`.streaming`), records running amax with the hooks of :mod:`.observers`,
and returns the statistics; ``calibrate_to_file`` also writes them where ``fp4forge quantize
--stats`` reads them (the one function `fp4forge calibrate` and the pipeline both call).
``calibrate_in_memory`` runs the same hooks on the whole model loaded by ``from_pretrained``:
the reference the streamed run must equal bit for bit.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

import torch

from fp4forge import __version__
from fp4forge.model.samples import Samples, load_samples, load_tokenizer
from fp4forge.calibrate.observers import POLICIES, CalibrationObserver
from fp4forge.model import distributed
from fp4forge.model.device import is_cuda, resolve_device
from fp4forge.model.streaming import (
    DEFAULT_RAM_BUDGET_BYTES,
    ActivationStore,
    LayerCall,
    SpillSpace,
    StreamedModel,
    build_weight_plan,
    call_layer,
)
from fp4forge.checkpoint.declarations import detect_format
from fp4forge.checkpoint.reader import Checkpoint, open_checkpoint
from fp4forge.errors import ConfigError, require_choice

__all__ = [
    "POLICIES",
    "CalibrationOptions",
    "CalibrationResult",
    "calibrate_checkpoint",
    "calibrate_in_memory",
    "calibrate_to_file",
    "calibration_samples",
]

Progress = Callable[[int, int, str], None] | None
Policy = Literal["routed", "all-experts"]  # the MoE coverage of observers.POLICIES
assert get_args(Policy) == POLICIES


@dataclass(frozen=True)
class CalibrationOptions:
    samples: int = 64
    seq_len: int = 512
    batch_size: int = 4
    policy: Policy = "routed"
    text_files: tuple[Path, ...] = ()
    builtin_corpus: bool = True
    tokenizer: Path | None = None  # default: the checkpoint directory
    ram_budget_bytes: int = DEFAULT_RAM_BUDGET_BYTES
    spill_dir: Path | None = None
    device: str | None = None  # None/"auto": CUDA when available, else CPU (model.device)
    activation_budget_bytes: int | None = None  # kept on the device; None: the device's default
    prefetch: bool = True  # read the next layer on a background thread (same results)

    def __post_init__(self) -> None:
        require_choice(self.policy, POLICIES, "policy")
        resolve_device(self.device)  # a bad or unavailable device fails here, by name
        if self.activation_budget_bytes is not None and self.activation_budget_bytes < 0:
            raise ConfigError(f"must be at least 0, got {self.activation_budget_bytes}", option="activation_budget_bytes")
        for option, least in (("samples", 1), ("seq_len", 2), ("batch_size", 1)):
            if getattr(self, option) < least:
                raise ConfigError(f"must be at least {least}, got {getattr(self, option)}", option=option)


@dataclass
class CalibrationResult:
    tensors: dict[str, torch.Tensor]
    metadata: dict[str, Any]
    seconds: float = 0.0
    spilled_batches: int = 0
    activation_peak_bytes: int = 0
    timings: dict[str, float] = field(default_factory=dict)
    device: str = "cpu"
    host_batches: int = 0  # activations that did not fit the device budget
    device_activation_peak_bytes: int = 0
    device_peak_bytes: int | None = None  # torch.cuda.max_memory_allocated over the run (CUDA only)

    @property
    def tokens(self) -> int:
        return int(self.metadata["data"]["tokens"])

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    def summary(self) -> dict[str, Any]:
        return {
            "tensors": len(self.tensors),
            "tokens": self.tokens,
            "seconds": self.seconds,
            "tokens_per_s": self.tokens_per_s,
            "spilled_batches": self.spilled_batches,
            "activation_peak_bytes": self.activation_peak_bytes,
            "device": self.device,
            "host_batches": self.host_batches,
            "device_activation_peak_bytes": self.device_activation_peak_bytes,
            "device_peak_bytes": self.device_peak_bytes,
            "experts_without_tokens": self.metadata.get("experts_without_tokens", []),
            "moe_policy": self.metadata.get("moe_policy"),
            "ranks": distributed.current().world_size,
        }


def _check_source(ckpt: Checkpoint) -> None:
    if ckpt.config is None:
        raise ConfigError("checkpoint has no config.json", file=ckpt.display)
    if detect_format(ckpt.config, ckpt.extra_json) is not None:
        raise ConfigError("calibrate the BF16 source checkpoint, not a quantized one", file=ckpt.display)


def calibration_samples(ckpt: Checkpoint, options: CalibrationOptions, split: str = "calibration") -> Samples:
    root = getattr(ckpt.source, "root", None)
    tokenizer_dir = options.tokenizer or root
    if tokenizer_dir is None:
        raise ConfigError("a remote checkpoint needs a tokenizer directory", file=ckpt.display, option="tokenizer")
    tokenizer = load_tokenizer(tokenizer_dir)
    return load_samples(tokenizer, samples=options.samples, seq_len=options.seq_len, text_files=options.text_files, split=split, builtin=options.builtin_corpus)


def _metadata(ckpt: Checkpoint, samples: Samples, options: CalibrationOptions, observed: dict[str, Any], mode: str) -> dict[str, Any]:
    return {
        "fp4forge_version": __version__,
        "source": ckpt.display,
        "mode": mode,
        "batch_size": options.batch_size,
        "data": samples.describe(),
        **observed,
    }


@torch.inference_mode()
def calibrate_checkpoint(
    src: str | Path | Checkpoint,
    options: CalibrationOptions = CalibrationOptions(),
    *,
    samples: Samples | None = None,
    progress: Progress = None,
) -> CalibrationResult:
    """Run the samples through the model layer by layer and return its statistics."""
    started = time.perf_counter()
    ckpt = src if isinstance(src, Checkpoint) else open_checkpoint(src)
    _check_source(ckpt)
    samples = samples or calibration_samples(ckpt, options)
    device = resolve_device(options.device)
    if is_cuda(device):
        torch.cuda.reset_peak_memory_stats(device)
    streamed = StreamedModel.from_checkpoint(ckpt, device=device, prefetch=options.prefetch)
    observer = CalibrationObserver(streamed.plan, options.policy, device)
    space = SpillSpace(options.ram_budget_bytes, options.spill_dir, device=device, activation_budget_bytes=options.activation_budget_bytes)
    # Under a launcher each rank runs its block of the batches; the statistics are reduced below.
    ranks = distributed.current()
    all_batches = samples.batches(options.batch_size)
    ranks.require_share(len(all_batches), "calibration batches", option="samples")
    batches = ranks.share(all_batches)
    progress = progress if ranks.is_main else None
    timings: dict[str, float] = {}
    total = streamed.num_layers + 2
    try:
        mark = time.perf_counter()
        store, calls = _embed(streamed, batches, space)
        timings["embedding"] = time.perf_counter() - mark
        for index in range(streamed.num_layers):
            if progress:
                progress(index + 1, total, f"layer {index + 1}/{streamed.num_layers}")
            mark = time.perf_counter()
            with streamed.layer(index) as layer:
                loaded = time.perf_counter()
                detach = observer.attach(layer, streamed.layer_prefix(index))
                try:
                    store = _run_layer(layer, index, store, batches, calls, space)
                finally:
                    detach()
            timings[f"layer.{index}.load"] = loaded - mark  # materialising from the checkpoint
            timings[f"layer.{index}.run"] = time.perf_counter() - loaded  # every batch through it
        mark = time.perf_counter()
        head = streamed.plan.disk_module(streamed.head_name)
        with streamed.final_norm() as norm:
            for number, ids in enumerate(batches):
                observer.observe_head_input(head, norm(store.get(number)))
                store.drop(number)
        timings["head"] = time.perf_counter() - mark
    except BaseException:
        ranks.fail("calibration")
        raise
    finally:
        streamed.close()
        space.close()
    ranks.agree(True, "calibration")
    observer.reduce(ranks)
    tensors, observed = observer.statistics()
    if progress:
        progress(total, total, "done")
    return CalibrationResult(
        tensors=tensors,
        metadata=_metadata(ckpt, samples, options, observed, "layer-streamed"),
        seconds=time.perf_counter() - started,
        spilled_batches=space.spilled_batches,
        activation_peak_bytes=space.peak_bytes,
        timings=timings,
        device=str(device),
        host_batches=space.host_batches,
        device_activation_peak_bytes=space.device_peak_bytes,
        device_peak_bytes=torch.cuda.max_memory_allocated(device) if is_cuda(device) else None,
    )


def calibrate_to_file(
    src: str | Path | Checkpoint,
    stats_out: str | Path,
    options: CalibrationOptions = CalibrationOptions(),
    *,
    progress: Progress = None,
) -> dict[str, Any]:
    """Calibrate ``src`` and write its statistics file at ``stats_out`` (atomically); returns the
    summary (``{"statistics": path, "tensors", "tokens", ...}``)."""
    from fp4forge.checkpoint.stats import write_stats

    result = calibrate_checkpoint(src, options, progress=progress)
    distributed.current().on_main(lambda: write_stats(stats_out, result.tensors, result.metadata), "writing the statistics")
    return {"statistics": str(stats_out), **result.summary()}


def _embed(streamed: StreamedModel, batches: list[torch.Tensor], space: SpillSpace) -> tuple[ActivationStore, dict[tuple[int, ...], list[LayerCall]]]:
    """Layer 0's inputs for every batch, and how each layer is called per batch shape."""
    store = ActivationStore(space, "in")
    calls: dict[tuple[int, ...], list[LayerCall]] = {}
    with streamed.embedding():
        for number, ids in enumerate(batches):
            hidden, layer_calls = streamed.prologue(ids)
            calls.setdefault(tuple(ids.shape), layer_calls)  # unpadded: the same for every batch of a shape
            store.put(number, hidden)
    return store, calls


def _run_layer(layer: torch.nn.Module, index: int, store: ActivationStore, batches: list[torch.Tensor], calls: dict[tuple[int, ...], list[LayerCall]], space: SpillSpace) -> ActivationStore:
    out = ActivationStore(space, f"layer{index}")
    for number, ids in enumerate(batches):
        out.put(number, call_layer(layer, store.get(number), calls[tuple(ids.shape)][index]))
        store.drop(number)
    return out


@torch.inference_mode()
def calibrate_in_memory(
    src: str | Path | Checkpoint,
    options: CalibrationOptions = CalibrationOptions(),
    *,
    samples: Samples | None = None,
) -> CalibrationResult:
    """The reference: the whole model from ``from_pretrained``, the same hooks on every layer,
    the same batches through the full forward. Needs the whole model in memory."""
    from transformers import AutoModelForCausalLM

    started = time.perf_counter()
    ckpt = src if isinstance(src, Checkpoint) else open_checkpoint(src)
    _check_source(ckpt)
    samples = samples or calibration_samples(ckpt, options)
    root = getattr(ckpt.source, "root", None)
    if root is None:
        raise ConfigError("the in-memory reference needs a local checkpoint", file=ckpt.display)
    model = AutoModelForCausalLM.from_pretrained(root).eval()
    plan = build_weight_plan(model, {info.name: tuple(info.shape) for _, info in ckpt.tensors()})
    observer = CalibrationObserver(plan, options.policy)
    layers_prefix = f"{model.base_model_prefix}.layers"
    layers = getattr(model, model.base_model_prefix).layers
    undo = [observer.attach(layer, f"{layers_prefix}.{index}") for index, layer in enumerate(layers)]
    head = model.get_output_embeddings()
    head_disk = plan.disk_module(next(name for name, m in model.named_modules() if m is head))
    undo.append(head.register_forward_pre_hook(lambda _, args: observer.observe_head_input(head_disk, args[0])).remove)
    try:
        for ids in samples.batches(options.batch_size):
            model(input_ids=ids, use_cache=False)
    finally:
        for step in undo:
            step()
    tensors, observed = observer.statistics()
    return CalibrationResult(tensors=tensors, metadata=_metadata(ckpt, samples, options, observed, "in-memory"), seconds=time.perf_counter() - started)
