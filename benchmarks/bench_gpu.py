"""fp4forge on one GPU: calibration beside llm-compressor, export against the disk, fidelity, and
CUDA-vs-CPU equality, in one run (the lent machine keeps nothing between runs).

Phases (each writes its JSON into ``--out`` as soon as it ends, so a run stopped by its time
limit keeps what it measured; optional phases are skipped when ``--budget-s`` runs short):

1. **model**: full-width ``laguna-s-2.1-like`` layers (256 experts, hidden 3072; layer 0 dense as
   in the preset), written by ``synth_checkpoint`` with its values drawn on the GPU (Student-t, 4
   dof, seeded per tensor; the CPU generator would take minutes for 16 GB).
2. **disk**: the shards flushed and evicted from the page cache (``posix_fadvise DONTNEED``),
   then read once with 64 MiB reads: the disk read bandwidth; a second read gives the cached
   rate, so the eviction is visible in the numbers.
3. **calibrate**: ``calibrate_checkpoint`` on CUDA (tokens/s, ``torch.cuda.max_memory_allocated``),
   then llm-compressor's ``oneshot`` (NVFP4, sequential pipeline, all experts calibrated) in a
   child process on the same GPU, the same checkpoint and the very same token ids.
4. **export**: ``quantize_checkpoint`` on CUDA from evicted shards (cold) and again (cached),
   GB/s of BF16 read; then on the CPU; sha256 of every output shard compared.
5. **equality**: calibration on CUDA and on the CPU over the same (smaller) token set; every amax
   compared (equal count, max relative difference).
6. **fidelity**: ``evaluate`` teacher vs the CUDA export on CUDA, tokens/s.

    python3 benchmarks/bench_gpu.py --out $OUT --layers 4 --samples 128 --seq-len 2048   # on the H200
    python3 benchmarks/bench_gpu.py --out $OUT --skip calibrate,cached-export --export-variants 256:4:256:0,128:4:256:1   # exports only

**Share of the disk** (``--pairs N``, default 3): after the first disk read, N cold exports with the
default settings alternate with N more cold disk reads; each export is set against the read just
before it and the mean of the two around it, and ``pairs.json`` holds every pair and the medians
(the lent disk's rate moves by a third between runs: one pair is not a measurement).

Each export records the caller's time in the writer's ``write`` and in the final fsync + rename;
``--export-variants BATCH_MIB:READ_THREADS:WRITEBACK_MIB[:WILLNEED[:COALESCED[:REQUEST_MIB]]]``
adds cold GPU exports with other settings of the batched path (all compared by sha256 with the
CPU export; a field left out keeps the exporter's default; COALESCED 0 reads tensor by tensor).
    python benchmarks/bench_gpu.py --tiny --out /tmp/bench-gpu                            # CPU smoke test

The llm-compressor arm runs ``FP4FORGE_LC_PYTHON`` (default: this interpreter) with
llm-compressor importable: on a machine without it, install its wheels first (llmcompressor
0.14.0.1, compressed-tensors 0.19.0, auto-round 0.15.1, loguru, pydantic + pydantic-core +
annotated-types + typing-inspection, datasets + dill + multiprocess) with
``pip install --no-deps --target DIR`` and put DIR on ``PYTHONPATH``; ``--skip lc`` leaves it out.
Results of the recorded runs: benchmarks/RESULTS.md ("GPU calibration against llm-compressor",
"GPU export against the disk").
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
PRESET = "laguna-s-2.1-like"
STARTED = time.perf_counter()


def elapsed() -> float:
    return time.perf_counter() - STARTED


def log(*parts: object) -> None:
    print(f"[{elapsed():7.1f}s]", *parts, flush=True)


def save(out: Path, name: str, doc: object) -> None:
    (out / f"{name}.json").write_text(json.dumps(doc, indent=2, default=str) + "\n")


# -- 1. the model ----------------------------------------------------------------------------------
def gpu_synthetic_tensor(spec, seed: int, **_: object) -> torch.Tensor:
    """Student-t (4 dof) values, std 0.02 (norm gains near 1), seeded per tensor, drawn on the GPU."""
    from fp4forge.testbed import synth

    device = "cuda" if torch.cuda.is_available() else "cpu"
    generator = torch.Generator(device=device).manual_seed(synth._tensor_seed(seed, spec.name))
    n = math.prod(spec.shape)
    normal = torch.randn(n, generator=generator, device=device)
    chi2 = torch.empty(2 * n, device=device).exponential_(generator=generator)
    values = normal / torch.sqrt((chi2[:n] + chi2[n:]) * (2.0 / synth.STUDENT_T_DOF))
    values = values * (synth.WEIGHT_STD / math.sqrt(2.0)) + (1.0 if spec.name.endswith("norm.weight") else 0.0)
    return values.to(synth.SAFETENSORS_TO_TORCH[spec.dtype]).reshape(spec.shape).cpu()


def build_model(work: Path, layers: int, tiny: bool) -> tuple[Path, Path]:
    """(checkpoint directory, tokenizer directory)."""
    from fp4forge.testbed import build_tiny_laguna, build_tokenizer, synth

    if tiny:
        src = work / "tiny-laguna"
        if not src.exists():
            build_tiny_laguna(src, seed=0)
        return src, src
    tokenizer = work / "tokenizer"
    if not (tokenizer / "tokenizer.json").exists():
        build_tokenizer().save_pretrained(tokenizer)
    src = work / f"synth-{PRESET}-L{layers}"
    if not (src / "config.json").exists():  # synth writes its own tokenizer; the token ids come from `tokenizer`
        synth.synthetic_tensor = gpu_synthetic_tensor  # the writer looks it up at call time
        synth.synth_checkpoint(PRESET, layers, src, seed=0)
    return src, tokenizer


def token_ids(tokenizer_dir: Path, samples: int, seq_len: int, split: str = "calibration") -> tuple[torch.Tensor, str]:
    """The built-in corpus as the testbed tokenizer writes it; seeded random ids where it is short."""
    from fp4forge.errors import ConfigError
    from fp4forge.model.samples import load_samples, load_tokenizer

    try:
        return load_samples(load_tokenizer(tokenizer_dir), samples=samples, seq_len=seq_len, split=split).input_ids, f"builtin:{split}"
    except ConfigError:
        return torch.randint(3, 4096, (samples, seq_len), generator=torch.Generator().manual_seed(0)), "random ids < 4096 (seed 0)"


# -- 2. the disk -----------------------------------------------------------------------------------
def shards(path: Path) -> list[Path]:
    return sorted(path.glob("*.safetensors"))


def evict(paths: list[Path]) -> bool:
    ok = True
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError:
            ok = False
        finally:
            os.close(fd)
    return ok


def read_all(paths: list[Path], block: int = 64 << 20) -> tuple[int, float]:
    total, start = 0, time.perf_counter()
    buffer = bytearray(block)
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(buffer):
                total += n
    return total, time.perf_counter() - start


def disk_phase(src: Path) -> dict:
    files = shards(src)
    evicted = evict(files)
    cold_bytes, cold_s = read_all(files)
    warm_bytes, warm_s = read_all(files)
    return {"bytes": cold_bytes, "evicted": evicted, "cold_s": cold_s, "cold_gb_per_s": cold_bytes / 1e9 / cold_s, "cached_s": warm_s, "cached_gb_per_s": warm_bytes / 1e9 / warm_s}


# -- 3. calibration --------------------------------------------------------------------------------
def calibrate(src: Path, ids: torch.Tensor, source: str, device: str, batch_size: int, policy: str = "routed", budget: int | None = None):
    from fp4forge.calibrate import CalibrationOptions, calibrate_checkpoint
    from fp4forge.model.samples import Samples

    options = CalibrationOptions(samples=ids.shape[0], seq_len=ids.shape[1], batch_size=batch_size, policy=policy, device=device, activation_budget_bytes=budget)
    return calibrate_checkpoint(src, options, samples=Samples.from_rows(ids, (source,)))


LC_SCRIPT = r"""
import json, sys, time, torch
from datasets import Dataset
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import QuantizationModifier
from transformers import AutoModelForCausalLM, AutoTokenizer
src, ids_path, tokenizer_dir, batch_size = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
ids = torch.load(ids_path).tolist()
cuda = torch.cuda.is_available()
if cuda:
    torch.cuda.reset_peak_memory_stats()
