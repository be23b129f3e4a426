"""What a quantize job is asked to do (:class:`QuantizeOptions`), validated once."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Literal, get_args

from fp4forge.checkpoint.writer import DEFAULT_MAX_SHARD_BYTES
from fp4forge.errors import ConfigError, require_choice
from fp4forge.model.device import resolve_device
from fp4forge.quantize.act_scales import ConstantAmax, StatsAmax
from fp4forge.quantize.recipe import Recipe

Progress = Callable[[int, int, str], None]
LayoutFormat = Literal["compressed-tensors", "modelopt"]
BlockScales = Literal["minmax", "four_over_six", "mse"]
LAYOUT_FORMATS: tuple[str, ...] = get_args(LayoutFormat)
BLOCK_SCALES: tuple[str, ...] = get_args(BlockScales)


@dataclass(frozen=True)
class QuantizeOptions:
    recipe: Recipe
    layout_format: LayoutFormat = "compressed-tensors"
    block_scales: BlockScales = "minmax"  # minmax is identical to the reference exporters
    act_amax: ConstantAmax | StatsAmax | None = None
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES
    # compute threads: units quantized concurrently, one torch thread each (bytes do not depend on it);
    # a reader thread besides them reads the next units while these compute
    workers: int = max(1, os.cpu_count() or 1)
    # the per-Linear relative weight error (provenance, summary); False skips its arithmetic
    error_report: bool = True
    device: str | None = None  # where the numerics run; None/"auto": CUDA when available (bytes do not depend on it)
    # Precomputed NVFP4 weights (GPTQ: calibrate/gptq.py) written instead of the block-scale rule's;
    # anything with ``.weights: dict[module, Nvfp4Weight]`` and ``.provenance() -> dict``.
    precomputed: Any = None

    def __post_init__(self) -> None:
        resolve_device(self.device)
        require_choice(self.layout_format, LAYOUT_FORMATS, "layout_format")
        require_choice(self.block_scales, BLOCK_SCALES, "block_scales")
        if self.workers < 1:
            raise ConfigError(f"threads must be at least 1, got {self.workers}", option="workers")
