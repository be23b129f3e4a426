"""Serving benchmarks (`fp4forge bench`): TTFT, prefill and decode with their whole spread.

Layers, GuideLLM-style: load generation (``prompts``, ``runner``), measurement (``client``),
statistics (``stats``, pure functions), presentation (``analyze`` for files and plots,
``fp4forge.report.bench_tables`` for tables). ``docs/bench.md`` documents the JSON keys and
every statistical rule.
"""

from fp4forge.bench.analyze import analyze_dir, compare_dirs, compare_samples, summarize_samples
from fp4forge.bench.client import RequestResult, RequestSpec, StreamingClient
from fp4forge.bench.runner import BenchAborted, BenchConfig, LoadPoint, Shape, load_points, load_workloads, run_bench

__all__ = [
    "BenchAborted",
    "BenchConfig",
    "LoadPoint",
    "RequestResult",
    "RequestSpec",
    "Shape",
    "StreamingClient",
    "analyze_dir",
    "compare_dirs",
    "compare_samples",
    "load_points",
    "load_workloads",
    "run_bench",
    "summarize_samples",
]
