"""`fp4forge pipeline` (no serving) on full-width `laguna-s-2.1-like` layers, for two layer counts,
and the 48-layer projection from the measured per-layer costs.

For each N of ``--layers`` (ascending): ``testbed synth`` writes the first N layers at full width
(values drawn on the GPU when there is one, as ``bench_gpu.py`` does; the tokenizer, chat template
and own text are synth's), the source's shards are evicted from the page cache (a 48-layer source
of 235 GB cannot stay cached in a node's RAM, so every read here is cold too), then the pipeline
runs as a user types it, in its own process:

    fp4forge pipeline SRC OUT --recipe nvfp4-experts-fp8-attn \\
        --calib-samples 256 --calib-seq-len 1024 --calib-text SRC/fp4forge-calibration.jsonl \\
        --fidelity-text SRC/fp4forge-heldout.jsonl --fidelity-allow-unreadable

(calibrate 262,144 tokens, quantize, KV check, deep audit, bytes, fidelity at its defaults of 16 x
256 tokens, serve command, card). Measured per run: every step's seconds (the pipeline's own
``reports/pipeline.json``), the process's wall time, its peak host RSS (``ru_maxrss`` through
``benchmarks/_util.run_measured``: all resident pages, the mapped file pages included), the peaks
of its anonymous, file-backed and shared RSS apart (sampled at 20 Hz by a thread of the pipeline
process; the page cache of files read with ``read()`` is in none of them, mapped file pages are
file-backed and the kernel drops them under pressure), the anonymous peak against its bound
(docs/gpu.md#host-memory; :func:`host_bound`), and its peak GPU memory (torch's allocator,
allocated and reserved, in that process). The projection: for each step,
``per_layer = (t(N2) - t(N1)) / (N2 - N1)``, ``fixed = t(N1) - N1 * per_layer`` and
``t(48) = fixed + 48 * per_layer``; its assumptions are written beside it (``ASSUMPTIONS``).

Writes ``pipeline-real.json`` and ``pipeline-real.md`` (a benchmarks/RESULTS.md section with its
command, machine, date, goal and raw-data fields filled in) to ``--out`` (default ``$OUT``, else
``benchmarks/out/pipeline-real``); both are rewritten after each N, so a run stopped by a time
limit keeps what it measured. The sources are deleted after their run (disk: N=4 is 16.5 GB).

    python3 benchmarks/bench_pipeline_real.py --layers 2,4                 # one H100: about 5 minutes
    python3 benchmarks/bench_pipeline_real.py --tiny --out /tmp/bpr        # CPU smoke test (--shrink 16)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "src"))

from benchmarks._util import drop_page_cache, run_measured  # noqa: E402
from fp4forge.model.samples import DEFAULT_RAM_BUDGET_BYTES  # noqa: E402

PRESET = "laguna-s-2.1-like"
RECIPE = "nvfp4-experts-fp8-attn"
FULL_LAYERS = 48  # the preset's num_hidden_layers
STEPS = ("calibrate", "quantize", "kv", "audit", "bytes", "fidelity", "serve-cmd", "card")
ASSUMPTIONS = (
    "Each step's cost is linear in the layer count: a fixed part (embeddings, lm_head, process start, the "
    "card) plus the same cost per layer. Layer 0 (dense) is in every run; every other layer of the preset is a "
    "256-expert MoE layer of one shape. Full-attention MoE layers (every 4th from layer 4) differ from the "
    "measured sliding ones only in attention, a small share of a layer's bytes and time.",
    "The token counts do not grow with the layers: calibration on the same samples x seq_len, fidelity on the "
    "same held-out tokens.",
    "The source is evicted from the page cache before each run, so calibration reads it cold; quantize and "
    "fidelity read it again, from the page cache at the measured sizes, which a 235 GB source does not fit: at "
    "48 layers each of them also pays a cold read of every layer (bytes per layer / the disk's read speed), "
    "which this projection leaves out. The disk is assumed as fast at 235 GB as at the measured sizes. The "
    "48-layer source and its export do not fit a 64 GiB disk: the projection is not a run.",
    "Peak host RSS and GPU memory are per-layer quantities (the pipeline streams layers); they are reported "
    "as measured at both sizes, not projected.",
)

# The pipeline in its own process, as `fp4forge ...` runs it; a thread of that process samples its
# /proc/self/status at 20 Hz (anonymous, file-backed and shared RSS kept apart), and torch's GPU
# peak is written after.
_CHILD = r"""
import json, runpy, sys, threading, time
report, argv = sys.argv[1], sys.argv[2:]
sys.argv = ["fp4forge", *argv]
KEYS = ("RssAnon", "RssFile", "RssShmem", "VmHWM")
peaks = dict.fromkeys(KEYS, 0)
peaks["anon_at_s"] = 0.0
start = time.perf_counter()
def status():
    with open("/proc/self/status") as f:
        return {k: int(v.split()[0]) * 1024 for k, _, v in (line.partition(":") for line in f) if k in KEYS}
