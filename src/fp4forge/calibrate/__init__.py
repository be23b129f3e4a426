"""fp4forge.calibrate: statistics from data, and what is built from them.

- :mod:`.run` — the calibration run (``calibrate_checkpoint``, ``calibrate_to_file``,
  ``CalibrationOptions``), layer-streamed;
- :mod:`.kv` — FP8 KV-cache scales: calibrate into a checkpoint, transplant, show;
- :mod:`.fidelity` — a quantized student scored against its BF16 teacher.

The run's names are also reachable here (``from fp4forge.calibrate import calibrate_checkpoint``),
imported on first use so that ``import fp4forge.calibrate.kv`` alone does not start a run's imports.
"""

from __future__ import annotations

from typing import Any

_RUN_NAMES = ("POLICIES", "CalibrationOptions", "CalibrationResult", "calibrate_checkpoint", "calibrate_in_memory",
              "calibrate_to_file", "calibration_samples")


def __getattr__(name: str) -> Any:
    if name in _RUN_NAMES:
        from fp4forge.calibrate import run

        return getattr(run, name)
    raise AttributeError(f"module 'fp4forge.calibrate' has no attribute {name!r}")
