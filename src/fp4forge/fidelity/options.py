"""The fidelity job's options: light to import (the command line reads its defaults here)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from fp4forge.errors import ConfigError, require_choice
from fp4forge.model.samples import SampleOptions

NUMERICS = ("w4a4", "w4a16")
MOE_INPUT_SCALES = ("global-max", "per-expert")


@dataclass(frozen=True)
class FidelityOptions(SampleOptions):
    """The held-out samples (:class:`SampleOptions`, fewer and shorter by default than
    calibration's) and how the student is run and measured; checked when made."""

    samples: int = 16
    seq_len: int = 256
    numerics: str = "w4a4"
    teacher_cache: Path | None = None
    top_k: int = 32
    tail_samples: int = 32
    seed: int = 0
    moe_input_scale: str = "global-max"
    # Accept a student that declares no quantization: a BF16 checkpoint whose weights were
    # replaced by a format's round trip (the study's fake-quantized arms), run as stored.
    dense_student: bool = False
    # Score text the teacher cannot read (perplexity at or above the stated share of the
    # vocabulary size) with a loud warning in the report instead of refusing (UnreadableTextError).
    allow_unreadable: bool = False

    def __post_init__(self) -> None:
        require_choice(self.numerics, NUMERICS, "numerics")
        require_choice(self.moe_input_scale, MOE_INPUT_SCALES, "moe_input_scale")
        for option in ("top_k", "tail_samples"):
            if getattr(self, option) < 1:
                raise ConfigError(f"must be at least 1, got {getattr(self, option)}", option=option)
        super().__post_init__()