def sample():
    while True:
        now = status()
        if now.get("RssAnon", 0) > peaks["RssAnon"]:
            peaks["anon_at_s"] = time.perf_counter() - start
        for k in KEYS:
            peaks[k] = max(peaks[k], now.get(k, 0))
        time.sleep(0.05)
threading.Thread(target=sample, daemon=True).start()
code = 0
try:
    runpy.run_module("fp4forge.cli", run_name="__main__")
except SystemExit as exit_:
    code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
for k, v in status().items():
    peaks[k] = max(peaks[k], v)
import torch
gpu = {"allocated_bytes": torch.cuda.max_memory_allocated(), "reserved_bytes": torch.cuda.max_memory_reserved()} if torch.cuda.is_available() else None
host = {"anon_bytes": peaks["RssAnon"], "file_bytes": peaks["RssFile"], "shmem_bytes": peaks["RssShmem"], "hwm_bytes": peaks["VmHWM"], "anon_peak_at_s": peaks["anon_at_s"]}
json.dump({"exit_code": code, "gpu_peak": gpu, "host_peak": host}, open(report, "w"))
sys.exit(code)
"""

# docs/gpu.md#host-memory: the stated constant of the host-memory bound (the interpreter, torch,
# transformers and the CUDA runtime's own host memory, the tokenizer and the samples).
HOST_CONSTANT_BYTES = 3 * 2**30
LAYER_NAME = re.compile(r"^(?:.*\.)?layers\.(\d+)\.")


def largest_layer_bytes(checkpoint: Path) -> int:
    """The stored bytes of the largest decoder layer of a checkpoint (its safetensors headers)."""
    from fp4forge.checkpoint.reader import open_checkpoint

    per_layer: dict[int, int] = {}
    for _, info in open_checkpoint(checkpoint).tensors():
        match = LAYER_NAME.match(info.name)
        if match:
            per_layer[int(match.group(1))] = per_layer.get(int(match.group(1)), 0) + info.nbytes
    return max(per_layer.values(), default=0)


def host_bound(layer_bytes: int, stored_layer_bytes: int, on_cuda: bool, ram_budget_bytes: int = DEFAULT_RAM_BUDGET_BYTES) -> int:
    """docs/gpu.md#host-memory: peak anonymous RSS <= 2 x (L + S) + A + C on CUDA (the BF16 layer
    and the student's stored layer, each being copied and read ahead; the host activation budget;
    the constant). On the CPU the device is RAM: the materialised layer adds L, and the student is
    decoded on the host (S = L)."""
    if on_cuda:
        return 2 * (layer_bytes + stored_layer_bytes) + ram_budget_bytes + HOST_CONSTANT_BYTES
    return 5 * layer_bytes + ram_budget_bytes + HOST_CONSTANT_BYTES


def log(*parts: object) -> None:
    print(f"[{time.strftime('%H:%M:%S')}]", *parts, flush=True)


def build_source(work: Path, layers: int, shrink: int) -> tuple[Path, float]:
    """The synth source of ``layers`` layers and the seconds it took to write."""
    import torch

    from fp4forge.testbed import synth

    if torch.cuda.is_available():
        from benchmarks.bench_gpu import gpu_synthetic_tensor

        synth.synthetic_tensor = gpu_synthetic_tensor  # the writer looks it up at call time
    src = work / f"synth-L{layers}"
    start = time.perf_counter()
    synth.synth_checkpoint(PRESET, layers, src, seed=0, shrink=shrink)
    return src, time.perf_counter() - start


def pipeline_command(src: Path, out: Path, args: argparse.Namespace) -> list[str]:
    command = ["pipeline", str(src), str(out), "--recipe", RECIPE,
               "--calib-samples", str(args.calib_samples), "--calib-seq-len", str(args.calib_seq_len),
               "--calib-text", str(src / "fp4forge-calibration.jsonl"), "--fidelity-text", str(src / "fp4forge-heldout.jsonl"),
               # synth's random weights read no text: fidelity is timed here, scored with the warning
               "--fidelity-allow-unreadable"]
    if args.fidelity_samples:
        command += ["--fidelity-samples", str(args.fidelity_samples), "--fidelity-seq-len", str(args.fidelity_seq_len)]
    return command


def run_one(work: Path, layers: int, args: argparse.Namespace) -> dict:
    """Build N layers, evict them, run the pipeline in its own process, read its step times."""
    src, build_s = build_source(work, layers, args.shrink)
    source_bytes = sum(p.stat().st_size for p in src.glob("*.safetensors"))
    os.sync()  # dirty pages are not evicted: write them back first
    evicted = all(drop_page_cache(p) for p in src.glob("*.safetensors"))
    out = work / f"out-L{layers}"
    log(f"N={layers}: source {source_bytes / 1e9:.2f} GB written in {build_s:.1f} s; pipeline ...")
    with tempfile.NamedTemporaryFile("r", suffix=".json") as report:
        stats = run_measured([sys.executable, "-c", _CHILD, report.name, *pipeline_command(src, out, args)], env=_env())
        child = json.loads(report.read() or "{}")
    if stats.returncode != 0:
        raise SystemExit(f"pipeline failed at N={layers} (exit {stats.returncode}):\n{stats.stderr.decode(errors='replace')[-3000:]}")
    manifest = json.loads((out / "reports" / "pipeline.json").read_text())
    steps = {s["name"]: s["seconds"] for s in manifest["steps"] if s["status"] == "done"}
    export_bytes = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    layer_bytes, stored_layer_bytes = largest_layer_bytes(src), largest_layer_bytes(out)
    host = child.get("host_peak") or {}
    bound = host_bound(layer_bytes, stored_layer_bytes, on_cuda=child.get("gpu_peak") is not None)
    log(f"N={layers}: peak host RSS anonymous {host.get('anon_bytes', 0) / 1e9:.2f} GB (bound {bound / 1e9:.2f} GB: "
        f"{'within' if host.get('anon_bytes', 0) <= bound else 'OVER'}), file-backed {host.get('file_bytes', 0) / 1e9:.2f} GB, "
        f"shared {host.get('shmem_bytes', 0) / 1e9:.2f} GB, VmHWM {host.get('hwm_bytes', 0) / 1e9:.2f} GB")
    calibration = json.loads((out / "reports" / "calibration.json").read_text())
    fidelity = json.loads((out / "reports" / "fidelity.json").read_text())
    if not args.keep:
        shutil.rmtree(src), shutil.rmtree(out)
    return {"layers": layers, "source_bytes": source_bytes, "export_bytes": export_bytes, "build_s": build_s,
            "source_evicted": evicted, "step_seconds": steps, "steps_total_s": sum(steps.values()), "wall_s": stats.wall_s,
            "cpu_s": stats.cpu_s, "peak_rss_bytes": int(stats.peak_rss_mib * 2**20), "gpu_peak": child.get("gpu_peak"),
            "host_peak": host, "layer_bytes": layer_bytes, "stored_layer_bytes": stored_layer_bytes, "host_anon_bound_bytes": bound,
            "calibration_tokens": calibration.get("tokens"), "fidelity_tokens": _fidelity_tokens(fidelity)}


def _fidelity_tokens(doc: dict) -> int | None:
    return (doc.get("data") or {}).get("tokens")


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}


def projection(small: dict, large: dict, layers: int = FULL_LAYERS) -> dict:
    """Per step: the per-layer and fixed costs from two sizes, and the cost at ``layers``."""
    span = large["layers"] - small["layers"]
    rows = {}
    for step in [*STEPS, "wall"]:
        a = small["wall_s"] if step == "wall" else small["step_seconds"].get(step)
        b = large["wall_s"] if step == "wall" else large["step_seconds"].get(step)
        if a is None or b is None:
            continue
        per_layer = (b - a) / span
        fixed = a - small["layers"] * per_layer
        rows[step] = {"fixed_s": fixed, "per_layer_s": per_layer, f"projected_{layers}_s": fixed + layers * per_layer}
    bytes_per_layer = (large["source_bytes"] - small["source_bytes"]) / span
    return {"layers": layers, "from": [small["layers"], large["layers"]], "steps": rows,
            "source_bytes_projected": small["source_bytes"] + (layers - small["layers"]) * bytes_per_layer,
            "assumptions": list(ASSUMPTIONS)}


def machine() -> dict:
    import torch
    import transformers

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {"gpu": gpu, "cpu_cores": os.cpu_count(), "ram_bytes": memory, "torch": torch.__version__,
            "transformers": transformers.__version__, "python": platform.python_version(), "date": time.strftime("%Y-%m-%d")}


def markdown(doc: dict) -> str:
    """A benchmarks/RESULTS.md section (its fields filled from the run; the figures' reading is left
    to whoever records it)."""
    runs, m = doc["runs"], doc["machine"]
    lines = ["## The pipeline at real width", "",
             f"`fp4forge pipeline` (no serving) on N `{PRESET}` layers ({_width(doc['shrink'])}, `testbed synth`), "
             f"recipe `{RECIPE}`, each run from shards evicted from the page cache; the 48-layer projection from the "
             "per-layer costs.", "",
             f"- **Command:** `{doc['command']}`",
             f"- **Machine:** {m['gpu'] or 'CPU only'}, {m['cpu_cores']} CPU cores, {m['ram_bytes'] / 2**30:.0f} GiB RAM, "
             f"torch {m['torch']}, transformers {m['transformers']}",
             f"- **Date:** {m['date']}",
             "- **Goal:** the projected 48-layer pipeline ≤ 15 minutes on one H100",
             "- **Raw data:** [data/pipeline-real/](data/pipeline-real/) (`pipeline-real.json`)", ""]
    lines += ["| step | " + " | ".join(f"N={r['layers']} (s)" for r in runs) + " |", "|---|" + "---|" * len(runs)]
    for step in STEPS:
        lines.append(f"| {step} | " + " | ".join(f"{r['step_seconds'].get(step, float('nan')):.1f}" for r in runs) + " |")
    rows = (("pipeline process wall", lambda r: f"{r['wall_s']:.1f}"), ("source GB (BF16)", lambda r: f"{r['source_bytes'] / 1e9:.2f}"),
            ("export GB", lambda r: f"{r['export_bytes'] / 1e9:.2f}"), ("peak host RSS GB (ru_maxrss)", lambda r: f"{r['peak_rss_bytes'] / 1e9:.2f}"),
            ("peak anonymous RSS GB", lambda r: _gb(r["host_peak"].get("anon_bytes"))),
            ("its bound GB (docs/gpu.md#host-memory)", lambda r: _gb(r["host_anon_bound_bytes"])),
            ("peak file-backed RSS GB", lambda r: _gb(r["host_peak"].get("file_bytes"))),
            ("peak shared RSS GB", lambda r: _gb(r["host_peak"].get("shmem_bytes"))),
            ("peak GPU allocated GB", lambda r: _gb((r["gpu_peak"] or {}).get("allocated_bytes"))),
            ("peak GPU reserved GB", lambda r: _gb((r["gpu_peak"] or {}).get("reserved_bytes"))),
            ("calibration tokens", lambda r: f"{r['calibration_tokens']:,}"), ("build (synth) s", lambda r: f"{r['build_s']:.1f}"))
    lines += [f"| {name} | " + " | ".join(cell(r) for r in runs) + " |" for name, cell in rows]
    if doc.get("projection"):
        p = doc["projection"]
        lines += ["", f"Projection to {p['layers']} layers from N = {p['from'][0]} and {p['from'][1]} "
                  f"(source {p['source_bytes_projected'] / 1e9:.1f} GB):", "",
                  "| step | fixed s | per layer s | projected s |", "|---|---|---|---|"]
        projected = f"projected_{p['layers']}_s"
        for step, row in p["steps"].items():
            lines.append(f"| {step} | {row['fixed_s']:.1f} | {row['per_layer_s']:.2f} | {row[projected]:.0f} |")
        lines += ["", "Assumptions:", ""] + [f"- {a}" for a in p["assumptions"]]
    return "\n".join(lines) + "\n"


def _width(shrink: int) -> str:
    return "full width" if shrink == 1 else f"widths / {shrink}"


def _gb(value: int | None) -> str:
    return "-" if value is None else f"{value / 1e9:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or ROOT / "benchmarks" / "out" / "pipeline-real"))
    parser.add_argument("--work", type=Path, default=None, help="where sources and exports go (default: a temporary directory)")
    parser.add_argument("--layers", default="2,4", help="two layer counts, comma-separated")
    parser.add_argument("--shrink", type=int, default=1, help="testbed synth --shrink (1: full width)")
    parser.add_argument("--calib-samples", type=int, default=256)
    parser.add_argument("--calib-seq-len", type=int, default=1024)
    parser.add_argument("--fidelity-samples", type=int, default=0, help="0: the pipeline's default")
    parser.add_argument("--fidelity-seq-len", type=int, default=256)
    parser.add_argument("--keep", action="store_true", help="keep sources and exports")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke test: shrink 16, layers 2,3, 8 x 64 calibration tokens")
    args = parser.parse_args()
    if args.tiny:
        args.shrink, args.layers, args.calib_samples, args.calib_seq_len = 16, "2,3", 8, 64
        args.fidelity_samples, args.fidelity_seq_len = 2, 64
    layer_counts = sorted(int(n) for n in args.layers.split(","))
    args.out.mkdir(parents=True, exist_ok=True)
    command = "python3 benchmarks/bench_pipeline_real.py " + " ".join(sys.argv[1:])
    doc = {"preset": PRESET, "recipe": RECIPE, "shrink": args.shrink, "command": command.strip(), "machine": machine(), "runs": [], "projection": None}
    with tempfile.TemporaryDirectory(dir=args.work) as scratch:
        for layers in layer_counts:
            doc["runs"].append(run_one(Path(scratch), layers, args))
            if len(doc["runs"]) >= 2:
                doc["projection"] = projection(doc["runs"][0], doc["runs"][-1])
            (args.out / "pipeline-real.json").write_text(json.dumps(doc, indent=2) + "\n")
            (args.out / "pipeline-real.md").write_text(markdown(doc))
            log(f"N={layers}: steps {doc['runs'][-1]['step_seconds']}")
    print(markdown(doc))


if __name__ == "__main__":
    main()
