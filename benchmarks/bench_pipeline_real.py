"""`fp4forge pipeline` (no serving) on full-width `laguna-s-2.1-like` layers, for two layer counts,
and the 48-layer projection from the measured per-layer costs.

For each N of ``--layers`` (ascending): ``testbed synth`` writes the first N layers at full width
(values drawn on the GPU when there is one, as ``bench_gpu.py`` does; the tokenizer, chat template
and own text are synth's), the source's shards are evicted from the page cache and read once, timed
(the disk's cold-read rate), evicted again, then the pipeline runs as a user types it, in its own
process:

    fp4forge pipeline SRC OUT --recipe nvfp4-experts-fp8-attn \\
        --calib-samples 256 --calib-seq-len 1024 --calib-text SRC/fp4forge-calibration.jsonl \\
        --fidelity-text SRC/fp4forge-heldout.jsonl --fidelity-allow-unreadable

(calibrate 262,144 tokens, quantize, KV check, deep audit, bytes, fidelity at its defaults of 16 x
256 tokens, serve command, card). Measured per run: every step's seconds (the pipeline's own
``reports/pipeline.json``; the rest of the process's wall time is its start and the content hashes
of the source and the export), the process's wall time, its peak host RSS (``ru_maxrss`` through
``benchmarks/_util.run_measured``: all resident pages, the mapped file pages included), the peaks
of its anonymous, shared (torch's page-locked host memory is a shared mapping) and file-backed RSS
apart and of anonymous + shared (sampled at 20 Hz by a thread of the pipeline process; the page
cache of files read with ``read()`` is in none of them, mapped file pages are file-backed and the
kernel drops them under pressure), anonymous + shared against its bound
(docs/gpu.md#host-memory; :func:`host_bound`), and its peak GPU memory (torch's allocator,
allocated and reserved, in that process). The projection: for each step (and the time outside the
steps), ``per_layer = (t(N2) - t(N1)) / (N2 - N1)``, ``fixed = t(N1) - N1 * per_layer`` and
``t(48) = fixed + 48 * per_layer``; then again with each part that reads the source or the export
(``READS``) floored at its bytes per layer over a cold-read rate (:func:`cold_floors`), since at
48 layers neither fits the page cache. Its assumptions are written beside it (``ASSUMPTIONS``).

Writes ``pipeline-real.json`` and ``pipeline-real.md`` (a benchmarks/RESULTS.md section with its
command, machine, date, goal and raw-data fields filled in) to ``--out`` (default ``$OUT``, else
``benchmarks/out/pipeline-real``); both are rewritten after each N, so a run stopped by a time
limit keeps what it measured. The sources are deleted after their run (disk: N=4 is 16.5 GB).

    python3 benchmarks/bench_pipeline_real.py --layers 2,4                 # one H100: about 5 minutes
    python3 benchmarks/bench_pipeline_real.py --tiny --out /tmp/bpr        # CPU smoke test (--shrink 16)
    python3 benchmarks/bench_pipeline_real.py --report-only benchmarks/data/pipeline-real/pipeline-real.json \\
        --out /tmp/bpr --disk-gbps 1.771 --disk-how "..."                  # re-render a recorded run
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

from benchmarks._util import evict, read_all, run_measured  # noqa: E402
from fp4forge.model.samples import DEFAULT_RAM_BUDGET_BYTES  # noqa: E402

PRESET = "laguna-s-2.1-like"
RECIPE = "nvfp4-experts-fp8-attn"
FULL_LAYERS = 48  # the preset's num_hidden_layers
STEPS = ("calibrate", "quantize", "kv", "audit", "bytes", "fidelity", "serve-cmd", "card")
# What each timed part reads per decoder layer (pipeline/steps.py, pipeline/run.py): calibrate
# streams the source's layers, quantize reads the source and writes the export, the deep audit
# reads every value of the export, fidelity the teacher (the source) and the student (the export).
# Outside the steps, the pipeline's content hashes (SHA-256) read the source before calibrate and
# the export after quantize. kv, bytes, serve-cmd and the card read headers, scales and reports.
OUTSIDE = "outside the steps"
# What each part reads per layer. The source's content hash runs beside calibrate (pipeline/run.py):
# at 48 layers nothing makes the two share the page cache, so calibrate is floored at two reads.
READS = {"calibrate": ("source", "source"), "quantize": ("source",), "audit": ("export",),
         "fidelity": ("source", "export"), OUTSIDE: ("export",)}
ASSUMPTIONS = (
    "Each step's cost is linear in the layer count: a fixed part (embeddings, lm_head, process start, the "
    "card) plus the same cost per layer. Layer 0 (dense) is in every run; every other layer of the preset is a "
    "256-expert MoE layer of one shape. Full-attention MoE layers (every 4th from layer 4) differ from the "
    "measured sliding ones only in attention, a small share of a layer's bytes and time.",
    "The token counts do not grow with the layers: calibration on the same samples x seq_len, fidelity on the "
    "same held-out tokens.",
    "The source is evicted from the page cache before each run. Its one cold read is calibrate's, with the "
    "pipeline's content hash of the source reading it beside the step; quantize and fidelity then read it "
    "from the page cache, and the audit, fidelity and the export's hash (outside the steps) read the export "
    "just written from there too. At 48 layers neither the 235 GB source nor its export fits a node's page "
    "cache: the plain projection leaves those cold reads out; the floored one adds them back, taking each "
    "part's per-layer cost as at least the bytes it reads per layer over the disk's cold-read rate (the "
    "larger of the two, not their sum: the streamed steps read the next layer while the current one "
    "computes), calibrate's at two reads of the source (its own and the hash's). Writes are not floored. The "
    "disk is assumed as fast at 235 GB as at the measured sizes. The 48-layer source and its export do not "
    "fit a 64 GiB disk: the projection is not a run.",
    "The disk's cold-read rate: a timed cold read of each source before its pipeline run (or one given with "
    "--disk-gbps).",
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
peaks["anon_at_s"], peaks["anon_shmem"] = 0.0, 0
start = time.perf_counter()
def status():
    with open("/proc/self/status") as f:
        return {k: int(v.split()[0]) * 1024 for k, _, v in (line.partition(":") for line in f) if k in KEYS}
steps, current = {}, ["start"]  # per step: its peaks
def sample():
    while True:
        now = status()
        if now.get("RssAnon", 0) > peaks["RssAnon"]:
            peaks["anon_at_s"] = time.perf_counter() - start
        for k in KEYS:
            peaks[k] = max(peaks[k], now.get(k, 0))
        peaks["anon_shmem"] = max(peaks["anon_shmem"], now.get("RssAnon", 0) + now.get("RssShmem", 0))
        step = steps.setdefault(current[0], {"anon_bytes": 0, "shmem_bytes": 0, "anon_shmem_bytes": 0})
        step["anon_bytes"] = max(step["anon_bytes"], now.get("RssAnon", 0))
        step["shmem_bytes"] = max(step["shmem_bytes"], now.get("RssShmem", 0))
        step["anon_shmem_bytes"] = max(step["anon_shmem_bytes"], now.get("RssAnon", 0) + now.get("RssShmem", 0))
        time.sleep(0.05)
threading.Thread(target=sample, daemon=True).start()
from fp4forge.pipeline import run as pipeline_run
inner_step = pipeline_run._run_step
def timed_step(step, *args, **kwargs):
    current[0] = step.name
    try:
        return inner_step(step, *args, **kwargs)
    finally:
        current[0] = "between steps"
pipeline_run._run_step = timed_step
code = 0
try:
    runpy.run_module("fp4forge.cli", run_name="__main__")
except SystemExit as exit_:
    code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
for k, v in status().items():
    peaks[k] = max(peaks[k], v)
import torch
gpu = {"allocated_bytes": torch.cuda.max_memory_allocated(), "reserved_bytes": torch.cuda.max_memory_reserved()} if torch.cuda.is_available() else None
host = {"anon_bytes": peaks["RssAnon"], "file_bytes": peaks["RssFile"], "shmem_bytes": peaks["RssShmem"], "hwm_bytes": peaks["VmHWM"], "anon_shmem_bytes": peaks["anon_shmem"], "anon_peak_at_s": peaks["anon_at_s"]}
json.dump({"exit_code": code, "gpu_peak": gpu, "host_peak": host, "step_host_peaks": steps}, open(report, "w"))
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
    """docs/gpu.md#host-memory: peak anonymous + shared RSS <= 2 x (L + S) + A + C on CUDA (the BF16 layer
    and the student's stored layer, each being copied and read ahead; the host activation budget;
    the constant). On the CPU the device is RAM: the materialised layer adds L, and the student is
    decoded on the host (S = L)."""
    if on_cuda:
        return 2 * (layer_bytes + stored_layer_bytes) + ram_budget_bytes + HOST_CONSTANT_BYTES
    return 5 * layer_bytes + ram_budget_bytes + HOST_CONSTANT_BYTES


def held_peak(host: dict) -> tuple[int, bool]:
    """The peak of anonymous + shared RSS, what the bound of docs/gpu.md#host-memory covers (torch's
    page-locked host memory is a shared mapping: the kernel counts it as RssShmem, not RssAnon),
    and whether it was sampled as that sum (True) or bounded by VmHWM, which adds the file-backed
    pages (False: a run recorded before the sum was sampled)."""
    if host.get("anon_shmem_bytes"):
        return host["anon_shmem_bytes"], True
    return host.get("hwm_bytes", 0), False


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
    evict(src)
    _, cold_read_s = read_all(src)  # the disk's own cold-read rate, for the projection's floor
    evicted = evict(src)
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
    held, _ = held_peak(host)
    log(f"N={layers}: peak host RSS anonymous + shared {held / 1e9:.2f} GB (bound {bound / 1e9:.2f} GB: "
        f"{'within' if held <= bound else 'OVER'}): anonymous {host.get('anon_bytes', 0) / 1e9:.2f} GB, shared (page-locked) "
        f"{host.get('shmem_bytes', 0) / 1e9:.2f} GB; file-backed {host.get('file_bytes', 0) / 1e9:.2f} GB, VmHWM {host.get('hwm_bytes', 0) / 1e9:.2f} GB")
    calibration = json.loads((out / "reports" / "calibration.json").read_text())
    fidelity = json.loads((out / "reports" / "fidelity.json").read_text())
    if not args.keep:
        shutil.rmtree(src), shutil.rmtree(out)
    return {"layers": layers, "source_bytes": source_bytes, "export_bytes": export_bytes, "build_s": build_s,
            "source_evicted": evicted, "source_cold_read_s": cold_read_s, "step_seconds": steps, "steps_total_s": sum(steps.values()), "wall_s": stats.wall_s,
            "cpu_s": stats.cpu_s, "peak_rss_bytes": int(stats.peak_rss_mib * 2**20), "gpu_peak": child.get("gpu_peak"),
            "host_peak": host, "step_host_peaks": child.get("step_host_peaks"), "layer_bytes": layer_bytes, "stored_layer_bytes": stored_layer_bytes, "host_anon_bound_bytes": bound,
            "calibration_tokens": calibration.get("tokens"), "fidelity_tokens": _fidelity_tokens(fidelity)}


def _fidelity_tokens(doc: dict) -> int | None:
    return (doc.get("data") or {}).get("tokens")


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}


def part_seconds(run: dict, part: str) -> float | None:
    """A run's seconds of one step, of the whole process (``wall``) or of the time outside the steps
    (process start and the content hashes)."""
    if part == "wall":
        return run["wall_s"]
    if part == OUTSIDE:
        return run["wall_s"] - sum(run["step_seconds"].values())
    return run["step_seconds"].get(part)


def projection(small: dict, large: dict, layers: int = FULL_LAYERS, disk: dict | None = None) -> dict:
    """Per step: the per-layer and fixed costs from two sizes, and the cost at ``layers``; then the
    same with every part's per-layer cost floored by its cold reads (:func:`cold_floors`)."""
    span = large["layers"] - small["layers"]
    rows = {}
    for part in [*STEPS, OUTSIDE, "wall"]:
        a, b = part_seconds(small, part), part_seconds(large, part)
        if a is None or b is None:
            continue
        per_layer = (b - a) / span
        fixed = a - small["layers"] * per_layer
        rows[part] = {"fixed_s": fixed, "per_layer_s": per_layer, f"projected_{layers}_s": fixed + layers * per_layer}
    per_layer_bytes = {what: (large[f"{what}_bytes"] - small[f"{what}_bytes"]) / span for what in ("source", "export")}
    return {"layers": layers, "from": [small["layers"], large["layers"]], "steps": rows,
            "source_bytes_projected": small["source_bytes"] + (layers - small["layers"]) * per_layer_bytes["source"],
            "bytes_per_layer": per_layer_bytes, "cold_read": cold_floors(rows, per_layer_bytes, cold_read_rates(small, large, disk), layers),
            "assumptions": list(ASSUMPTIONS)}


