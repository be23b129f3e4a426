"""What `fp4forge pipeline`'s content hashes cost on a multi-shard checkpoint, same run, medians:

- the tree hash (`Hasher.tree`) on one thread against one thread per file (bounded by the cores),
  with the page cache dropped before each (a source read for the first time) and with the files in
  the page cache (an export hashed right after it was written);
- `sha256sum` (coreutils) and `openssl dgst -sha256` over the same files, cold;
- the re-run's cached tree hash (a new process reads the stat cache);
- a step key hashed before its step against beside it: a stand-in step that reads every shard
  once (as calibration streams the source), the cache dropped first; after the hash (its reads
  then warm, or cold again as for a source larger than memory) or with the hash on a thread beside it.

The pipeline hashes SRC and OUT once per run and caches file hashes by (size, mtime, inode), so
the cold figures are paid once per changed checkpoint and the cached one on every re-run.

    .venv/bin/python benchmarks/bench_pipeline_hash.py [--layers 1] [--max-shard-gb 0.125] [--runs 5]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._util import OUT, drop_page_cache, run_measured, summarize  # noqa: E402
from fp4forge.bench.host import usable_cores  # noqa: E402
from fp4forge.pipeline.state import Hasher  # noqa: E402

READ_BYTES = 16 << 20  # the stand-in step's reads


def read_all(files: list[Path]) -> None:
    """The stand-in step: every shard read once, in order, as a layer-streamed step reads the source."""
    buffer = bytearray(READ_BYTES)
    for path in files:
        with open(path, "rb", buffering=0) as handle:
            while handle.readinto(buffer):
                pass


def drop_all(files: list[Path]) -> None:
    for p in files:
        drop_page_cache(p)


def timed(files: list[Path], work: Callable[[], object], cold: bool = True) -> float:
    if cold:
        drop_all(files)
    start = time.perf_counter()
    work()
    return time.perf_counter() - start


def key_beside_step(ckpt: Path, files: list[Path]) -> None:
    key = threading.Thread(target=lambda: Hasher(None).tree(ckpt))
    key.start()
    read_all(files)
    key.join()


def measure(ckpt: Path, files: list[Path], runs: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {}

    def add(name: str, seconds: float) -> None:
        times.setdefault(name, []).append(seconds)

    for run in range(runs):
        add("cold, 1 thread", timed(files, lambda: Hasher(None, threads=1).tree(ckpt)))
        add("cold, parallel", timed(files, lambda: Hasher(None).tree(ckpt)))
        add("warm, 1 thread", timed(files, lambda: Hasher(None, threads=1).tree(ckpt), cold=False))
        add("warm, parallel", timed(files, lambda: Hasher(None).tree(ckpt), cold=False))
        add("sha256sum, cold", timed(files, lambda: subprocess.run(["sha256sum", *map(str, files)], check=True, stdout=subprocess.DEVNULL)))
        add("openssl, cold", timed(files, lambda: subprocess.run(["openssl", "dgst", "-sha256", *map(str, files)], check=True,
                                                                    stdout=subprocess.DEVNULL)))
        cache = OUT / f"bench-hash-cache-{run}.json"
        cache.unlink(missing_ok=True)
        hasher = Hasher(cache)
        hasher.tree(ckpt)
        hasher.save()
        add("re-run, stat cache", timed(files, lambda: Hasher(cache).tree(ckpt), cold=False))  # a new process reads the cache
        cache.unlink()
        # The step after the key: reading what the key left in the page cache (a source that fits in
        # memory), or cold again (one that does not: the hash's pages are gone when the step reads).
        add("key, then step (warm)", timed(files, lambda: (Hasher(None).tree(ckpt), read_all(files))))
        add("key, then step (cold)", timed(files, lambda: (Hasher(None).tree(ckpt), drop_all(files), read_all(files))))
        add("key beside step, cold", timed(files, lambda: key_beside_step(ckpt, files)))
        add("step alone, cold", timed(files, lambda: read_all(files)))
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--max-shard-gb", type=float, default=0.125)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--keep", action="store_true", help="keep the synthetic checkpoint for another run")
    args = parser.parse_args()
    fp4forge = str(Path(sys.executable).parent / "fp4forge")
    ckpt = OUT / f"bench-hash-L{args.layers}-{args.max_shard_gb:g}"
    if not ckpt.is_dir():
        built = run_measured([fp4forge, "testbed", "synth", str(ckpt), "--config", "laguna-s-2.1-like", "--layers", str(args.layers),
                              "--max-shard-gb", str(args.max_shard_gb), "--json"])
        assert built.returncode == 0, "synth failed"
    files = sorted(p for p in ckpt.rglob("*") if p.is_file())
    size = sum(p.stat().st_size for p in files) / 1e9
    times = measure(ckpt, files, args.runs)
    print(f"checkpoint: {ckpt.name}, {len(files)} files, {size:.2f} GB; {usable_cores()} usable cores")
    for name, values in times.items():
        print(f"{name:<25} {summarize(values)} s = {size / statistics.median(values):.2f} GB/s (median)")
    median = {name: statistics.median(values) for name, values in times.items()}
    print(f"ratio 1 thread / parallel: cold {median['cold, 1 thread'] / median['cold, parallel']:.2f}, "
          f"warm {median['warm, 1 thread'] / median['warm, parallel']:.2f}")
    print(f"ratio parallel / openssl (cold): {median['cold, parallel'] / median['openssl, cold']:.2f}; "
          f"parallel / sha256sum: {median['cold, parallel'] / median['sha256sum, cold']:.2f}")
    beside = median["key beside step, cold"]
    print(f"ratio key then step / key beside step: {median['key, then step (warm)'] / beside:.2f} (step warm), "
          f"{median['key, then step (cold)'] / beside:.2f} (step cold); key beside step / step alone: {beside / median['step alone, cold']:.2f}")
    if not args.keep:
        shutil.rmtree(ckpt)


if __name__ == "__main__":
    main()
