"""The calibration run: activation and KV statistics from data, layer-streamed from the checkpoint.

``calibrate_checkpoint(src, options)`` runs the calibration samples through a model one decoder
layer at a time (:mod:`.streaming`), records running amax with the hooks of :mod:`.observers`,
and returns the statistics; ``calibrate_to_file`` also writes them where ``fp4forge quantize
--stats`` reads them (the one function `fp4forge calibrate` and the pipeline both call).
``calibrate_in_memory`` runs the same hooks on the whole model loaded by ``from_pretrained``:
the reference the streamed run must equal bit for bit.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fp4forge import __version__
from fp4forge.model.samples import SampleOptions, Samples, samples_for
from fp4forge.calibrate.observers import CalibrationObserver
from fp4forge.calibrate.options import POLICIES, CalibrationOptions
from fp4forge.model import distributed
from fp4forge.model.device import is_cuda, resolve_device
from fp4forge.model.streaming import ActivationStore, SpillSpace, StreamedModel, build_weight_plan, check_bf16_source, embed_batches, run_layer
from fp4forge.checkpoint.reader import Checkpoint, open_checkpoint
from fp4forge.errors import ConfigError

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
            # the text's warnings (the built-in corpus used as an unasked fallback: model/samples.py)
            "warnings": list(self.metadata.get("data", {}).get("warnings", [])),
        }


def calibration_samples(ckpt: Checkpoint, options: SampleOptions, split: str = "calibration") -> Samples:
    return samples_for(options, ckpt, split=split)


def _metadata(ckpt: Checkpoint, samples: Samples, options: CalibrationOptions, observed: dict[str, Any], mode: str) -> dict[str, Any]:
    return {
        "fp4forge_version": __version__,
        "source": ckpt.display,
        "mode": mode,
        "batch_size": options.batch_size,
        "portable": options.portable,
        "data": samples.describe(),
        **observed,
    }


#: MKL's conditional numerical reproducibility: its float32 matmuls (a router's logits) take one
#: code path on every x86 CPU. COMPATIBLE, not AVX2: MKL honours its AVX2 branch on Intel CPUs only
#: (its CNR guide; elsewhere it falls back to choosing by CPU). MKL reads it once, at its first call.
MKL_CBWR = ("MKL_CBWR", "COMPATIBLE")


@contextlib.contextmanager
def portable_cpu_kernels(on: bool) -> Iterator[None]:
    """With ``on``: bf16 matmuls on ATen's own kernels, not oneDNN's, and MKL's float32 matmuls on
    its one portable branch (:data:`MKL_CBWR`, unless the environment chose one): both libraries pack and
    sum for the CPU they find (AVX2, AVX-512, AMX, its vendor), so a few results (a calibrated
    maximum, a token's expert) would differ between machines (``tests/test_export_cpu_kinds.py``).
    MKL's branch then holds for the rest of the process; a process that ran an MKL matmul
    before keeps the branch it had."""
    if not on:
        yield
        return
    os.environ.setdefault(*MKL_CBWR)
    with torch.backends.mkldnn.flags(enabled=False):
        yield


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
    check_bf16_source(ckpt)
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
    total = streamed.num_layers + 2
    try:
        with portable_cpu_kernels(options.portable and device.type == "cpu"):
            timings = _observe_layers(streamed, observer, batches, space, progress, total)
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


def _observe_layers(streamed: StreamedModel, observer: CalibrationObserver, batches: list[torch.Tensor], space: SpillSpace,
                    progress: Progress, total: int) -> dict[str, float]:
    """Every batch through every layer with the observers attached, then the head's inputs; the
    seconds each part took."""
    timings: dict[str, float] = {}
    mark = time.perf_counter()
    store, calls = embed_batches(streamed, batches, space)
    timings["embedding"] = time.perf_counter() - mark
    for index in range(streamed.num_layers):
        if progress:
            progress(index + 1, total, f"layer {index + 1}/{streamed.num_layers}")
        mark = time.perf_counter()
        with streamed.layer(index) as layer:
            loaded = time.perf_counter()
            detach = observer.attach(layer, streamed.layer_prefix(index))
            try:
                store = run_layer(layer, index, store, batches, calls, ActivationStore(space, f"layer{index}"))
            finally:
                detach()
        timings[f"layer.{index}.load"] = loaded - mark  # materialising from the checkpoint
        timings[f"layer.{index}.run"] = time.perf_counter() - loaded  # every batch through it
    mark = time.perf_counter()
    head = streamed.plan.disk_module(streamed.head_name)
    with streamed.final_norm() as norm:
        for number in range(len(batches)):
            observer.observe_head_input(head, norm(store.get(number)))
            store.drop(number)
    timings["head"] = time.perf_counter() - mark
    return timings


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
    check_bf16_source(ckpt)
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