def cold_read_rates(small: dict, large: dict, disk: dict | None) -> list[dict]:
    """The cold-read rate (bytes/s) to floor with: the disk's own, timed in the runs, or ``disk``
    given (none: no floor). The time outside the steps bounds no rate since the source's hash runs
    beside calibrate."""
    timed = [r for r in (small, large) if r.get("source_cold_read_s")]
    if timed:
        rate = sum(r["source_bytes"] for r in timed) / sum(r["source_cold_read_s"] for r in timed)
        return [{"name": "disk", "bytes_per_s": rate, "how": "a timed cold read of each source before its run"}]
    if disk:
        return [{"name": "disk", "bytes_per_s": disk["gbps"] * 1e9, "how": disk["how"]}]
    return []


def cold_floors(rows: dict, per_layer_bytes: dict, rates: list[dict], layers: int) -> list[dict]:
    """For each rate: every reading part's per-layer floor (its bytes per layer / the rate), its
    floored per-layer cost (the larger of measured and floor) and the wall at ``layers`` with the
    floors added back."""
    floored = []
    for rate in rates:
        parts, added = {}, 0.0
        for part, reads in READS.items():
            if part not in rows:
                continue
            read = sum(per_layer_bytes[what] for what in reads)
            floor = read / rate["bytes_per_s"]
            cost = max(rows[part]["per_layer_s"], floor)
            added += cost - rows[part]["per_layer_s"]
            parts[part] = {"reads": list(reads), "read_bytes_per_layer": read, "floor_s": floor, "per_layer_s": cost}
        wall = rows["wall"]
        floored.append({**rate, "parts": parts, "per_layer_s": wall["per_layer_s"] + added,
                        f"projected_{layers}_s": wall[f"projected_{layers}_s"] + layers * added})
    return floored


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
             "- **Goal:** the projected 48-layer pipeline ≤ 15 minutes on one H100, cold reads included; peak host RSS "
             "within its bound (docs/gpu.md#host-memory)",
             "- **Raw data:** [data/pipeline-real/](data/pipeline-real/) (`pipeline-real.json`)", ""]
    lines += ["| step | " + " | ".join(f"N={r['layers']} (s)" for r in runs) + " |", "|---|" + "---|" * len(runs)]
    for step in STEPS:
        lines.append(f"| {step} | " + " | ".join(f"{r['step_seconds'].get(step, float('nan')):.1f}" for r in runs) + " |")
    rows = (("pipeline process wall", lambda r: f"{r['wall_s']:.1f}"), ("source GB (BF16)", lambda r: f"{r['source_bytes'] / 1e9:.2f}"),
            ("export GB", lambda r: f"{r['export_bytes'] / 1e9:.2f}"), ("peak host RSS GB (ru_maxrss)", lambda r: f"{r['peak_rss_bytes'] / 1e9:.2f}"),
            ("peak anonymous RSS GB", lambda r: _gb(r["host_peak"].get("anon_bytes"))),
            ("peak shared RSS GB (page-locked)", lambda r: _gb(r["host_peak"].get("shmem_bytes"))),
            ("peak anonymous + shared GB", lambda r: _held_cell(r["host_peak"])),
            ("its bound GB (docs/gpu.md#host-memory)", lambda r: _gb(r["host_anon_bound_bytes"])),
            ("peak file-backed RSS GB", lambda r: _gb(r["host_peak"].get("file_bytes"))),
            ("peak GPU allocated GB", lambda r: _gb((r["gpu_peak"] or {}).get("allocated_bytes"))),
            ("peak GPU reserved GB", lambda r: _gb((r["gpu_peak"] or {}).get("reserved_bytes"))),
            ("calibration tokens", lambda r: f"{r['calibration_tokens']:,}"), ("build (synth) s", lambda r: f"{r['build_s']:.1f}"))
    lines += [f"| {name} | " + " | ".join(cell(r) for r in runs) + " |" for name, cell in rows]
    if doc.get("projection"):
        lines += projection_markdown(doc["projection"])
    return "\n".join(lines) + "\n"