t0 = time.perf_counter()
model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
t1 = time.perf_counter()
dataset = Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * len(x) for x in ids]})
recipe = QuantizationModifier(targets="Linear", scheme="NVFP4", ignore=["lm_head", "re:.*mlp\\.gate$", "re:.*self_attn\\.g_proj$"])
kwargs = dict(model=model, tokenizer=AutoTokenizer.from_pretrained(tokenizer_dir), recipe=recipe, dataset=dataset, num_calibration_samples=len(ids),
              max_seq_length=len(ids[0]), shuffle_calibration_samples=False, moe_calibrate_all_experts=True, pipeline="sequential")
try:
    oneshot(batch_size=batch_size, **kwargs)
except TypeError:
    oneshot(**kwargs)
if cuda:
    torch.cuda.synchronize()
t2 = time.perf_counter()
print(json.dumps({"load_s": t1 - t0, "oneshot_s": t2 - t1, "tokens": len(ids) * len(ids[0]), "peak_gpu_bytes": torch.cuda.max_memory_allocated() if cuda else None,
                  "peak_gpu_reserved_bytes": torch.cuda.max_memory_reserved() if cuda else None, "device_of_first_param_after": str(next(model.parameters()).device)}))
"""


LC_PYTHON = os.environ.get("FP4FORGE_LC_PYTHON", sys.executable)  # on the GPU machine: this python, wheels on PYTHONPATH


def llm_compressor(src: Path, ids: torch.Tensor, tokenizer: Path, work: Path, batch_size: int, timeout_s: float) -> dict:
    ids_path = work / "lc-ids.pt"
    torch.save(ids, ids_path)
    start = time.perf_counter()
    try:
        proc = subprocess.run([LC_PYTHON, "-c", LC_SCRIPT, str(src), str(ids_path), str(tokenizer), str(batch_size)], capture_output=True, text=True, timeout=timeout_s,
                              env={**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
    except subprocess.TimeoutExpired as stopped:
        return {"error": f"stopped after {timeout_s:.0f} s", "stderr_tail": (stopped.stderr or b"")[-3000:].decode(errors="replace") if isinstance(stopped.stderr, bytes) else str(stopped.stderr)[-3000:]}
    wall = time.perf_counter() - start
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"error": f"exit {proc.returncode}", "wall_s": wall, "stderr_tail": proc.stderr[-4000:]}
    doc = json.loads(lines[-1])
    return {**doc, "wall_s": wall, "tokens_per_s_oneshot": doc["tokens"] / doc["oneshot_s"], "tokens_per_s_with_load": doc["tokens"] / (doc["load_s"] + doc["oneshot_s"])}


# -- 4. export -------------------------------------------------------------------------------------
def schedule_of_variant(variant: str):
    """``BATCH_MIB:READ_THREADS:WRITEBACK_MIB[:WILLNEED[:COALESCED[:REQUEST_MIB]]]`` as an
    ``ExportSchedule`` (a huge writeback = none before the final fsync; WILLNEED and COALESCED
    0/1); a field left out keeps the exporter's default."""
    import dataclasses

    from fp4forge.quantize.schedule import ExportSchedule

    knobs = ("device_batch_bytes", "device_read_threads", "writeback_bytes", "willneed_hint", "device_coalesced_reads", "device_read_request_bytes")
    units = (1 << 20, 1, 1 << 20, 1, 1, 1 << 20)  # MiB, count, MiB, 0/1, 0/1, MiB
    defaults = ExportSchedule()
    fields = [int(x) for x in variant.split(":")]
    return dataclasses.replace(defaults, **{k: type(getattr(defaults, k))(f * u) for k, f, u in zip(knobs, fields, units)})


