"""`audit --deep` against the export it checks and the disk it reads, side by side in one run.

On one checkpoint (an existing BF16 directory, or a shape-true synthetic one `fp4forge testbed
synth` writes here), each step in its own process through the command line, as a user runs it:

1. **export**: `fp4forge quantize SRC OUT` from evicted source shards (cold), its wall time;
2. **disk**: OUT's shards evicted from the page cache (`posix_fadvise DONTNEED`) and read
   sequentially (cold), then again (warm, from the page cache);
3. **audit --deep**: from evicted shards (cold), then warm; and the headers-only audit of the
   same checkpoint (the part of the wall time that is not reading values).

``--pipeline`` then runs `fp4forge pipeline` (no serving) on the same source and sets its peak
RSS against two decoder layers + the activation budget + ``RSS_CONSTANT_GIB``.

Printed: each step's seconds and GB/s of OUT's bytes, the deep audit's rate against the cold
and the warm read and its wall time against the export's (goal: >= 1.0 GB/s on a GPU node and
never slower than the export), and each process's peak RSS: VmHWM, and the sampled peaks of
anonymous memory and of file-backed pages (mapped shards; page cache, not the process's own).

    .venv/bin/python benchmarks/bench_deep_audit.py --gpu-synth --layers 3 --device cuda --audit-devices cuda,cpu --pipeline
    .venv/bin/python benchmarks/bench_deep_audit.py --source DIR [--recipe nvfp4-experts] [--device cpu]
        [--set num_experts=32 --set vocab_size=32000] [--work DIR] [--out DIR] [--runs 3]

Results go to ``$OUT/bench_deep_audit.json`` (``--out``; default ``$OUT`` or benchmarks/out).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._util import OUT, REPO, evict, read_all, run_sampled, shards  # noqa: E402

CLI = [sys.executable, "-m", "fp4forge.cli"]
#: What the pipeline holds besides two layers and the activation budget: the torch / CUDA runtime,
#: the exporter's batches and read-ahead, the deep audit's read-ahead (256 MiB), Python's objects.
RSS_CONSTANT_GIB = 3.0


def env() -> dict[str, str]:
    paths = [str(REPO / "src"), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}


def _peaks_by_step(samples: list, wall_s: float, steps: list[dict]) -> dict[str, float]:
    """Peak anonymous RSS per pipeline step, placing the steps back to back so that the last ends
    with the process (the manifest keeps each step's seconds, not its start): approximate by the
    process start-up and the time between steps."""
    timed = [(step["name"], step["seconds"]) for step in steps if step.get("seconds")]
    at = wall_s - sum(seconds for _, seconds in timed)
    peaks = {"start-up": max((a for t, a, _ in samples if t < at), default=0.0)}
    for name, seconds in timed:
        peaks[name] = max((a for t, a, _ in samples if at <= t < at + seconds), default=0.0)
        at += seconds
    return peaks


def run_step(name: str, argv: list[str], keep_samples: bool = False) -> dict:
    run = run_sampled(CLI + argv, env=env())
    # audit exits 1 on error findings, still a measured run; but an uncaught exception exits 1 too,
    # so with --json a run that printed no report failed
    if run.returncode not in (0, 1) or ("--json" in argv and not run.stdout.lstrip().startswith((b"{", b"["))):
        raise SystemExit(f"{name} failed ({run.returncode}): {run.stderr.decode(errors='replace')[-2000:]}")
    print(f"  {name}: {run.wall_s:.2f} s ({run.cpu_s:.2f} CPU-s), peak RSS {run.peak_rss_mib:,.0f} MiB (anon {run.peak_anon_mib:,.0f}, file {run.peak_file_mib:,.0f})", flush=True)
    kept = {"samples": run.samples} if keep_samples else {}
    return {**kept, "wall_s": run.wall_s, "cpu_s": run.cpu_s, "returncode": run.returncode, "peak_rss_mib": run.peak_rss_mib, "peak_anon_mib": run.peak_anon_mib, "peak_file_mib": run.peak_file_mib,
            "stdout_sha256": hashlib.sha256(run.stdout).hexdigest()}


def source_dir(args: argparse.Namespace) -> Path:
    """``--source``, or a synthetic checkpoint of ``--config`` (with ``--set`` overrides) built once
    (``--gpu-synth``: the preset's values drawn on the GPU, as benchmarks/bench_gpu.py does)."""
    if args.source:
        return args.source
    if args.gpu_synth:
        from benchmarks.bench_gpu import build_model

        return build_model(args.work, args.layers, tiny=False)[0]
    config = args.config
    suffix = "".join(f"-{s.replace('=', '')}" for s in args.set)
    src = args.work / f"synth-{Path(config).name.removesuffix('.json')}{suffix}-L{args.layers}"
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
    audit_devices = args.audit_devices.split(",") if args.audit_devices else [args.device]
    runs: dict[str, list] = {"export": [], "cold_read": [], "warm_read": [], "headers_only": []}
    runs.update({f"deep_{how}_{where}": [] for where in audit_devices for how in ("cold", "warm")})
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
        runs["cold_read"].append({"wall_s": cold})  # this process's own reads: no CPU time of its own
        runs["warm_read"].append({"wall_s": warm})
        print(f"  read: cold {cold:.2f} s, warm {warm:.2f} s ({nbytes / 1e9:.2f} GB)", flush=True)
        for where in audit_devices:
            evict(out)
            runs[f"deep_cold_{where}"].append(run_step(f"audit --deep --device {where} (cold)", ["audit", str(out), "--deep", "--json", "--device", where]))
            runs[f"deep_warm_{where}"].append(run_step(f"audit --deep --device {where} (warm)", ["audit", str(out), "--deep", "--json", "--device", where]))
        runs["headers_only"].append(run_step("audit (headers only)", ["audit", str(out), "--json"]))
    return {"export_bytes": nbytes, "source_bytes": sum(p.stat().st_size for p in shards(src)), "runs": runs}


def layer_bytes(src: Path) -> dict[int, int]:
    """Stored bytes per decoder layer (``model.layers.N.``) of a checkpoint, from its headers."""
    from fp4forge.checkpoint.reader import open_checkpoint

    sizes: dict[int, int] = {}
    for _, info in open_checkpoint(src).tensors():
        parts = info.name.split(".")
        if len(parts) > 2 and parts[1] == "layers" and parts[2].isdigit():
            sizes[int(parts[2])] = sizes.get(int(parts[2]), 0) + info.nbytes
    return sizes


def tokenizer_dir(args: argparse.Namespace, src: Path) -> Path:
    """The source's own tokenizer, else the testbed's (ids below 4,096: valid in any preset)."""
    if (src / "tokenizer.json").exists():
        return src
    tokenizer = args.work / "tokenizer"
    if not (tokenizer / "tokenizer.json").exists():
        from fp4forge.testbed import build_tokenizer

        build_tokenizer().save_pretrained(tokenizer)
    return tokenizer


def measure_pipeline(args: argparse.Namespace, src: Path) -> dict:
    """`fp4forge pipeline` (no serving) in one process: wall time per step (its manifest) and the
    process's peak RSS, anonymous and file-backed, against the bound docs/pipeline.md states:
    two decoder layers of the source + the activation budget + RSS_CONSTANT_GIB."""
    import shutil

    out = args.work / f"{src.name}-pipeline"
    shutil.rmtree(out, ignore_errors=True)
    argv = ["pipeline", str(src), str(out), "--recipe", args.recipe, "--device", args.device, "--tokenizer", str(tokenizer_dir(args, src)),
            "--calib-samples", str(args.calib_samples), "--calib-seq-len", str(args.seq_len),
            "--fidelity-samples", str(args.fidelity_samples), "--fidelity-seq-len", str(args.seq_len), "--activation-budget", args.activation_budget]
    run = run_step("pipeline", argv, keep_samples=True)
    manifest = json.loads((out / "reports" / "pipeline.json").read_text())
    run["peak_anon_mib_by_step"] = _peaks_by_step(run.pop("samples"), run["wall_s"], manifest["steps"])
    layers = layer_bytes(src)
    budget = _gib(args.activation_budget)
    two_layers = sum(sorted(layers.values())[-2:]) / 2**30
    bound = two_layers + budget + RSS_CONSTANT_GIB
    return {**run, "steps_s": {step["name"]: step["seconds"] for step in manifest["steps"] if step["seconds"] is not None},
            "two_layers_gib": two_layers, "activation_budget_gib": budget, "constant_gib": RSS_CONSTANT_GIB, "bound_gib": bound,
            "peak_anon_within_bound": run["peak_anon_mib"] / 1024 <= bound, "peak_rss_within_bound": run["peak_rss_mib"] / 1024 <= bound}


def _gib(text: str) -> float:
    from fp4forge.cli.common import parse_bytes

    return (parse_bytes(text, "activation_budget") or 0) / 2**30


def summary(doc: dict) -> dict:
    gb = doc["export_bytes"] / 1e9
    median = {step: statistics.median(r["wall_s"] for r in runs) for step, runs in doc["runs"].items()}
    rate = {step: gb / s for step, s in median.items()}
    cpu = {step: statistics.median(r["cpu_s"] for r in runs) for step, runs in doc["runs"].items() if "cpu_s" in runs[0]}
    devices = [step.removeprefix("deep_cold_") for step in median if step.startswith("deep_cold_")]
    return {
        "median_s": median,
        "median_cpu_s": cpu,
        "gb_per_s_of_checkpoint": rate,
        "deep_cold_vs_cold_read": {d: rate[f"deep_cold_{d}"] / rate["cold_read"] for d in devices},
        "deep_warm_vs_warm_read": {d: rate[f"deep_warm_{d}"] / rate["warm_read"] for d in devices},
        "export_s_over_deep_cold_s": {d: median["export"] / median[f"deep_cold_{d}"] for d in devices},
        "peak_rss_mib": {step: max(r.get("peak_rss_mib", 0) for r in runs) for step, runs in doc["runs"].items() if "peak_rss_mib" in runs[0]},
        # every deep audit (each device, cold and warm) printed the same JSON document (None: a record without the hashes)
        "deep_findings_identical": _all_equal([r.get("stdout_sha256") for step, runs in doc["runs"].items() if step.startswith("deep_") for r in runs]),
    }



def _all_equal(values: list) -> bool | None:
    """Whether every value is the same; None where one is missing (not recorded is not equal)."""
    return None if not values or None in values else len(set(values)) == 1

def print_table(doc: dict) -> None:
    if "summary" in doc:
        print_summary(doc, doc["summary"])
    pipe = doc.get("pipeline")
    if pipe:
        steps = ", ".join(f"{name} {seconds:.1f}" for name, seconds in pipe["steps_s"].items())
        print(f"pipeline: {pipe['wall_s']:.1f} s ({steps})")
        print(f"pipeline peak RSS {pipe['peak_rss_mib'] / 1024:.2f} GiB (anon {pipe['peak_anon_mib'] / 1024:.2f}, file-backed {pipe['peak_file_mib'] / 1024:.2f}); "
              f"bound: two layers {pipe['two_layers_gib']:.2f} + activation budget {pipe['activation_budget_gib']:.2f} + {pipe['constant_gib']:.1f} = {pipe['bound_gib']:.2f} GiB: "
              f"{'within' if pipe['peak_rss_within_bound'] else 'ABOVE'}")
        print("peak anon RSS by step (MiB, approx.): " + ", ".join(f"{k} {v:,.0f}" for k, v in pipe["peak_anon_mib_by_step"].items()))


def print_summary(doc: dict, s: dict) -> None:
    print(f"\ncheckpoint {doc['export_bytes'] / 1e9:.3f} GB ({doc['recipe']}, {doc['format']}), source {doc['source_bytes'] / 1e9:.3f} GB, device {doc['device']}")
    print(f"{'step':<22}{'median s':>9}{'GB/s':>8}{'CPU-s':>8}{'peak RSS MiB':>14}")
    for step, seconds in s["median_s"].items():
        rss, cpu = s["peak_rss_mib"].get(step), s["median_cpu_s"].get(step)
        print(f"{step:<22}{seconds:>9.2f}{s['gb_per_s_of_checkpoint'][step]:>8.3f}{'' if cpu is None else f'{cpu:>8.2f}'}{'' if rss is None else f'{rss:>14,.0f}'}")
    print(f"deep audit findings identical across devices and runs: {s['deep_findings_identical']}")
    for where, ratio in s["deep_cold_vs_cold_read"].items():
        print(f"--device {where}: deep audit / read rate, cold {ratio:.2f}, warm {s['deep_warm_vs_warm_read'][where]:.2f}; "
              f"export time / deep audit time (cold) {s['export_s_over_deep_cold_s'][where]:.2f} (>= 1: not slower than the export)")


def machine() -> dict:
    """CPU model and cores, GPU, load average and date: what a figure is read against."""
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"cpu": cpu, "cores": os.cpu_count(), "gpu": gpu, "load_average": os.getloadavg(), "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", type=Path, help="an existing BF16 checkpoint directory")
    parser.add_argument("--config", default="laguna-s-2.1-like", help="testbed synth preset or config.json (without --source)")
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=JSON", help="override a config key of the synthetic source")
    parser.add_argument("--recipe", default="nvfp4-experts")
    parser.add_argument("--format", default="compressed-tensors")
    parser.add_argument("--device", default="auto", help="export (and pipeline) device: auto | cpu | cuda")
    parser.add_argument("--audit-devices", default="", help="comma-separated --device values for the deep audit (default: --device), e.g. cuda,cpu")
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--gpu-synth", action="store_true", help="synthesise the laguna-s-2.1-like source on the GPU (benchmarks/bench_gpu.py), tokenizer included")
    parser.add_argument("--pipeline", action="store_true", help="also run `fp4forge pipeline` (no serving) and check its peak RSS against the bound")
    parser.add_argument("--only-pipeline", action="store_true", help="the pipeline alone (no export / read / audit comparison)")
    parser.add_argument("--calib-samples", type=int, default=8)
    parser.add_argument("--fidelity-samples", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--activation-budget", default="8GiB", help="the pipeline's --activation-budget (0 on a CPU run)")
    parser.add_argument("--work", type=Path, default=OUT / "deep-audit")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", OUT)))
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    src = source_dir(args)
    doc = {"recipe": args.recipe, "format": args.format, "device": args.device, "source": str(src)}
    if not args.only_pipeline:
        doc.update(measure(args, src))
        doc["summary"] = summary(doc)
    if args.pipeline or args.only_pipeline:
        doc["pipeline"] = measure_pipeline(args, src)
    doc["machine"] = machine()
    print_table(doc)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_deep_audit.json").write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