def projection_markdown(p: dict) -> list[str]:
    """The projection's table (plain and floored per-layer costs), its totals and assumptions."""
    n, floors = p["layers"], p.get("cold_read") or []
    projected = f"projected_{n}_s"
    lines = ["", f"Projection to {n} layers from N = {p['from'][0]} and {p['from'][1]} (source "
             f"{p['source_bytes_projected'] / 1e9:.1f} GB; per layer: source {p['bytes_per_layer']['source'] / 1e9:.2f} GB, "
             f"export {p['bytes_per_layer']['export'] / 1e9:.2f} GB). Floored: per layer, the larger of the "
             "measured cost and the bytes read / the cold-read rate.", "",
             "| part | fixed s | per layer s | reads GB/layer | " + " | ".join(f"floored, {f['name']}" for f in floors) + " | projected s |",
             "|---|---|---|---|" + "---|" * len(floors) + "---|"]
    for part, row in p["steps"].items():
        reads = floors[0]["parts"].get(part) if floors else None
        cells = [f"{row['fixed_s']:.1f}", f"{row['per_layer_s']:.2f}",
                 "" if reads is None else f"{reads['read_bytes_per_layer'] / 1e9:.2f}"]
        cells += [_floored_cell(f, part) for f in floors] + [f"{row[projected]:.0f}"]
        lines.append(f"| {part} | " + " | ".join(cells) + " |")
    lines += ["", f"- **{n} layers, plain: {_minutes(p['steps']['wall'][projected])}**"]
    lines += [f"- **with the cold-read floor, {f['name']} ({f['bytes_per_s'] / 1e9:.2f} GB/s: {f['how']}): "
              f"{_minutes(f[projected])}**" for f in floors]
    return lines + ["", "Assumptions:", ""] + [f"- {a}" for a in p["assumptions"]]


