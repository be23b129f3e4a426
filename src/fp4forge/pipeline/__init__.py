"""`fp4forge pipeline`: calibrate → quantize → KV check → audit → bytes → fidelity → (serve →
bench) → card, each step's artifact under ``OUT/reports/``, resumable by content hash."""

from fp4forge.pipeline.run import PipelineFailed, StepEvent, run_pipeline
from fp4forge.pipeline.steps import STEPS, PipelineOptions

__all__ = ["STEPS", "PipelineFailed", "PipelineOptions", "StepEvent", "run_pipeline"]
