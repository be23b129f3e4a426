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

    def __post_init__(self) -> None:
        require_choice(self.policy, POLICIES, "policy")
        super().__post_init__()
