"""Where activation (input) amax values come from: calibration statistics, or an explicit
constant the user asked for. There is no silent default: W4A4 and static FP8 need one of
them, and the choice is recorded in the provenance (the audit flags constants).

The statistics file's format (written by `fp4forge calibrate`) is ``checkpoint/stats.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from fp4forge.checkpoint.stats import CalibrationStats, read_stats
from fp4forge.errors import ConfigError


@dataclass(frozen=True)
class ConstantAmax:
    value: float

    def input_amax(self, module: str) -> float:
        return self.value

    def kv_amax(self, layer_prefix: str) -> tuple[float, float]:
        return self.value, self.value

    def provenance(self) -> dict:
        return {"source": "constant", "amax": self.value, "note": "explicit constant, not calibrated"}


class StatsAmax:
    """Activation and KV amax from a calibration-statistics file."""

    def __init__(self, path: str | Path):
        self.stats: CalibrationStats = read_stats(path)
        self.path = self.stats.path
        self.metadata = self.stats.metadata

    def input_amax(self, module: str) -> float:
        return self.stats.input_amax(module)

    def kv_amax(self, layer_prefix: str) -> tuple[float, float]:
        return self.stats.kv_amax(layer_prefix)

    def provenance(self) -> dict:
        return {"source": "calibration", "file": self.path.name, "metadata": self.metadata}


def parse_act_scales(option: str | None, stats: str | Path | None):
    """A statistics file or ``constant:AMAX`` (at most one of the two)."""
    if stats is not None and option is not None:
        raise ConfigError("give either calibration statistics or a constant activation amax, not both", option="act_scales")
    if stats is not None:
        return StatsAmax(stats)
    if option is None:
        return None
    kind, _, value = option.partition(":")
    try:
        amax = float(value)
    except ValueError:
        amax = float("nan")
    if kind != "constant" or not amax > 0 or amax == float("inf"):
        raise ConfigError(f"the activation amax must be constant:AMAX with a finite AMAX > 0, got {option!r}", option="act_scales")
    return ConstantAmax(amax)
