"""Several processes through torch.distributed: 1 vs N ranks for calibrate, export and fidelity.

Driver (no launcher in the environment): for each N of ``--nproc`` it runs every step under
``torchrun --standalone --nproc-per-node N`` (one launch per step, so each step's peak memory is
its own), then prints per step and N: throughput (calibration tokens/s, export GB/s of BF16
input, fidelity positions/s), scaling efficiency = throughput_N / (N x throughput_1), peak RSS
per rank (and peak CUDA memory per rank on GPUs), and whether the result equals N = 1 (the
statistics file and every exported file by sha256; fidelity's KL mean within 1e-6 relative).

Worker (under a launcher, e.g. ``torchrun --nproc-per-node 8 benchmarks/bench_distributed.py
--step calibrate ...`` on a GPU host, backend nccl there, gloo on CPUs): runs one step; the
timed span starts after a barrier, once the process group has formed and everything is imported,
and ends after every rank finished; rank 0 appends one JSON line to ``<out>/results.jsonl``.

The source is the tiny Laguna testbed by default (built once into benchmarks/out), or any BF16
checkpoint with ``--source`` (e.g. a ``fp4forge testbed synth laguna-s-2.1-like`` model with
``--tokenizer`` pointing at a tokenizer directory: the synth presets ship none).

    .venv/bin/python benchmarks/bench_distributed.py --nproc 1 2                   # CPU, gloo
    .venv/bin/python benchmarks/bench_distributed.py --nproc 1 2 4 8 --source S --tokenizer T
    torchrun --nproc-per-node 8 benchmarks/bench_distributed.py --step calibrate --out DIR ...
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._util import OUT  # noqa: E402

STEPS = ("calibrate", "export", "fidelity")
RECIPE = "nvfp4-experts-fp8-attn"


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, nargs="+", default=[1, 2], help="rank counts to compare (driver)")
    parser.add_argument("--step", choices=STEPS, help="run one step (worker; under torchrun)")
    parser.add_argument("--steps", nargs="+", choices=STEPS, default=list(STEPS))
    parser.add_argument("--source", type=Path, help="BF16 checkpoint (default: the tiny Laguna testbed)")
    parser.add_argument("--tokenizer", type=Path, help="tokenizer directory (default: the checkpoint's)")
    parser.add_argument("--out", type=Path, default=OUT / "distributed")
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--fidelity-samples", type=int, default=16)
    parser.add_argument("--threads-per-rank", type=int, default=1, help="torch threads and export workers per rank")
    return parser.parse_args()


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def digests(directory: Path) -> dict[str, str]:
    return {p.relative_to(directory).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.rglob("*")) if p.is_file()}


# -- worker ---------------------------------------------------------------------------------------
def on_this_gpu(options_class: type) -> dict:
    """``device="cuda:LOCAL_RANK"`` for a step whose options take a device, on a GPU host (the
    steps compute on the CPU where they take none)."""
    import dataclasses

    import torch

    if torch.cuda.is_available() and "device" in {f.name for f in dataclasses.fields(options_class)}:
        return {"device": f"cuda:{torch.cuda.current_device()}"}
    return {}


def worker(args: argparse.Namespace) -> None:
    import torch

    from fp4forge.calibrate.run import CalibrationOptions, calibrate_to_file
    from fp4forge.fidelity.evaluate import FidelityOptions, evaluate
    from fp4forge.model.distributed import current
    from fp4forge.quantize.act_scales import StatsAmax
    from fp4forge.quantize.export import QuantizeOptions, quantize_checkpoint
    from fp4forge.quantize.recipe import load_recipe

    torch.set_num_threads(args.threads_per_rank)
    ranks = current()
    out = args.out
    stats, export = out / "stats.safetensors", out / "export"
    ranks.barrier()
    started = time.perf_counter()
    if args.step == "calibrate":
        options = CalibrationOptions(samples=args.samples, seq_len=args.seq_len, batch_size=args.batch_size, tokenizer=args.tokenizer,
                                     **on_this_gpu(CalibrationOptions))
        summary = calibrate_to_file(args.source, stats, options)
        work, unit = summary["tokens"], "tokens/s"
    elif args.step == "export":
        options = QuantizeOptions(recipe=load_recipe(RECIPE), act_amax=StatsAmax(stats), workers=args.threads_per_rank,
                                  **on_this_gpu(QuantizeOptions))
        work, unit = quantize_checkpoint(args.source, export, options).bytes_read / 1e9, "GB/s"
    else:
        # a speed measurement: the built-in text, asked for, scored even where the model cannot read it
        options = FidelityOptions(samples=args.fidelity_samples, seq_len=args.seq_len, batch_size=args.batch_size, tokenizer=args.tokenizer,
                                  builtin_corpus=True, allow_unreadable=True, **on_this_gpu(FidelityOptions))
        report = evaluate(args.source, export, options)
        work, unit = report.metrics["positions"], "positions/s"
        if ranks.is_main:
            (out / "fidelity.json").write_text(json.dumps(report.metrics, indent=2))
    ranks.barrier()
    seconds = time.perf_counter() - started
    memory = {"rss_mib": peak_rss_mib(), "cuda_mib": torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else None}
    per_rank = ranks.all_gather_object(memory)
    if ranks.is_main:
        row = {"step": args.step, "ranks": ranks.world_size, "backend": ranks.backend, "seconds": seconds, "work": work, "unit": unit,
               "throughput": work / seconds, "per_rank": per_rank, "threads_per_rank": args.threads_per_rank}
        with open(out / "results.jsonl", "a") as fh:
            fh.write(json.dumps(row) + "\n")


# -- driver ---------------------------------------------------------------------------------------
def tiny_source() -> Path:
    path = OUT / "distributed-tiny-laguna"
    if not (path / "config.json").exists():
        from fp4forge.testbed.tiny import build_tiny_laguna

        build_tiny_laguna(path, seed=0)
    return path


def launch(args: argparse.Namespace, nproc: int, step: str, out: Path) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", __file__, "--step", step,
           "--source", str(args.source), "--out", str(out), "--samples", str(args.samples), "--seq-len", str(args.seq_len),
           "--batch-size", str(args.batch_size), "--fidelity-samples", str(args.fidelity_samples), "--threads-per-rank", str(args.threads_per_rank)]
    if args.tokenizer:
        cmd += ["--tokenizer", str(args.tokenizer)]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads_per_rank), "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).resolve().parent.parent / "src"), os.environ.get("PYTHONPATH")]))}
    subprocess.run(cmd, check=True, env=env)


def driver(args: argparse.Namespace) -> None:
    args.source = args.source or tiny_source()
    rows: dict[tuple[str, int], dict] = {}
    for nproc in args.nproc:
        out = args.out / f"n{nproc}"
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        for step in args.steps:
            launch(args, nproc, step, out)
        for line in (out / "results.jsonl").read_text().splitlines():
            row = json.loads(line)
            rows[(row["step"], nproc)] = row
    base = args.out / f"n{args.nproc[0]}"
    checks = {}
    for nproc in args.nproc[1:]:
        here = args.out / f"n{nproc}"
        same = {}
        if "calibrate" in args.steps:
            same["calibrate"] = (base / "stats.safetensors").read_bytes() == (here / "stats.safetensors").read_bytes()
        if "export" in args.steps:
            same["export"] = digests(base / "export") == digests(here / "export")
        if "fidelity" in args.steps:
            a, b = (json.loads((d / "fidelity.json").read_text())["kl"]["mean"] for d in (base, here))
            same["fidelity"] = abs(a - b) <= 1e-6 * abs(a)
        checks[nproc] = same
    first = args.nproc[0]
    print(f"\nsource {args.source} · samples {args.samples} x {args.seq_len} (fidelity {args.fidelity_samples}) · batch {args.batch_size} · "
          f"{args.threads_per_rank} thread(s) per rank · load average {os.getloadavg()[0]:.1f}")
    print("| step | ranks | backend | seconds | throughput | scaling efficiency | peak RSS per rank MiB | peak CUDA per rank MiB | equal to 1 rank |")
    print("|---|---|---|---|---|---|---|---|---|")
    for step in args.steps:
        for nproc in args.nproc:
            row = rows[(step, nproc)]
            efficiency = row["throughput"] / (nproc / first * rows[(step, first)]["throughput"])
            rss = ", ".join(f"{r['rss_mib']:.0f}" for r in row["per_rank"])
            cuda = ", ".join(f"{r['cuda_mib']:.0f}" for r in row["per_rank"]) if row["per_rank"][0]["cuda_mib"] is not None else "–"
            same = "(reference)" if nproc == first else ("yes" if checks[nproc][step] else "**NO**")
            print(f"| {step} | {nproc} | {row['backend'] or 'none'} | {row['seconds']:.2f} | {row['throughput']:.4g} {row['unit']} | {efficiency:.2f} | {rss} | {cuda} | {same} |")
    (args.out / "summary.json").write_text(json.dumps({"rows": [rows[k] for k in sorted(rows)], "equal": checks}, indent=2))
    if not all(all(v.values()) for v in checks.values()):
        raise SystemExit("the ranks' results differ from one process")


def main() -> None:
    args = parse()
    if args.step:
        worker(args)
    else:
        driver(args)


if __name__ == "__main__":
    main()
