"""The compression frontier: bits per parameter against relative weight error, per component.

For every Linear weight of a checkpoint (routed experts, shared expert, dense MLP, attention,
router, ``lm_head``: the layout's components) and every arm (format x bits x group size x
method), the weight is quantized and dequantized with :mod:`fp4forge.numerics` and compared to
the original. Per component the arm reports

* ``rel_error``: ``sqrt(sum ||W - Q(W)||^2 / sum ||W||^2)`` over the component's weights, the
  relative Frobenius error (a fraction), in F32;
* ``bpp``: stored bits per weight, scales included, at the width the format stores them:
  NVFP4 4 + 8/16 (E4M3 block scale) + 32/numel (F32 per-tensor scale); MXFP4 4 + 8/32 (E8M0);
  FP8 8 + 16 per tensor or per output row (bf16 scale, as compressed-tensors stores it);
  INT-N N + 16 per group (bf16 scale) + 8 per group when asymmetric (int8 zero point).

Methods: ``minmax`` (round to nearest on the range the group's extremes give: what
compressed-tensors writes), ``mse`` (NVFP4: the E4M3 block-scale search; INT-N: per-group clip
search), ``four_over_six`` (NVFP4 only). Arms that a format does not define are not run (FP8 and
MXFP4 have only ``minmax``); nothing is estimated.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from fp4forge.checkpoint.layout import layout_or_inferred, quantizable_components
from fp4forge.checkpoint.reader import Checkpoint, open_checkpoint
from fp4forge.errors import ConfigError, given_options
from fp4forge.numerics.clip_search import intn_quantize_mse
from fp4forge.numerics.fp8 import fp8_dequantize_weight, fp8_quantize_weight
from fp4forge.numerics.intn import intn_dequantize, intn_quantize
from fp4forge.numerics.mxfp4 import MXFP4_BLOCK, mxfp4_dequantize, mxfp4_quantize
from fp4forge.numerics.nvfp4 import NVFP4_BLOCK
from fp4forge.numerics.scale_search import error_sums, search_nvfp4

Progress = Callable[[int, int, str], None] | None

FORMATS = ("nvfp4", "mxfp4", "fp8", "int8", "int4", "int3", "int2")
METHODS = ("minmax", "mse", "four_over_six")
# Components whose weights are GEMM matrices (norms, embeddings and router biases are not): the layouts' list.
QUANTIZABLE_COMPONENTS = quantizable_components()
DEFAULT_INT_GROUPS: tuple[int | None, ...] = (16, 32, 64, 128, None)


@dataclass(frozen=True)
class ArmSpec:
    """One quantization of a weight: ``group_size`` None = one group per output row."""

    format: str
    bits: int
    group_size: int | None
    method: str
    symmetric: bool = True

    @property
    def label(self) -> str:
        group = "row" if self.group_size is None else (f"g{self.group_size}" if self.group_size > 0 else "tensor")
        sym = "" if self.symmetric else "-asym"
        return f"{self.format}{sym}-{group}-{self.method}"


def default_arms(formats: tuple[str, ...] = FORMATS, int_groups: tuple[int | None, ...] = DEFAULT_INT_GROUPS) -> list[ArmSpec]:
    arms: list[ArmSpec] = []
    for fmt in formats:
        if fmt == "nvfp4":
            arms += [ArmSpec("nvfp4", 4, NVFP4_BLOCK, m) for m in ("minmax", "mse", "four_over_six")]
        elif fmt == "mxfp4":
            arms.append(ArmSpec("mxfp4", 4, MXFP4_BLOCK, "minmax"))
        elif fmt == "fp8":
            arms += [ArmSpec("fp8", 8, 0, "minmax"), ArmSpec("fp8", 8, None, "minmax")]  # per tensor, per row
        else:
            bits = int(fmt[3:])
            for group in int_groups:
                for method in ("minmax", "mse"):
                    arms.append(ArmSpec(fmt, bits, group, method))
                    if bits <= 3:  # at 2-3 bits a zero point buys a level on each side of an off-centre group
                        arms.append(ArmSpec(fmt, bits, group, method, symmetric=False))
    return arms


@dataclass(frozen=True)
class FrontierOptions:
    formats: tuple[str, ...] = FORMATS
    components: tuple[str, ...] = QUANTIZABLE_COMPONENTS
    int_groups: tuple[int | None, ...] = DEFAULT_INT_GROUPS
    max_tensors_per_component: int | None = None  # None: every weight; a sample for a quick look

    def __post_init__(self) -> None:
        unknown = sorted(set(self.formats) - set(FORMATS))
        if unknown or not self.formats:
            raise ConfigError(f"unknown format(s) {', '.join(unknown) or '(none given)'}; choose from {', '.join(FORMATS)}", option="formats")
        unknown = sorted(set(self.components) - set(QUANTIZABLE_COMPONENTS))
        if unknown or not self.components:
            raise ConfigError(f"unknown component(s) {', '.join(unknown) or '(none given)'}; choose from {', '.join(QUANTIZABLE_COMPONENTS)}",
                              option="components")
        for group in self.int_groups:
            if group is not None and group <= 0:
                raise ConfigError(f"INT group sizes must be positive (or 'row'), got {group}", option="int_groups")
        if self.max_tensors_per_component is not None and self.max_tensors_per_component < 1:
            raise ConfigError("max tensors per component must be at least 1", option="max_tensors")


def frontier_options(**given: Any) -> FrontierOptions:
    """The frontier's options from `fp4forge frontier` or the study (the one place either makes
    them): fields by name, ``None`` keeps the default."""
    return FrontierOptions(**given_options(**given))


def write_frontier(doc: dict[str, Any], out_dir: Path) -> None:
    """``frontier.json`` (saying which fp4forge made it) and ``frontier.md`` in ``out_dir``."""
    import json

    from fp4forge import versioned
    from fp4forge.checkpoint.atomic import write_text_atomic
    from fp4forge.lab.study.tables import frontier_markdown

    write_text_atomic(out_dir / "frontier.json", json.dumps(versioned(doc), indent=1))
    write_text_atomic(out_dir / "frontier.md", frontier_markdown(doc))


@dataclass(frozen=True)
class FrontierArm:
    component: str
    format: str
    bits: int
    group_size: int | None  # None: per output row; 0: per tensor
    method: str
    symmetric: bool
    bpp: float
    rel_error: float
    tensors: int
    parameters: int

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class FrontierResult:
    source: str
    arms: list[FrontierArm]
    skipped: list[dict[str, str]] = field(default_factory=list)  # arm x component not defined (shape)
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {"source": self.source, "arms": [a.to_json() for a in self.arms], "skipped": self.skipped, "seconds": round(self.seconds, 2)}

    def best(self, component: str, fmt: str, method: str | None = None) -> FrontierArm | None:
        """The lowest-error arm of a component and format (and method), or None."""
        found = [a for a in self.arms if a.component == component and a.format == fmt and (method is None or a.method == method)]
        return min(found, key=lambda a: a.rel_error) if found else None


# -- one weight ------------------------------------------------------------------------------------
def quantize_dequantize(w: Tensor, arm: ArmSpec) -> tuple[Tensor, float]:
    """``w`` ``[N, K]`` through the arm's quantizer and back (F32), and its stored bits per weight."""
    numel = w.numel()
    n, k = w.shape
    if arm.format == "nvfp4":
        result = search_nvfp4(w, arm.method)  # type: ignore[arg-type]
        return result.weight.dequantize(torch.float32), 4 + 8 / NVFP4_BLOCK + 32 / numel
    if arm.format == "mxfp4":
        return mxfp4_dequantize(mxfp4_quantize(w), torch.float32), 4 + 8 / MXFP4_BLOCK
    if arm.format == "fp8":
        strategy = "tensor" if arm.group_size == 0 else "channel"
        q = fp8_quantize_weight(w.to(torch.float32), strategy)  # type: ignore[arg-type]
        scale_bits = 16 if strategy == "tensor" else 16 * n
        return fp8_dequantize_weight(q, torch.float32), 8 + scale_bits / numel
    quantize = intn_quantize_mse if arm.method == "mse" else intn_quantize
    q = quantize(w, arm.bits, group_size=arm.group_size, symmetric=arm.symmetric)
    groups = numel // q.group_size
    per_group_bits = 16 + (0 if arm.symmetric else 8)
    return intn_dequantize(q, torch.float32), arm.bits + per_group_bits * groups / numel


