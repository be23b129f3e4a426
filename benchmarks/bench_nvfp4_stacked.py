"""CPU time per element of NVFP4 minmax quantization, one Linear at a time (``search_nvfp4``, the
exporter's per-unit path) against one stacked pass over the same weights
(``nvfp4_quantize_stacked``, the GPU exporter's path), with and without the error sums, on one
torch thread (best of 3, ``time.process_time``).

    .venv/bin/python benchmarks/bench_nvfp4_stacked.py [--experts 8] [--out 1024] [--in 3072]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

import torch  # noqa: E402

from fp4forge.numerics.nvfp4 import nvfp4_quantize_stacked  # noqa: E402
from fp4forge.numerics.scale_search import search_nvfp4  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--out", type=int, default=1024)
    parser.add_argument("--in", dest="in_features", type=int, default=3072)
    args = parser.parse_args()
    torch.set_num_threads(1)
    w = (torch.randn(args.experts, args.out, args.in_features, generator=torch.Generator().manual_seed(0)) * 0.02).to(torch.bfloat16)

    def ns_per_element(fn) -> float:
        best = float("inf")
        for _ in range(3):
            start = time.process_time()
            fn()
            best = min(best, time.process_time() - start)
        return best / w.numel() * 1e9

    rows = [
        ("one Linear at a time, error sums", lambda: [search_nvfp4(w[i]) for i in range(len(w))]),
        ("one Linear at a time, no error sums", lambda: [search_nvfp4(w[i], error=False) for i in range(len(w))]),
        ("stacked, error sums", lambda: nvfp4_quantize_stacked(w, error=True)),
        ("stacked, no error sums", lambda: nvfp4_quantize_stacked(w, error=False)),
    ]
    print(f"| [{args.experts}, {args.out}, {args.in_features}] bf16, 1 thread | CPU ns per element |")
    print("|---|---|")
    for label, fn in rows:
        print(f"| {label} | {ns_per_element(fn):.2f} |")


if __name__ == "__main__":
    main()
