"""Serving benchmarks (`fp4forge bench`): TTFT, prefill and decode with their whole spread.

Layers, GuideLLM-style: load generation (``prompts``, ``runner``), measurement (``client``, a
streaming timer over ``fp4forge.endpoint``), statistics (``stats``, pure functions; ``analyze``
for ``summary.json``), the job (``perf.run_perf``: run + analyse + write, what the CLI and the
pipeline call). Presentation (tables, Markdown, plots) is ``fp4forge.report``'s.
``docs/bench.md`` documents the JSON keys and every statistical rule.
"""

from fp4forge.bench.analyze import analyze_dir, compare_dirs, compare_samples, summarize_samples
from fp4forge.bench.client import RequestResult, RequestSpec, StreamingClient
from fp4forge.bench.perf import PerfOptions, PerfResult, run_perf
from fp4forge.bench.runner import BenchAborted, BenchConfig, LoadPoint, Shape, load_points, load_workloads, run_bench

__all__ = [
    "BenchAborted",
    "BenchConfig",
    "LoadPoint",
    "PerfOptions",
    "PerfResult",
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
    "run_perf",
    "summarize_samples",
]
