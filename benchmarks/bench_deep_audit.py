"""`audit --deep` against the export it checks and the disk it reads, side by side in one run.

On one checkpoint (an existing BF16 directory, or a shape-true synthetic one `fp4forge testbed
synth` writes here), each step in its own process through the command line, as a user runs it:

1. **export**: `fp4forge quantize SRC OUT` from evicted source shards (cold), its wall time;
2. **disk**: OUT's shards evicted from the page cache (`posix_fadvise DONTNEED`) and read
   sequentially (cold), then again (warm, from the page cache);
3. **audit --deep**: from evicted shards (cold), then warm; and the headers-only audit of the
   same checkpoint (the part of the wall time that is not reading values).

Printed: each step's seconds and GB/s of OUT's bytes, the deep audit's rate against the cold
and the warm read and its wall time against the export's (goal: >= 1.0 GB/s on a GPU node and
never slower than the export), and each process's peak RSS: VmHWM, and the sampled peaks of
anonymous memory and of file-backed pages (mapped shards; page cache, not the process's own).

    .venv/bin/python benchmarks/bench_deep_audit.py --config laguna-s-2.1-like --layers 3 --device cuda
    .venv/bin/python benchmarks/bench_deep_audit.py --source DIR [--recipe nvfp4-experts] [--device cpu]
        [--set num_experts=32 --set vocab_size=32000] [--work DIR] [--out DIR] [--runs 3]

Results go to ``$OUT/bench_deep_audit.json`` (``--out``; default ``$OUT`` or benchmarks/out).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._util import OUT, REPO, drop_page_cache, run_sampled  # noqa: E402

CLI = [sys.executable, "-m", "fp4forge.cli"]


def env() -> dict[str, str]:
    paths = [str(REPO / "src"), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}


def shards(path: Path) -> list[Path]:
    return sorted(path.glob("*.safetensors"))


def evict(path: Path) -> bool:
    """Flush and evict every shard of ``path`` from the page cache (a cold read follows)."""
    os.sync()
    return all(drop_page_cache(p) for p in shards(path))


def read_all(path: Path, block: int = 64 << 20) -> tuple[int, float]:
    total, start, buffer = 0, time.perf_counter(), bytearray(block)
    for file in shards(path):
        with open(file, "rb", buffering=0) as f:
            while n := f.readinto(buffer):
                total += n
    return total, time.perf_counter() - start


def run_step(name: str, argv: list[str]) -> dict:
    run = run_sampled(CLI + argv, env=env())
    if run.returncode not in (0, 1):  # audit exits 1 on error findings: still a measured run
        raise SystemExit(f"{name} failed ({run.returncode}): {run.stderr.decode(errors='replace')[-2000:]}")
    print(f"  {name}: {run.wall_s:.2f} s, peak RSS {run.peak_rss_mib:,.0f} MiB (anon {run.peak_anon_mib:,.0f}, file {run.peak_file_mib:,.0f})", flush=True)
    return {"wall_s": run.wall_s, "returncode": run.returncode, "peak_rss_mib": run.peak_rss_mib, "peak_anon_mib": run.peak_anon_mib, "peak_file_mib": run.peak_file_mib}


def source_dir(args: argparse.Namespace) -> Path:
    """``--source``, or a synthetic checkpoint of ``--config`` (with ``--set`` overrides) built once."""
    if args.source:
        return args.source
    config = args.config
    suffix = "".join(f"-{s.replace('=', '')}" for s in args.set)
    src = args.work / f"synth-{Path(config).stem}{suffix}-L{args.layers}"
    if args.set:
        from fp4forge.testbed.synth import resolve_config_source

        doc, _ = resolve_config_source(config)
        for item in args.set:
            key, _, value = item.partition("=")
            doc[key] = json.loads(value)
        config = str(args.work / f"config{suffix}.json")
        args.work.mkdir(parents=True, exist_ok=True)
        Path(config).write_text(json.dumps(doc, indent=2))
    if not (src / "config.json").exists():
        print(f"synth {src.name} ...", flush=True)
        run_step("synth", ["testbed", "synth", str(src), "--config", config, "--layers", str(args.layers), "--seed", "0"])
    return src


def measure(args: argparse.Namespace, src: Path) -> dict:
    out = args.work / f"{src.name}-{args.recipe}-{args.format}"
    runs: dict[str, list] = {"export": [], "cold_read": [], "warm_read": [], "deep_cold": [], "deep_warm": [], "headers_only": []}
    device = ["--device", args.device]
    for i in range(args.runs):
        print(f"run {i + 1}/{args.runs}", flush=True)
        if out.exists():
            import shutil

            shutil.rmtree(out)
        evict(src)
        runs["export"].append(run_step("export (cold source)", ["quantize", str(src), str(out), "--recipe", args.recipe, "--format", args.format, "--act-scales", "constant:8", *device, "--json"]))
        evict(out)
        nbytes, cold = read_all(out)
        _, warm = read_all(out)
        runs["cold_read"].append({"wall_s": cold})
        runs["warm_read"].append({"wall_s": warm})
        print(f"  read: cold {cold:.2f} s, warm {warm:.2f} s ({nbytes / 1e9:.2f} GB)", flush=True)
        evict(out)
        runs["deep_cold"].append(run_step("audit --deep (cold)", ["audit", str(out), "--deep", "--json", *device]))
        runs["deep_warm"].append(run_step("audit --deep (warm)", ["audit", str(out), "--deep", "--json", *device]))
        runs["headers_only"].append(run_step("audit (headers only)", ["audit", str(out), "--json"]))
    return {"export_bytes": nbytes, "source_bytes": sum(p.stat().st_size for p in shards(src)), "runs": runs}


def summary(doc: dict) -> dict:
    gb = doc["export_bytes"] / 1e9
    median = {step: statistics.median(r["wall_s"] for r in runs) for step, runs in doc["runs"].items()}
    rate = {step: gb / s for step, s in median.items()}
    return {
        "median_s": median,
        "gb_per_s_of_checkpoint": rate,
        "deep_cold_vs_cold_read": rate["deep_cold"] / rate["cold_read"],
        "deep_warm_vs_warm_read": rate["deep_warm"] / rate["warm_read"],
        "export_s_over_deep_cold_s": median["export"] / median["deep_cold"],
        "peak_rss_mib": {step: max(r.get("peak_rss_mib", 0) for r in runs) for step, runs in doc["runs"].items() if "peak_rss_mib" in runs[0]},
    }


def print_table(doc: dict, s: dict) -> None:
    print(f"\ncheckpoint {doc['export_bytes'] / 1e9:.3f} GB ({doc['recipe']}, {doc['format']}), source {doc['source_bytes'] / 1e9:.3f} GB, device {doc['device']}")
    print(f"{'step':<24}{'median s':>10}{'GB/s':>9}{'peak RSS MiB':>14}")
    for step, seconds in s["median_s"].items():
        rss = s["peak_rss_mib"].get(step)
        print(f"{step:<24}{seconds:>10.2f}{s['gb_per_s_of_checkpoint'][step]:>9.3f}{'' if rss is None else f'{rss:>14,.0f}'}")
    print(f"deep audit (cold) / cold read: {s['deep_cold_vs_cold_read']:.2f}   deep (warm) / warm read: {s['deep_warm_vs_warm_read']:.2f}")
    print(f"export time / deep audit time (cold): {s['export_s_over_deep_cold_s']:.2f}  (>= 1: the audit is not slower than the export)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", type=Path, help="an existing BF16 checkpoint directory")
    parser.add_argument("--config", default="laguna-s-2.1-like", help="testbed synth preset or config.json (without --source)")
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=JSON", help="override a config key of the synthetic source")
    parser.add_argument("--recipe", default="nvfp4-experts")
    parser.add_argument("--format", default="compressed-tensors")
    parser.add_argument("--device", default="auto", help="export and audit device: auto | cpu | cuda")
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--work", type=Path, default=OUT / "deep-audit")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", OUT)))
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    src = source_dir(args)
    doc = {"recipe": args.recipe, "format": args.format, "device": args.device, "source": str(src), **measure(args, src)}
    doc["summary"] = s = summary(doc)
    doc["machine"] = {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(), "date": time.strftime("%Y-%m-%d")}
    print_table(doc, s)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_deep_audit.json").write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