def arm_applies(arm: ArmSpec, shape: tuple[int, ...]) -> str | None:
    """Why the arm cannot quantize a weight of this shape, or None."""
    k = shape[-1]
    block = {"nvfp4": NVFP4_BLOCK, "mxfp4": MXFP4_BLOCK}.get(arm.format)
    if block is not None and k % block:
        return f"input width {k} is not a multiple of {block}"
    if arm.format.startswith("int") and arm.group_size and k % arm.group_size:
        return f"input width {k} is not a multiple of the group size {arm.group_size}"
    return None


# -- the checkpoint --------------------------------------------------------------------------------
def component_weights(ckpt: Checkpoint, components: tuple[str, ...], max_per_component: int | None = None) -> dict[str, list[str]]:
    """Component -> the names of its 2-D Linear weights, in checkpoint order."""
    layout = layout_or_inferred(ckpt.config)
    found: dict[str, list[str]] = {}
    for _shard, info in ckpt.tensors():
        name = info.name
        role = layout.classify(name, info.dtype)
        if role.kind != "weight" or role.component not in components or len(info.shape) != 2:
            continue
        names = found.setdefault(role.component, [])
        if max_per_component is None or len(names) < max_per_component:
            names.append(name)
    return found


def _weights(ckpt: Checkpoint, names: list[str]) -> Iterator[Tensor]:
    for name in names:
        yield ckpt.read_tensor(name).to(torch.float32)


