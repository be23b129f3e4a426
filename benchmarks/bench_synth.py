"""`fp4forge testbed synth` write throughput against a plain `dd` write of the same size, same
run: the synthetic checkpoint's GB/s (seeded Student-t values generated chunk by chunk, written
shard by shard) next to what the disk takes from /dev/zero, with both flushed to disk.

    .venv/bin/python benchmarks/bench_synth.py [--layers 1] [--runs 2]
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._util import OUT, run_measured, summarize  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--runs", type=int, default=2)
    args = parser.parse_args()
    fp4forge = str(Path(sys.executable).parent / "fp4forge")
    synth_rates, dd_rates, rss = [], [], []
    for run in range(args.runs):
        out = OUT / f"bench-synth-L{args.layers}-{run}"
        shutil.rmtree(out, ignore_errors=True)
        stats = run_measured(["sync"])  # start each pair from a flushed page cache
        stats = run_measured([fp4forge, "testbed", "synth", str(out), "--config", "laguna-s-2.1-like", "--layers", str(args.layers), "--json"])
        assert stats.returncode == 0, "synth failed"
        size = sum(p.stat().st_size for p in out.glob("*.safetensors"))
        synth_rates.append(size / 1e9 / stats.wall_s)
        rss.append(stats.peak_rss_mib)
        shutil.rmtree(out)
        target = OUT / "bench-dd.bin"
        block = 16 * 2**20
        dd = run_measured(["dd", "if=/dev/zero", f"of={target}", f"bs={block}", f"count={-(-size // block)}", "conv=fdatasync", "status=none"])
        assert dd.returncode == 0, "dd failed"
        dd_rates.append(size / 1e9 / dd.wall_s)
        target.unlink()
        print(f"run {run}: {size / 1e9:.2f} GB  synth {synth_rates[-1]:.3f} GB/s (peak RSS {rss[-1]:.0f} MiB)  dd {dd_rates[-1]:.3f} GB/s", flush=True)
    print(f"synth GB/s {summarize(synth_rates)}")
    print(f"dd    GB/s {summarize(dd_rates)}")
    print(f"synth / dd = {sorted(synth_rates)[len(synth_rates) // 2] / sorted(dd_rates)[len(dd_rates) // 2]:.3f}")


if __name__ == "__main__":
    main()