def export(src: Path, out: Path, stats: Path | None, device: str, schedule=None) -> dict:
    import shutil

    from fp4forge.quantize.act_scales import StatsAmax
    from fp4forge.quantize.export import QuantizeOptions, quantize_checkpoint
    from fp4forge.quantize.recipe import load_recipe

    if out.exists():
        shutil.rmtree(out)
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    from fp4forge.checkpoint.writer import CheckpointWriter

    from fp4forge.quantize.act_scales import ConstantAmax

    act_amax = StatsAmax(stats) if stats is not None else ConstantAmax(8.0)
    options = QuantizeOptions(recipe=load_recipe("nvfp4-all-linear"), act_amax=act_amax, device=device)
    spent = {"write_s": 0.0, "finish_s": 0.0}
    plain_write, plain_finish = CheckpointWriter.write, CheckpointWriter._finish

    def timed(key, fn):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[key] += time.perf_counter() - start

        return wrapper

    # where the caller's thread spends the export: writing tensors into the shards, and the final
    # fsync + rename (the rest is waiting for reads / the device, and the companions)
    CheckpointWriter.write, CheckpointWriter._finish = timed("write_s", plain_write), timed("finish_s", plain_finish)
    cpu_before = os.times()
    try:
        summary = quantize_checkpoint(src, out, options, schedule=schedule)
    finally:
        CheckpointWriter.write, CheckpointWriter._finish = plain_write, plain_finish
    cpu_after = os.times()
    cpu_s = (cpu_after.user - cpu_before.user) + (cpu_after.system - cpu_before.system)  # this process's threads, user + sys
    doc = {"device": device, "seconds": summary.seconds, "cpu_s": cpu_s, "bytes_read": summary.bytes_read, "bytes_written": summary.bytes_written, "read_gb_per_s": summary.read_gb_per_s, **spent}
    if device.startswith("cuda"):
        doc["peak_gpu_bytes"] = torch.cuda.max_memory_allocated()
    doc["sha256"] = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in shards(out)}
    return doc


