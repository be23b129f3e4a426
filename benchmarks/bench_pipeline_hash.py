"""What `fp4forge pipeline`'s content hashes cost on a big checkpoint, next to `sha256sum` (coreutils)
and `openssl dgst -sha256` over the same files, same run: the first (cold-cache) tree hash, then
the re-run's cached one.

The pipeline hashes SRC and OUT once per run and caches file hashes by (size, mtime, inode), so
the first number is paid once per changed checkpoint and the second on every re-run.

    .venv/bin/python benchmarks/bench_pipeline_hash.py [--layers 4] [--runs 3]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._util import OUT, drop_page_cache, run_measured, summarize  # noqa: E402
from fp4forge.pipeline.state import Hasher  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--keep", action="store_true", help="keep the synthetic checkpoint for another run")
    args = parser.parse_args()
    fp4forge = str(Path(sys.executable).parent / "fp4forge")
    ckpt = OUT / f"bench-hash-L{args.layers}"
    if not ckpt.is_dir():
        built = run_measured([fp4forge, "testbed", "synth", str(ckpt), "--config", "laguna-s-2.1-like", "--layers", str(args.layers),
                              "--max-shard-gb", "1", "--json"])
        assert built.returncode == 0, "synth failed"
    files = sorted(p for p in ckpt.iterdir() if p.is_file())
    size = sum(p.stat().st_size for p in files)
    ours, coreutils, openssl, cached = [], [], [], []
    for run in range(args.runs):
        cache = OUT / f"bench-hash-cache-{run}.json"
        cache.unlink(missing_ok=True)
        for p in files:
            drop_page_cache(p)
        start = time.perf_counter()
        hasher = Hasher(cache)
        hasher.tree(ckpt)
        ours.append(time.perf_counter() - start)
        hasher.save()
        start = time.perf_counter()
        Hasher(cache).tree(ckpt)  # a re-run: a new process reads the cache
        cached.append(time.perf_counter() - start)
        for p in files:
            drop_page_cache(p)
        start = time.perf_counter()
        subprocess.run(["sha256sum", *map(str, files)], check=True, stdout=subprocess.DEVNULL)
        coreutils.append(time.perf_counter() - start)
        for p in files:
            drop_page_cache(p)
        start = time.perf_counter()
        subprocess.run(["openssl", "dgst", "-sha256", *map(str, files)], check=True, stdout=subprocess.DEVNULL)
        openssl.append(time.perf_counter() - start)
    print(f"checkpoint: {ckpt.name}, {len(files)} files, {size / 1e9:.2f} GB")
    print(f"fp4forge tree hash, cold cache: {summarize(ours)} s = {size / 1e9 / min(ours):.2f} GB/s at best")
    print(f"sha256sum, cold cache:          {summarize(coreutils)} s = {size / 1e9 / min(coreutils):.2f} GB/s at best")
    print(f"openssl dgst -sha256, cold cache: {summarize(openssl)} s = {size / 1e9 / min(openssl):.2f} GB/s at best")
    median = statistics.median
    print(f"ratio fp4forge / sha256sum (median): {median(ours) / median(coreutils):.2f}; "
          f"fp4forge / openssl: {median(ours) / median(openssl):.2f}")
    print(f"re-run with the stat cache:     {summarize(cached)} s")
    if not args.keep:
        shutil.rmtree(ckpt)


if __name__ == "__main__":
    main()
