"""Testbed: tiny random MoE models (Laguna, Qwen3-MoE), shape-true synthetic checkpoints, and
header-only rebuilds of real releases from their metadata (corpus). The tiny Laguna trained from
scratch is research and lives in the lab (``fp4forge.lab.trained``).

The public functions are imported lazily, so ``import fp4forge.testbed`` stays cheap (no torch or
transformers import) until one is used.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "build_tiny_laguna": "fp4forge.testbed.tiny",
    "build_tiny_qwen3_moe": "fp4forge.testbed.tiny",
    "synth_checkpoint": "fp4forge.testbed.synth",
    "count_parameters": "fp4forge.checkpoint.skeleton",
    "checkpoint_specs": "fp4forge.checkpoint.skeleton",
    "load_preset": "fp4forge.testbed.synth",
    "PRESETS": "fp4forge.testbed.synth",
    "build_tokenizer": "fp4forge.testbed.tokenizer",
    "build_header_only": "fp4forge.testbed.corpus",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