def _floored_cell(floor: dict, part: str) -> str:
    if part == "wall":
        return f"{floor['per_layer_s']:.2f}"
    return f"{floor['parts'][part]['per_layer_s']:.2f}" if part in floor["parts"] else ""


def _minutes(seconds: float) -> str:
    return f"{seconds:.0f} s ({seconds / 60:.1f} min; goal ≤ 15 min: {'met' if seconds <= 15 * 60 else 'not met'})"


def _width(shrink: int) -> str:
    return "full width" if shrink == 1 else f"widths / {shrink}"


def _held_cell(host: dict) -> str:
    held, sampled = held_peak(host)
    return _gb(held) if sampled else f"≤ {_gb(held)} (VmHWM)"


def _gb(value: int | None) -> str:
    return "-" if value is None else f"{value / 1e9:.2f}"


def parse_args() -> argparse.Namespace:
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
    parser.add_argument("--report-only", type=Path, metavar="JSON",
                        help="run nothing: recompute the projection of a recorded pipeline-real.json and rewrite both files to --out")
    parser.add_argument("--disk-gbps", type=float, help="a cold-read rate measured elsewhere on the same node (GB/s), for a run "
                        "that timed none")
    parser.add_argument("--disk-how", default="given with --disk-gbps", help="where --disk-gbps was measured")
    args = parser.parse_args()
    if args.tiny:
        args.shrink, args.layers, args.calib_samples, args.calib_seq_len = 16, "2,3", 8, 64
        args.fidelity_samples, args.fidelity_seq_len = 2, 64
    return args