# -- 5. equality -----------------------------------------------------------------------------------
def compare_stats(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict:
    """Per group (routed experts; everything else): how many amax tensors are equal, and the
    relative differences' median / p99 / max."""
    assert a.keys() == b.keys()
    groups: dict[str, list[float]] = {"routed_experts": [], "other": []}
    worst: dict[str, tuple[float, str | None]] = {g: (0.0, None) for g in groups}
    for name in a:
        x, y = a[name].double(), b[name].double()
        rel = float(((x - y).abs() / y.abs().clamp_min(1e-30)).max())
        group = "routed_experts" if ".experts." in name else "other"
        groups[group].append(rel)
        if rel > worst[group][0]:
            worst[group] = (rel, name)
    out = {}
    for group, values in groups.items():
        t = torch.tensor(values or [0.0], dtype=torch.float64)
        out[group] = {"tensors": len(values), "equal": sum(v == 0.0 for v in values), "median": float(t.median()), "p99": float(torch.quantile(t, 0.99)),
                      "max": float(t.max()), "worst": worst[group][1]}
    return out


def routing_difference(a: dict, b: dict) -> dict:
    """Token-expert assignments that differ between two runs (per layer: half the L1 distance of the counts)."""
    moved = total = 0
    for layer, counts in a.get("tokens_per_expert", {}).items():
        x, y = torch.tensor(counts), torch.tensor(b["tokens_per_expert"][layer])
        moved += int((x - y).abs().sum()) // 2
        total += int(x.sum())
    return {"token_expert_pairs": total, "moved": moved, "moved_fraction": moved / total if total else 0.0}


def export_profile(src: Path, stats: Path, device: str, units_wanted: int, out: Path) -> dict:
    """Where a GPU export's time goes, on one MoE layer's first units: reading (two ways), the
    numerics alone on device-resident weights, read + numerics on one thread, on the export's pool;
    and a cProfile of the one-thread path."""
    import cProfile
    import io
    import pstats
    from concurrent.futures import ThreadPoolExecutor

    from fp4forge.checkpoint.layout import layout_for_config
    from fp4forge.checkpoint.reader import open_checkpoint
    from fp4forge.model.streaming import CheckpointTensors
    from fp4forge.quantize import export as ex
    from fp4forge.quantize.act_scales import StatsAmax
    from fp4forge.quantize.schedule_cpu import process_units
    from fp4forge.quantize.unit import quantize_unit, read_unit
    from fp4forge.quantize.plan import plan_export
    from fp4forge.quantize.recipe import load_recipe

    ckpt = open_checkpoint(src)
    options = ex.QuantizeOptions(recipe=load_recipe("nvfp4-all-linear"), act_amax=StatsAmax(stats), device=device)
    plan = plan_export(ex._source_specs(ckpt), layout_for_config(ckpt.config), options.recipe, options.layout_format)
    units = [u for u in plan.units if u.linears and ".experts." in u.linears[0].module][:units_wanted]
    quantizer = ex.UnitQuantizer(options)
    names = [f"{t.module}.weight" for u in units for t in u.linears]
    nbytes = sum(ckpt.locate(n)[1].nbytes for n in names)
    doc: dict = {"units": len(units), "bytes": nbytes}

    def timed(label, fn):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        doc[label] = {"seconds": seconds, "gb_per_s": nbytes / 1e9 / seconds}

    direct = CheckpointTensors(ckpt)
    timed("read_tensor_1_thread", lambda: [ckpt.read_tensor(n) for n in names])
    timed("read_host_1_thread", lambda: [direct.read_host(n, False) for n in names])
    with ThreadPoolExecutor(16) as pool:
        timed("read_tensor_16_threads", lambda: list(pool.map(ckpt.read_tensor, names)))
    weights = [{t.module: ckpt.read_tensor(f"{t.module}.weight").to(device) for t in u.linears} for u in units]
    timed("numerics_only_1_thread", lambda: [{k: v.cpu() for k, v in quantizer.quantize(u, w)[0].items()} for u, w in zip(units, weights)])
    weights.clear()
    timed("read_and_numerics_1_thread", lambda: [quantize_unit(read_unit(u, ckpt), quantizer) for u in units])
    for workers in (4, 16):
        timed(f"read_and_numerics_{workers}_workers", lambda: list(process_units(units, ckpt, quantizer, workers, ex.ExportSchedule())))
    profiler = cProfile.Profile()
    profiler.enable()
    for u in units[: max(1, len(units) // 3)]:
        quantize_unit(read_unit(u, ckpt), quantizer)
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(30)
    (out / "export_profile.txt").write_text(text.getvalue())
    return doc


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--work", type=Path, default=Path("/tmp/fp4forge-bench-gpu"))
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--samples", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lc-batch-size", type=int, default=8)
    parser.add_argument("--equality-samples", type=int, default=2)
    parser.add_argument("--fidelity-samples", type=int, default=16)
    parser.add_argument("--profile-units", type=int, default=96)
    parser.add_argument("--budget-s", type=float, default=540.0, help="skip optional phases once this much time is used")
    parser.add_argument("--skip", default="", help="comma-separated phases to skip: calibrate (the exports then use a constant activation amax; implies warm,profile,lc,equality,fidelity,all-experts),cached-export,warm,profile,lc,all-experts,cpu-export,equality,fidelity")
    parser.add_argument("--export-variants", default="", help="more cold GPU exports, comma-separated BATCH_MIB:READ_THREADS:WRITEBACK_MIB[:WILLNEED[:COALESCED[:REQUEST_MIB]]] (e.g. 256:4:256:0:0 = tensor-by-tensor reads; fields left out keep the defaults)")
    parser.add_argument("--cpu-reference", type=Path, default=None, help="with --skip cpu-export: the export.json of an earlier run over the same source whose CPU export's sha256 the GPU exports are compared with")
    parser.add_argument("--pairs", type=int, default=3, help="cold disk reads and cold GPU exports, alternating (disk, export, disk, ..., disk): every export's share of the read before it and of the mean around it, and the medians (0: one cold export against the first disk read)")
    parser.add_argument("--tiny", action="store_true", help="the tiny Laguna testbed on whatever device there is (a smoke test of this script)")
    args = parser.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    if "calibrate" in skip:
        skip |= {"warm", "profile", "lc", "equality", "fidelity", "all-experts"}
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.set_num_threads(os.cpu_count() or 1)
    env = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__, "cpus": os.cpu_count(), "args": vars(args)}
    import transformers

    env["transformers"] = transformers.__version__
    save(args.out, "env", env)
    log("env", env)

    mark = time.perf_counter()
    src, tokenizer = build_model(args.work, args.layers, args.tiny)
    size = sum(p.stat().st_size for p in shards(src))
    save(args.out, "model", {"source": str(src), "layers": args.layers, "bytes": size, "build_s": time.perf_counter() - mark, "tiny": args.tiny})
    log(f"model: {size / 1e9:.2f} GB in {time.perf_counter() - mark:.1f} s")

    disk = disk_phase(src)
    save(args.out, "disk", disk)
    log("disk", disk)

    ids, id_source = token_ids(tokenizer, args.samples, args.seq_len)
    stats_path: Path | None = None  # None: the exports take a constant activation amax (--skip calibrate)
    calib: dict = {}
    if "calibrate" not in skip:
        evict(shards(src))
        result = calibrate(src, ids, id_source, device, args.batch_size)
        stats_path = args.work / "stats.safetensors"
        from fp4forge.checkpoint.stats import write_stats

        write_stats(stats_path, result.tensors, result.metadata)
        calib = {"fp4forge_routed": {**result.summary(), "timings": result.timings, "token_source": id_source}}
        save(args.out, "calibrate", calib)
        log("fp4forge calibrate", {k: v for k, v in calib["fp4forge_routed"].items() if k not in ("timings", "experts_without_tokens")})

    exports: dict = {}
    if args.pairs:
        # The lent disk's cold rate moved by a third between runs minutes apart (1.37-1.81 GB/s): one
        # disk read and one export give a share that is mostly noise. So: disk, export, disk, export, ...,
        # disk, every read and every export from evicted shards; each export against the read just
        # before it (its pair) and against the mean of the reads on both sides; medians over the pairs.
        reads = [disk["cold_gb_per_s"]]
        pairs = []
        for i in range(args.pairs):
            key = "cold" if i == 0 else f"cold #{i + 1}"
            evict(shards(src))
            exports[key] = export(src, args.work / "export-gpu", stats_path, device)
            again = disk_phase(src)
            reads.append(again["cold_gb_per_s"])
            rate = exports[key]["read_gb_per_s"]
            pairs.append({"export": key, "disk_before_gb_per_s": reads[-2], "export_gb_per_s": rate, "disk_after_gb_per_s": reads[-1],
                          "share_of_disk_before": rate / reads[-2], "share_of_disk_around": rate / ((reads[-2] + reads[-1]) / 2)})
            log(f"pair {i + 1}: disk {reads[-2]:.3f} GB/s, export {rate:.3f} GB/s = {100 * rate / reads[-2]:.1f} % (disk after {reads[-1]:.3f})")
            save(args.out, "pairs", {"disk_reads_gb_per_s": reads, "pairs": pairs})
            save(args.out, "export", exports)
        summary = {
            "disk_reads_gb_per_s": reads,
            "pairs": pairs,
            "median_share_of_disk_before": statistics.median(p["share_of_disk_before"] for p in pairs),
            "median_share_of_disk_around": statistics.median(p["share_of_disk_around"] for p in pairs),
            "median_export_gb_per_s": statistics.median(p["export_gb_per_s"] for p in pairs),
            "median_disk_gb_per_s": statistics.median(reads),
        }
        save(args.out, "pairs", summary)
        for pair in pairs:
            print(f"PAIR {pair['export']:<8} disk {pair['disk_before_gb_per_s']:.3f} -> export {pair['export_gb_per_s']:.3f} GB/s = {100 * pair['share_of_disk_before']:.1f} % "
                  f"(disk after {pair['disk_after_gb_per_s']:.3f}; {100 * pair['share_of_disk_around']:.1f} % of the mean around it)", flush=True)
        print(f"MEDIAN share {100 * summary['median_share_of_disk_before']:.1f} % of the disk read before (of the mean around: {100 * summary['median_share_of_disk_around']:.1f} %); "
              f"median export {summary['median_export_gb_per_s']:.3f} GB/s, median disk {summary['median_disk_gb_per_s']:.3f} GB/s over {len(reads)} reads", flush=True)
    else:
        evict(shards(src))
        exports["cold"] = export(src, args.work / "export-gpu", stats_path, device)
    if "cached-export" not in skip:
        exports["cached"] = export(src, args.work / "export-gpu", stats_path, device)
    save(args.out, "export", exports)
    for variant in filter(None, args.export_variants.split(",")):
        evict(shards(src))
        exports[f"cold {variant}"] = export(src, args.work / "export-gpu", stats_path, device, schedule_of_variant(variant))
        save(args.out, "export", exports)
        log(f"export cold {variant}", {k: v for k, v in exports[f"cold {variant}"].items() if k != "sha256"})
    log("export", {k: {kk: vv for kk, vv in v.items() if kk != "sha256"} for k, v in exports.items()})

    if "warm" not in skip:
        warm = calibrate(src, ids, id_source, device, args.batch_size)  # the shards are in the page cache now
        calib["fp4forge_routed_cached"] = {**warm.summary(), "timings": warm.timings}
        save(args.out, "calibrate", calib)
        log("fp4forge calibrate (cached source)", {k: v for k, v in calib["fp4forge_routed_cached"].items() if k not in ("timings", "experts_without_tokens")})

    if "profile" not in skip and device == "cuda":
        profile = export_profile(src, stats_path, device, args.profile_units, args.out)
        exports["profile"] = profile
        save(args.out, "export", exports)
        log("export profile", profile)

    if "lc" not in skip and elapsed() < args.budget_s - 60:
        evict(shards(src))  # cold, as fp4forge's first run
        calib["llm_compressor"] = llm_compressor(src, ids, tokenizer, args.work, args.lc_batch_size, timeout_s=max(60.0, args.budget_s - 150 - elapsed()))
        save(args.out, "calibrate", calib)
        log("llm-compressor", {k: v for k, v in calib["llm_compressor"].items() if k != "stderr_tail"}, calib["llm_compressor"].get("stderr_tail", "")[-1500:])

    if device == "cuda" and "cpu-export" not in skip and elapsed() < args.budget_s - 60:
        exports["cpu"] = export(src, args.work / "export-cpu", stats_path, "cpu")
        exports["bit_identical"] = all(v["sha256"] == exports["cpu"]["sha256"] for k, v in exports.items() if k.startswith(("cold", "cached")))
        save(args.out, "export", exports)
        log("export cpu", {k: v for k, v in exports["cpu"].items() if k != "sha256"}, "bit-identical:", exports["bit_identical"])
    elif args.cpu_reference is not None:  # the CPU export of an earlier run over the same source (same --work)
        reference = json.loads(args.cpu_reference.read_text())["cpu"]["sha256"]
        exports["cpu_reference"] = str(args.cpu_reference)
        exports["bit_identical"] = all(v["sha256"] == reference for k, v in exports.items() if k.startswith(("cold", "cached")))
        save(args.out, "export", exports)
        log("bit-identical to", args.cpu_reference, ":", exports["bit_identical"])
    for key, doc in exports.items():
        if key.startswith(("cold", "cached")):
            print(f"SHARE {key:<24} {doc['read_gb_per_s']:.3f} GB/s = {100 * doc['read_gb_per_s'] / disk['cold_gb_per_s']:.1f} % of the cold disk ({disk['cold_gb_per_s']:.3f} GB/s)", flush=True)

    if "equality" not in skip and elapsed() < args.budget_s - 60:
        small = ids[: args.equality_samples]
        on_device = calibrate(src, small, id_source, device, args.batch_size)
        on_cpu = calibrate(src, small, id_source, "cpu", args.batch_size)
        equality = {"tokens": small.numel(), "device": device, "cpu_seconds": on_cpu.seconds, "device_seconds": on_device.seconds, "amax": compare_stats(on_device.tensors, on_cpu.tensors),
                    "routing": routing_difference(on_device.metadata, on_cpu.metadata)}
        save(args.out, "equality", equality)
        log("equality", equality)

    if "fidelity" not in skip and elapsed() < args.budget_s - 45:
        from fp4forge.fidelity.evaluate import FidelityOptions, evaluate

        torch.cuda.reset_peak_memory_stats() if device == "cuda" else None
        # a speed measurement: the built-in text, asked for, scored even where the model cannot read it
        options = FidelityOptions(samples=args.fidelity_samples, seq_len=args.seq_len, batch_size=max(1, args.batch_size // 4), tokenizer=tokenizer, device=device,
                                  builtin_corpus=True, allow_unreadable=True)
        try:
            report = evaluate(src, args.work / "export-gpu", options).to_json()
            fid = {"tokens": report["data"]["tokens"], "seconds": report["seconds"], "tokens_per_s": report["data"]["tokens"] / report["seconds"], "kl_mean": report["metrics"]["kl"]["mean"],
                   "top1": report["metrics"]["top1_agreement"], "peak_gpu_bytes": torch.cuda.max_memory_allocated() if device == "cuda" else None}
        except Exception as exc:  # a benchmark records what happened and goes on
            import traceback

            fid = {"error": repr(exc), "traceback": traceback.format_exc()[-3000:]}
        save(args.out, "fidelity", fid)
        log("fidelity", fid)

    if "all-experts" not in skip and elapsed() < args.budget_s - 90:
        evict(shards(src))
        every = calibrate(src, ids, id_source, device, args.batch_size, policy="all-experts")
        calib["fp4forge_all_experts"] = {**every.summary(), "timings": every.timings}
        save(args.out, "calibrate", calib)
        log("fp4forge all-experts", {k: v for k, v in calib["fp4forge_all_experts"].items() if k not in ("timings", "experts_without_tokens")})
    log("done")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "src"))
    main()
