"""The quantize job: a BF16 checkpoint to NVFP4 / FP8 by a recipe, rounded to nearest or by GPTQ
(:mod:`fp4forge.quantize.gptq`), then exported (:func:`fp4forge.quantize.export.quantize_checkpoint`).

``QuantizeJob`` holds every choice a user makes and checks all of them when it is made (the
recipe is loaded then, the activation source parsed); ``run_quantize`` runs GPTQ when asked, then
the export. The command line, the Python API, the pipeline and the study all call it. This module
is light to import (torch loads with the run): the command line reads its defaults here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, get_args

from fp4forge.checkpoint.writer import DEFAULT_MAX_SHARD_BYTES
from fp4forge.errors import ConfigError, option_path, require_choice
from fp4forge.model.samples import SampleOptions
from fp4forge.quantize.act_scales import parse_act_scales
from fp4forge.quantize.recipe import Recipe, load_recipe

if TYPE_CHECKING:
    from fp4forge.quantize.act_scales import ConstantAmax, StatsAmax
    from fp4forge.quantize.export import ExportSummary, QuantizeOptions
    from fp4forge.quantize.gptq import GptqWeights

__all__ = ["METHODS", "GptqOptions", "QuantizeJob", "QuantizeResult", "run_quantize"]

Progress = Callable[[int, int, str], None] | None
Method = Literal["rtn", "gptq"]
METHODS: tuple[str, ...] = get_args(Method)
EXPERT_HESSIANS = ("routed", "all")
FALLBACKS = ("pooled", "rtn")
GPTQ_BLOCK_SCALES = ("minmax", "mse")


@dataclass(frozen=True)
class GptqOptions:
    """GPTQ's settings (docs/quantization.md#gptq) and the text its Hessians come from."""

    calibration: SampleOptions = SampleOptions()  # the text the Hessians are accumulated on
    expert_hessian: Literal["routed", "all"] = "routed"
    min_expert_tokens: int = 64
    fallback: Literal["pooled", "rtn"] = "pooled"
    act_order: bool = False
    damp: float = 0.01
    block_size: int = 128
    # E4M3 block scales fixed before the column sweep: min-max (block max -> 6) or the MSE search's
    # (numerics.scale_search), chosen on the original weight with the same global scale.
    block_scales: Literal["minmax", "mse"] = "minmax"
    # Feed each layer the outputs of the already-rounded layers before it (see the module doc).
    sequential: bool = False

    def __post_init__(self) -> None:
        require_choice(self.expert_hessian, EXPERT_HESSIANS, "expert_hessian")
        require_choice(self.block_scales, GPTQ_BLOCK_SCALES, "block_scales")
        require_choice(self.fallback, FALLBACKS, "fallback")
        if self.min_expert_tokens < 0:
            raise ConfigError(f"must be >= 0, got {self.min_expert_tokens}", option="min_expert_tokens")
        if not self.damp > 0:
            raise ConfigError(f"must be > 0, got {self.damp}", option="damp")

    def settings(self) -> dict[str, Any]:
        """The GPTQ settings as provenance records them."""
        return {
            "expert_hessian": self.expert_hessian,
            "min_expert_tokens": self.min_expert_tokens,
            "fallback": self.fallback,
            "act_order": self.act_order,
            "damp": self.damp,
            "block_size": self.block_size,
            "scale_mode": "static",
            "block_scales": self.block_scales,
            "sequential": self.sequential,
            "calibration": self.calibration.describe(),
        }


@dataclass(frozen=True)
class QuantizeJob:
    """What to quantize how. ``recipe``: a built-in name, a .toml file or a loaded ``Recipe``;
    activation amax from ``stats`` (a calibration-statistics file) or ``act_scales``
    (``"constant:AMAX"``, recorded as uncalibrated), at most one; ``method="gptq"`` rounds the
    NVFP4 Linears by GPTQ (``gptq``: its options; its block scales are ``block_scales``)."""

    recipe: str | Path | Recipe
    layout_format: str = "compressed-tensors"
    block_scales: str = "minmax"  # minmax is identical to the reference exporters
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
        self.export_options(None)  # the exporter's own checks (layout, block scales, device, threads), now
        if self.method == "gptq":  # GPTQ fixes min-max or MSE block scales before its sweep
            require_choice(self.block_scales, GPTQ_BLOCK_SCALES, "block_scales")
            object.__setattr__(self, "gptq", replace(self.gptq, block_scales=self.block_scales))
        if self.act_scales is not None:
            parse_act_scales(self.act_scales, None)  # its syntax
            if self.stats is not None:
                parse_act_scales(self.act_scales, self.stats)  # raises: one source, not both

    @property
    def recipe_spec(self) -> Recipe:
        assert isinstance(self.recipe, Recipe)
        return self.recipe

    def activations(self) -> ConstantAmax | StatsAmax | None:
        """The activation amax source (reads the statistics file)."""
        return parse_act_scales(self.act_scales, self.stats)

    def export_options(self, act_amax: ConstantAmax | StatsAmax | None, precomputed: GptqWeights | None = None) -> QuantizeOptions:
        from fp4forge.quantize.export import QuantizeOptions

        threads = {} if self.threads is None else {"workers": self.threads}
        return QuantizeOptions(recipe=self.recipe_spec, layout_format=self.layout_format, block_scales=self.block_scales,  # type: ignore[arg-type]
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
    from fp4forge.quantize.export import quantize_checkpoint
    from fp4forge.quantize.gptq import gptq_weights

    act_amax = job.activations()
    precomputed = None
    if job.method == "gptq":
        with option_path("gptq.calibration", SampleOptions):
            precomputed = gptq_weights(src, job.recipe_spec, job.gptq, progress=progress)
    export = quantize_checkpoint(src, out, job.export_options(act_amax, precomputed), progress=progress)
    return QuantizeResult(export, precomputed)