def compute_frontier(src: str | Path, options: FrontierOptions = FrontierOptions(), *, progress: Progress = None) -> FrontierResult:
    """Every arm of ``options`` on every weight of the chosen components of ``src``."""
    started = time.monotonic()
    ckpt = open_checkpoint(src)
    by_component = component_weights(ckpt, options.components, options.max_tensors_per_component)
    if not by_component:
        raise ConfigError(f"{ckpt.display} has no 2-D weight in the components {', '.join(options.components)}", option="components")
    arms = default_arms(options.formats, options.int_groups)
    total = sum(len(names) for names in by_component.values())
    done = 0
    sums: dict[tuple[str, ArmSpec], list[float]] = {}  # err_sq, ref_sq, bits, numel, tensors
    skipped: dict[tuple[str, str], str] = {}
    for component, names in by_component.items():
        for name, w in zip(names, _weights(ckpt, names)):
            for arm in arms:
                why = arm_applies(arm, tuple(w.shape))
                if why is not None:
                    skipped[(component, arm.label)] = why
                    continue
                approx, bpp = quantize_dequantize(w, arm)
                err_sq, ref_sq = error_sums(w, approx)
                acc = sums.setdefault((component, arm), [0.0, 0.0, 0.0, 0.0, 0.0])
                acc[0] += err_sq
                acc[1] += ref_sq
                acc[2] += bpp * w.numel()
                acc[3] += w.numel()
                acc[4] += 1
            done += 1
            if progress is not None:
                progress(done, total, f"{component}: {name}")
    result = []
    for (component, arm), (err_sq, ref_sq, bits, numel, tensors) in sums.items():
        if (component, arm.label) in skipped:
            continue  # some weights of the component could not take it: no partial average
        rel = math.sqrt(err_sq / ref_sq) if ref_sq > 0 else 0.0
        result.append(FrontierArm(component, arm.format, arm.bits, arm.group_size, arm.method, arm.symmetric,
                                  bits / numel, rel, int(tensors), int(numel)))
    result.sort(key=lambda a: (a.component, a.bpp, a.rel_error))
    skipped_list = [{"component": c, "arm": label, "reason": why} for (c, label), why in sorted(skipped.items())]
    if not result:  # measured nothing: an empty table is no answer
        reasons = "; ".join(f"{s['component']} {s['arm']}: {s['reason']}" for s in skipped_list[:5])
        raise ConfigError(f"no arm applies to any weight of {', '.join(by_component)} in {ckpt.display} ({reasons})", option="formats")
    return FrontierResult(ckpt.display, result, skipped_list, time.monotonic() - started)


__all__ = [
    "FORMATS", "METHODS", "QUANTIZABLE_COMPONENTS", "ArmSpec", "FrontierArm", "FrontierOptions", "FrontierResult",
    "arm_applies", "component_weights", "compute_frontier", "default_arms", "quantize_dequantize",
]
