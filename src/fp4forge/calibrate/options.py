"""The calibration job's options: light to import (the command line reads its defaults here)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from fp4forge.errors import require_choice
from fp4forge.model.samples import SampleOptions

Policy = Literal["routed", "all-experts"]  # the MoE coverage the observers offer
POLICIES: tuple[str, ...] = get_args(Policy)


@dataclass(frozen=True)
class CalibrationOptions(SampleOptions):
    """The calibration samples (:class:`SampleOptions`), and which experts the observers cover."""

    policy: Policy = "routed"
    prefetch: bool = True  # read the next layer on a background thread (same results)
    # On a CPU, the bf16 matmuls on ATen's own kernels instead of oneDNN's and MKL's float32 ones on
    # one MKL branch (MKL_CBWR=COMPATIBLE): both round differently on AVX2, AVX-512 and AMX, so a few statistics (and the
    # export's scales) would differ between machines (docs/quantization.md#the-same-bytes-on-every-cpu).
    # The testbed's calibration took 3x the time on a CPU (0.7 -> 2.1 s); no effect on a GPU.
    portable: bool = False

    def __post_init__(self) -> None:
        require_choice(self.policy, POLICIES, "policy")
        super().__post_init__()
