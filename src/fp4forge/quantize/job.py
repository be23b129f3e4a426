"""The quantize job: a BF16 checkpoint to NVFP4 / FP8 by a recipe, rounded to nearest or by GPTQ,
then exported (:func:`fp4forge.quantize.export.quantize_checkpoint`).

``QuantizeJob`` holds every choice a user makes and checks all of them when it is made (the
recipe is loaded then, the activation source parsed); ``run_quantize`` runs GPTQ when asked,
then the export. The command line, the Python API, the pipeline and the study all call it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, get_args

from fp4forge.checkpoint.writer import DEFAULT_MAX_SHARD_BYTES
from fp4forge.errors import option_path, require_choice
from fp4forge.model.samples import SampleOptions
from fp4forge.quantize.act_scales import ConstantAmax, StatsAmax, parse_act_scales
from fp4forge.quantize.export import BLOCK_SCALES, BlockScales, ExportSummary, LayoutFormat, QuantizeOptions, quantize_checkpoint
from fp4forge.quantize.gptq import GPTQ_BLOCK_SCALES, GptqOptions, GptqWeights, gptq_weights
from fp4forge.quantize.recipe import Recipe, load_recipe

__all__ = ["METHODS", "QuantizeJob", "QuantizeResult", "run_quantize"]

Progress = Callable[[int, int, str], None] | None
Method = Literal["rtn", "gptq"]
METHODS: tuple[str, ...] = get_args(Method)


@dataclass(frozen=True)
class QuantizeJob:
    """What to quantize how. ``recipe``: a built-in name, a .toml file or a loaded ``Recipe``;
    activation amax from ``stats`` (a calibration-statistics file) or ``act_scales``
    (``"constant:AMAX"``, recorded as uncalibrated), at most one; ``method="gptq"`` rounds the
    NVFP4 Linears by GPTQ (``gptq``: its options; its block scales are ``block_scales``)."""

    recipe: str | Path | Recipe
    layout_format: LayoutFormat = "compressed-tensors"
    block_scales: BlockScales = "minmax"  # minmax is identical to the reference exporters
    stats: Path | None = None
    act_scales: str | None = None
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES
    device: str | None = None  # where the numerics run; None/"auto": CUDA when available (bytes do not depend on it)
    threads: int | None = None  # compute threads; None: every core (bytes do not depend on it)
    error_report: bool = True  # the per-Linear relative weight error (about a third of the NVFP4 arithmetic)
    method: Method = "rtn"
    gptq: GptqOptions = field(default_factory=GptqOptions)

    def __post_init__(self) -> None:
        if not isinstance(self.recipe, Recipe):
            object.__setattr__(self, "recipe", load_recipe(self.recipe))
        require_choice(self.method, METHODS, "method")
        require_choice(self.block_scales, BLOCK_SCALES, "block_scales")
        if self.method == "gptq":  # GPTQ fixes min-max or MSE block scales before its sweep
            require_choice(self.block_scales, GPTQ_BLOCK_SCALES, "block_scales")
            object.__setattr__(self, "gptq", replace(self.gptq, block_scales=self.block_scales))
        if self.stats is not None and self.act_scales is not None:
            parse_act_scales(self.act_scales, self.stats)  # raises: one source, not both
        if self.act_scales is not None:
            parse_act_scales(self.act_scales, None)
        self.export_options(None)  # the exporter's own checks (layout, device, threads), now

    @property
    def recipe_spec(self) -> Recipe:
        assert isinstance(self.recipe, Recipe)
        return self.recipe

    def activations(self) -> ConstantAmax | StatsAmax | None:
        """The activation amax source (reads the statistics file)."""
        return parse_act_scales(self.act_scales, self.stats)

    def export_options(self, act_amax: ConstantAmax | StatsAmax | None, precomputed: GptqWeights | None = None) -> QuantizeOptions:
        threads = {} if self.threads is None else {"workers": self.threads}
        return QuantizeOptions(recipe=self.recipe_spec, layout_format=self.layout_format, block_scales=self.block_scales,
                               act_amax=act_amax, max_shard_bytes=self.max_shard_bytes, device=self.device,
                               error_report=self.error_report, precomputed=precomputed, **threads)


@dataclass
class QuantizeResult:
    export: ExportSummary
    gptq: GptqWeights | None = None

    def to_json(self) -> dict[str, Any]:
        return {**self.export.to_json(), **({"gptq": self.gptq.summary()} if self.gptq is not None else {})}


def run_quantize(src: str | Path, out: str | Path, job: QuantizeJob, *, progress: Progress = None) -> QuantizeResult:
    """GPTQ (when ``job.method`` says so), then the export of ``src`` into the new directory ``out``;
    ``progress`` hears both stages (GPTQ's says "GPTQ layer i/n")."""
    act_amax = job.activations()
    precomputed = None
    if job.method == "gptq":
        with option_path("gptq.calibration", SampleOptions):
            precomputed = gptq_weights(src, job.recipe_spec, job.gptq, progress=progress)
    export = quantize_checkpoint(src, out, job.export_options(act_amax, precomputed), progress=progress)
    return QuantizeResult(export, precomputed)

