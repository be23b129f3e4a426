"""GEMM precision microbench at a model's projection shapes (run on a GPU; see benchmarks/RESULTS.md).

    python benchmarks/bench_gemm.py --config src/fp4forge/testbed/presets/laguna-s-2.1-like.json --out gemm.json

Writes the whole report (every sample) as JSON and prints, per shape and M, the median time of
each kernel and its ratio to bf16. `fp4forge bench gemm` runs the same library function.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from fp4forge.bench.gemm import DEFAULT_M, projection_shapes, run_gemm_bench  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--m", default=",".join(map(str, DEFAULT_M)))
    ap.add_argument("--samples", type=int, default=20)
    ap.add_argument("--inner", type=int, default=10)
    args = ap.parse_args()
    config = json.loads(Path(args.config).read_text())
    report = run_gemm_bench(
        projection_shapes(config), m_values=[int(m) for m in args.m.split(",")], device=args.device,
        samples=args.samples, inner=args.inner, progress=lambda done, total, s: print(f"[{done}/{total}] {s}", file=sys.stderr, flush=True),
    )
    data = report.to_json()
    data["config"] = args.config
    Path(args.out).write_text(json.dumps(data, indent=1))
    by = {}
    for r in report.results:
        by.setdefault((r.shape, r.n, r.k, r.m), {})[r.kernel] = r
    print(f"{report.device_name}  torch {report.torch_version}")
    for (shape, n, k, m), row in by.items():
        base = row["bf16"].median_us
        cells = "  ".join(f"{kn} {r.median_us:8.1f}us x{r.median_us / base:4.2f} err {r.rel_error:.4f}" for kn, r in row.items())
        print(f"{shape:24s} {n:6d}x{k:<6d} M={m:<5d} {cells}")


if __name__ == "__main__":
    main()
