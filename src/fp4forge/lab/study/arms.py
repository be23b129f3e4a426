"""Whole-model arms: a quantized student per arm, its KL and top-1 agreement against the BF16 teacher.

Two kinds of student:

* **exported**: the real exporter's checkpoint (``quantize_checkpoint``: FP8 W8A8, NVFP4 with
  min-max / MSE / four-over-six block scales, GPTQ), measured by ``fidelity`` with the numerics a
  server runs (``w4a4``: NVFP4 weights and activations; ``w4a16``: the same bytes, activations
  kept in BF16);
* **fake-quantized**: a BF16 copy of the teacher whose Linear weights are replaced by their
  quantize -> dequantize round trip (:func:`fp4forge.lab.study.frontier.quantize_dequantize`), for
  formats no exporter writes (INT-2/3 with groups, MXFP4): weight-only arms, measured the same way.

Per arm: mean KL per predicted token with a 95 % percentile-bootstrap interval over samples
(positions of one sample are correlated; samples are the independent unit), top-1 agreement and
both perplexities, from :func:`fp4forge.fidelity.evaluate.evaluate`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fp4forge.checkpoint.names import CONFIG_JSON
from fp4forge.checkpoint.reader import open_checkpoint
from fp4forge.checkpoint.writer import CheckpointWriter, TensorSpec
from fp4forge.errors import ConfigError
from fp4forge.fidelity.evaluate import FidelityOptions, FidelityReport, evaluate
from fp4forge.lab.study.frontier import ArmSpec, Progress, component_weights, quantize_dequantize
from fp4forge.stats import bootstrap_mean_ci


def write_fake_quantized(src: str | Path, out: str | Path, arm: ArmSpec, components: tuple[str, ...], *, progress: Progress = None) -> dict[str, Any]:
    """A BF16 copy of ``src`` with each Linear weight of ``components`` replaced by its round trip
    through ``arm``; returns the mean stored bits per quantized weight."""
    ckpt = open_checkpoint(src)
    chosen = {name for names in component_weights(ckpt, components).values() for name in names}
    infos = [info for _shard, info in ckpt.tensors()]
    specs = [TensorSpec(info.name, info.dtype, tuple(info.shape)) for info in infos]
    bits = numel = 0.0
    with CheckpointWriter(out, specs) as writer:
        for done, info in enumerate(infos, 1):
            tensor = ckpt.read_tensor(info.name)
            if info.name in chosen:
                approx, bpp = quantize_dequantize(tensor.to(torch.float32), arm)
                tensor = approx.to(tensor.dtype)
                bits += bpp * tensor.numel()
                numel += tensor.numel()
            writer.write(info.name, tensor)
            if progress is not None:
                progress(done, len(infos), f"fake-quantizing {arm.label}")
        root = getattr(ckpt.source, "root", None)
        if root is not None:
            for path in sorted(Path(root).iterdir()):
                if path.is_file() and not path.name.endswith(".safetensors") and not path.name.endswith(".safetensors.index.json"):
                    writer.copy_file(path, path.name)
    if not numel:
        raise ConfigError(f"no weight of {', '.join(components)} to fake-quantize in {ckpt.display}", option="components")
    return {"bpp": bits / numel, "quantized_parameters": int(numel), "config": CONFIG_JSON}


@dataclass(frozen=True)
class ArmResult:
    name: str
    description: str
    student: str
    numerics: str
    bpp: float | None
    kl: dict[str, Any]  # mean, ci95, median, p99, per_sample
    top1_agreement: float
    perplexity: dict[str, float]
    seconds: float
    positions: int | None = None  # predicted positions the KL is averaged over

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def measure_arm(
    teacher: str | Path, student: str | Path, name: str, description: str, *, options: FidelityOptions, bpp: float | None,
    progress: Progress = None,
) -> ArmResult:
    report: FidelityReport = evaluate(teacher, student, options, progress=progress)
    metrics = report.metrics
    per_sample = metrics["kl_per_sample"]
    lo, hi = bootstrap_mean_ci(per_sample, seed=options.seed)
    kl = {"mean": metrics["kl"]["mean"], "ci95": [lo, hi], "median": metrics["kl"]["median"], "p99": metrics["kl"]["p99"],
          "estimator": metrics["kl"]["estimator"], "per_sample": per_sample}
    return ArmResult(name, description, str(student), options.numerics, bpp, kl, metrics["top1_agreement"], metrics["perplexity"], report.seconds,
                     metrics.get("positions"))


def read_bpp(student: str | Path, components: tuple[str, ...]) -> float | None:
    """Stored bits per parameter of ``components`` in a checkpoint (scales included), from the
    byte table; None when none of them is present."""
    from fp4forge.audit.byte_table import compute_byte_table
    from fp4forge.checkpoint.layout import layout_or_inferred

    ckpt = open_checkpoint(student)
    rows = [c for c in compute_byte_table(ckpt, layout_or_inferred(ckpt.config)).components if c.name in components]
    params = sum(c.params for c in rows)
    return 8 * sum(c.bytes for c in rows) / params if params else None
