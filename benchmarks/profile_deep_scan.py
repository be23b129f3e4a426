"""Where `audit --deep` spends its time: the fixed costs (torch's import, CUDA's start) against
the scan of the values itself, in one process on an existing export (page cache warm after the
first scan). A profile, not the benchmark: `bench_deep_audit.py` times the command end to end.

    python3 benchmarks/profile_deep_scan.py EXPORT_DIR [--device cuda]

Per path (``device``: the GPU's ring of pinned buffers; ``threads``: the CPU's pool) and reader
thread count: wall and CPU seconds, GB/s of the bytes the scan reads, the seconds the readers spent
reading and reducing (each summed over the threads that did it: one reducing thread on the device
path, the pool on the threads path); then the top of a cProfile of
one device-path scan.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


def _timed(acc: dict, key: str, fn, lock: threading.Lock):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            with lock:
                acc[key] += time.perf_counter() - start
    return wrapper


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("export", type=Path)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    start = time.perf_counter()
    import torch

    print(f"import torch: {time.perf_counter() - start:.2f} s")
    if args.device == "cuda":
        start = time.perf_counter()
        torch.zeros(1, device="cuda")
        print(f"CUDA start: {time.perf_counter() - start:.2f} s")
    from fp4forge.audit import deep_scan
    from fp4forge.audit.context import AuditContext
    from fp4forge.checkpoint.declarations import read_declaration
    from fp4forge.checkpoint.layout import layout_or_inferred
    from fp4forge.checkpoint.reader import open_checkpoint_lenient

    start = time.perf_counter()
    ckpt, _ = open_checkpoint_lenient(str(args.export))
    ctx = AuditContext(ckpt=ckpt, layout=layout_or_inferred(ckpt.config), declaration=read_declaration(ckpt.config, ckpt.extra_json),
                       deep=True, fmt="auto", vllm_version=(0, 32), device=args.device)
    units = deep_scan.plan_units(ctx)
    print(f"open + plan: {time.perf_counter() - start:.2f} s; {len(units)} units, {sum(len(u.pieces) for u in units)} pieces, "
          f"{len(deep_scan.plan_jobs(units))} jobs")
    total = sum(p.length for u in units for piece in u.pieces for p in piece) / 1e9
    acc, lock = {"read": 0.0, "reduce": 0.0}, threading.Lock()
    read_job, reduce_rows = deep_scan._read_job, deep_scan.reduce_rows
    deep_scan._read_job, deep_scan.reduce_rows = _timed(acc, "read", read_job, lock), _timed(acc, "reduce", reduce_rows, lock)
    paths = [("device", None), ("device", None), ("device", 4)] if args.device == "cuda" else []
    for path, threads in [*paths, ("threads", None), ("threads", 4), ("threads", 8)]:
        acc.update(read=0.0, reduce=0.0)
        start, cpu = time.perf_counter(), time.process_time()
        deep_scan.scan_units(ckpt, units, args.device, path=path, threads=threads)
        wall = time.perf_counter() - start
        print(f"{path} threads={threads}: {wall:.2f} s, {time.process_time() - cpu:.2f} CPU-s, {total / wall:.2f} GB/s; "
              f"read {acc['read']:.2f} s, reduce {acc['reduce']:.2f} s (each summed over threads)", flush=True)
    deep_scan._read_job, deep_scan.reduce_rows = read_job, reduce_rows
    profile = cProfile.Profile()
    profile.enable()
    deep_scan.scan_units(ckpt, units, args.device, path="device" if args.device == "cuda" else "threads")
    profile.disable()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(18)
    print(text.getvalue()[-3500:])


if __name__ == "__main__":
    main()