def write(doc: dict, out: Path) -> None:
    """Recompute the projection from the runs (two or more), then write the JSON and the section."""
    if len(doc["runs"]) >= 2:
        doc["projection"] = projection(doc["runs"][0], doc["runs"][-1], disk=doc.get("disk_read"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "pipeline-real.json").write_text(json.dumps(doc, indent=2) + "\n")
    (out / "pipeline-real.md").write_text(markdown(doc))


def main() -> None:
    args = parse_args()
    disk = {"gbps": args.disk_gbps, "how": args.disk_how} if args.disk_gbps else None
    if args.report_only:
        doc = json.loads(args.report_only.read_text())
        doc["disk_read"] = disk or doc.get("disk_read")
        write(doc, args.out)
        print(markdown(doc))
        return
    command = "python3 benchmarks/bench_pipeline_real.py " + " ".join(sys.argv[1:])
    doc = {"preset": PRESET, "recipe": RECIPE, "shrink": args.shrink, "command": command.strip(), "machine": machine(),
           "disk_read": disk, "runs": [], "projection": None}
    with tempfile.TemporaryDirectory(dir=args.work) as scratch:
        for layers in sorted(int(n) for n in args.layers.split(",")):
            doc["runs"].append(run_one(Path(scratch), layers, args))
            write(doc, args.out)
            log(f"N={layers}: steps {doc['runs'][-1]['step_seconds']}")
    print(markdown(doc))


if __name__ == "__main__":
    main()
