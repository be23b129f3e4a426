"""CPU time per element of NVFP4 minmax quantization, one Linear at a time (``search_nvfp4``, the
exporter's per-unit path) by the fused C element kernel and by the eager torch path
(``FP4FORGE_KERNEL=eager``), both conventions, against one stacked pass over the same weights
(``nvfp4_quantize_stacked``, the GPU exporter's path), with and without the error sums, on one
torch thread (best of 3, ``time.process_time``); then the kernel on 2 Python threads (wall ns per
element: ctypes releases the GIL).

    .venv/bin/python benchmarks/bench_nvfp4_stacked.py [--experts 8] [--out 1024] [--in 3072]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

import torch  # noqa: E402

from fp4forge.numerics import nvfp4_kernel  # noqa: E402
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

    def per_linear(**kw):
        return lambda: [search_nvfp4(w[i], **kw) for i in range(len(w))]

    def eager(fn):
        def run():
            os.environ[nvfp4_kernel.ENV_SWITCH] = "eager"
            nvfp4_kernel.reset()
            try:
                fn()
            finally:
                del os.environ[nvfp4_kernel.ENV_SWITCH]
                nvfp4_kernel.reset()
        return run

    print(f"element kernel: {nvfp4_kernel.kernel_status()}")
    rows = []
    for conv in ("compressed-tensors", "modelopt"):
        for err in (True, False):
            what = f"{conv}, {'error sums' if err else 'no error sums'}"
            rows.append((f"one Linear at a time, kernel, {what}", per_linear(convention=conv, error=err)))
            rows.append((f"one Linear at a time, eager, {what}", eager(per_linear(convention=conv, error=err))))
    rows += [
        ("stacked (eager), error sums", lambda: nvfp4_quantize_stacked(w, error=True)),
        ("stacked (eager), no error sums", lambda: nvfp4_quantize_stacked(w, error=False)),
    ]
    print(f"| [{args.experts}, {args.out}, {args.in_features}] bf16, 1 thread | CPU ns per element |")
    print("|---|---|")
    for label, fn in rows:
        print(f"| {label} | {ns_per_element(fn):.2f} |")
    with ThreadPoolExecutor(2) as pool:
        best_wall = best_cpu = float("inf")
        for _ in range(3):
            start, cpu = time.perf_counter(), time.process_time()
            list(pool.map(lambda i: search_nvfp4(w[i]), range(len(w))))
            best_wall = min(best_wall, time.perf_counter() - start)
            best_cpu = min(best_cpu, time.process_time() - cpu)
    print(f"| one Linear at a time, kernel, CT, error sums, 2 Python threads | {best_cpu / w.numel() * 1e9:.2f} CPU, {best_wall / w.numel() * 1e9:.2f} wall |")


if __name__ == "__main__":
    main()
