"""`fp4forge quantize` against llm-compressor's fastest path (data-free NVFP4A16 through
`model_free_ptq`), same machine, same run, same scheme and the same Linears (checked on the
outputs), on shape-true laguna-s-2.1-like synthetic checkpoints.

Per checkpoint it measures the raw read rate of the source files (uncached, after evicting them
from the page cache with posix_fadvise(DONTNEED), and cached), then runs each arm with the source
evicted ("uncached") and, for fp4forge, again with it in the page cache ("cached"):

* fp4forge (this checkout), default options (error report on, every core, the fused C element
  kernel for NVFP4 min-max when it builds: the summary names it);
* fp4forge --no-error-report;
* fp4forge with the kernel switched off (``FP4FORGE_KERNEL=eager``: the eager torch element path,
  same bytes, checked), uncached;
* optionally fp4forge from another source tree (``--baseline-src``, e.g. an export of the
  commit before a change), for before/after in one run;
* llm-compressor ``model_free_ptq(scheme="NVFP4A16")`` (its defaults: CPU, one worker).

Reported per arm: wall seconds, GB/s of BF16 input, CPU seconds (user + system of the process),
GB per CPU-second, peak RSS, and the ratios to llm-compressor.

Every uncached arm runs between two raw reads of the source (each after eviction) and is reported
as a share of their mean: a cloud VM's "uncached" disk rate moves between runs (its host caches
below the guest's page cache), so only a share measured beside the arm means anything.

The raw read is not the export's whole I/O: it also writes its output (2.6 GB for the 2-layer
checkpoint) to the same disk while reading. So the bench also runs, each between raw reads:

* the job's I/O bound: the source read as the raw read does while another thread writes the
  output's size to the output's disk in step with it, with the exporter's background
  ``fdatasync`` every 256 MiB (no computing at all: no export on this disk can beat it);
* fp4forge writing its output to /dev/shm (RAM): the export without the output competing for the
  disk;
* fp4forge with its compute threads 5 nice steps below the reader and the writer
  (``FP4FORGE_COMPUTE_NICE=5``; the default runs every thread at the process's priority).

    .venv/bin/python benchmarks/bench_quantize.py [--layers 1 2 | --source DIR] [--lc-venv .venv-lc] [--baseline-src DIR] [--no-lc] [--repeat N] [--no-bound] [--shm DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._util import OUT, REPO, drop_page_cache, run_measured, summarize  # noqa: E402

# NVFP4A16 on every Linear but lm_head, the router and Laguna's per-head gate, in both tools.
RECIPE = """
name = "nvfp4a16-like-model-free-ptq"
[[rules]]
components = ["routed_experts", "shared_expert", "attention", "dense_mlp"]
scheme = "nvfp4a16"
ignore = ['re:.*\\.self_attn\\.g_proj$']
"""
# model_free_ptq quantizes every 2-D weight its targets match by name; fp4forge's recipe names
# components, which never include the embeddings: ignore those too, so both quantize the same set.
LC_IGNORE = ["lm_head", "re:.*embed_tokens$", "re:.*mlp\\.gate$", "re:.*self_attn\\.g_proj$"]


def synth(layers: int) -> Path:
    out = OUT / f"synth-laguna-s-2.1-like-L{layers}"
    if not (out / "config.json").exists():
        stats = run_measured([sys.executable, "-m", "fp4forge.cli", "testbed", "synth", str(out), "--config", "laguna-s-2.1-like", "--layers", str(layers), "--json"], env=_env(REPO / "src"))
        assert stats.returncode == 0, "synth failed"
    return out


def _env(src: Path, **extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(src), **extra}


def evict(ckpt: Path) -> None:
    for path in ckpt.glob("*.safetensors"):
        drop_page_cache(path)


def read_all(ckpt: Path) -> float:
    files = sorted(ckpt.glob("*.safetensors"))
    size = sum(p.stat().st_size for p in files)
    buffer = bytearray(16 * 2**20)
    start = time.perf_counter()
    for path in files:
        with open(path, "rb", buffering=0) as fh:
            while fh.readinto(buffer):
                pass
    return size / 1e9 / (time.perf_counter() - start)


def shard_digests(out: Path) -> dict[str, str]:
    digests = {}
    for path in sorted(out.glob("*.safetensors")):
        h = hashlib.sha256()
        with open(path, "rb") as fh:
            while chunk := fh.read(16 * 2**20):
                h.update(chunk)
        digests[path.name] = h.hexdigest()
    return digests


def quantized_modules(out: Path) -> set[str]:
    from safetensors import safe_open

    names: set[str] = set()
    for path in out.glob("*.safetensors"):
        with safe_open(path, "pt") as fh:
            names.update(name.rsplit(".", 1)[0] for name in fh.keys() if name.endswith(".weight_packed"))
    return names


def run_fp4forge(src_tree: Path, src: Path, out: Path, cached: bool, extra: list[str], env: dict[str, str] | None = None):
    recipe = OUT / "bench-recipe.toml"
    recipe.write_text(RECIPE)
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(out.parent / f".{out.name}.partial", ignore_errors=True)  # a killed run's: never resume it
    if cached:
        read_all(src)
    else:
        evict(src)
    cmd = [sys.executable, "-m", "fp4forge.cli", "quantize", str(src), str(out), "--recipe", str(recipe), "--json", *extra]
    stats = run_measured(cmd, env=_env(src_tree, **(env or {})))
    assert stats.returncode == 0, f"fp4forge quantize failed: {stats.stderr[-2000:]!r}"
    return stats


def run_llm_compressor(lc_venv: Path, src: Path, out: Path, cached: bool):
    shutil.rmtree(out, ignore_errors=True)
    if cached:
        read_all(src)
    else:
        evict(src)
    code = f"from llmcompressor import model_free_ptq;model_free_ptq({str(src)!r}, {str(out)!r}, scheme='NVFP4A16', ignore={LC_IGNORE!r})"
    stats = run_measured([str(lc_venv / "bin" / "python"), "-c", code])
    assert stats.returncode == 0, f"llm-compressor model_free_ptq failed: {stats.stderr[-2000:]!r}"
    return stats


def io_bound(src: Path, out_bytes: int, out_dir: Path) -> tuple[float, float]:
    """Read the source (evicted first) as :func:`read_all` does while a second thread writes
    ``out_bytes`` into a file of ``out_dir`` in step with the reading, synced in the background every
    256 MiB like the exporter's writeback and fsynced at the end: the export's I/O without its
    computing. Returns (GB/s of input over the whole job, GB/s of the reading alone)."""
    import queue
    import threading
    from concurrent.futures import ThreadPoolExecutor

    files = sorted(src.glob("*.safetensors"))
    size = sum(p.stat().st_size for p in files)
    evict(src)
    target = out_dir / ".io-bound.bin"
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    steps: queue.Queue = queue.Queue(maxsize=64)
    writeback_every = 256 << 20

    def write() -> None:
        block = os.urandom(16 << 20)  # not zeros: a host may turn zero writes into cheap unmaps
        pending, running = 0, None
        with ThreadPoolExecutor(max_workers=1) as syncer:
            while (n := steps.get()) is not None:
                while n > 0:
                    k = os.write(fd, memoryview(block)[: min(n, len(block))])
                    n -= k
                    pending += k
                    if pending >= writeback_every and (running is None or running.done()):
                        pending, running = 0, syncer.submit(os.fdatasync, fd)
        os.fsync(fd)

    writer = threading.Thread(target=write)
    buffer = bytearray(16 * 2**20)
    written = 0
    try:
        start = time.perf_counter()
        writer.start()
        read = 0
        for path in files:
            with open(path, "rb", buffering=0) as fh:
                while n := fh.readinto(buffer):
                    read += n
                    share = out_bytes * read // size - written  # the output's bytes in step with the input's
                    written += share
                    steps.put(share)
        read_s = time.perf_counter() - start
        steps.put(out_bytes - written)
        steps.put(None)
        writer.join()
        total_s = time.perf_counter() - start
    finally:
        os.close(fd)
        target.unlink(missing_ok=True)
    return size / 1e9 / total_s, size / 1e9 / read_s


def output_bytes(out: Path) -> int:
    return sum(p.stat().st_size for p in out.glob("*.safetensors"))


def raw_read(src: Path) -> float:
    """One raw read of the source files after evicting them (GB/s): the disk's rate for this run."""
    evict(src)
    return read_all(src)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, nargs="+", default=[1])
    parser.add_argument("--source", type=Path, help="an existing laguna-s-2.1-like synth checkpoint to use instead of building one per --layers (read only)")
    parser.add_argument("--lc-venv", type=Path, default=REPO / ".venv-lc")
    parser.add_argument("--no-lc", action="store_true", help="fp4forge arms only")
    parser.add_argument("--baseline-src", type=Path, help="a src/ tree of another fp4forge version, run as one more arm (uncached, every repeat)")
    parser.add_argument("--uncached-only", action="store_true", help="skip the cached fp4forge arms")
    parser.add_argument("--no-eager", action="store_true", help="skip the eager element path arm")
    parser.add_argument("--repeat", type=int, default=1, help="uncached fp4forge (and baseline) arms, each between two raw reads")
    parser.add_argument("--no-bound", action="store_true", help="skip the I/O-bound arm, the /dev/shm output arm and the niced arm")
    parser.add_argument("--shm", type=Path, default=Path("/dev/shm"), help="a RAM file system for the output of the /dev/shm arm")
    args = parser.parse_args()
    load_before = os.getloadavg()
    # build (or load) the element kernel once, outside the timed arms
    warm = run_measured([sys.executable, "-c", "from fp4forge.numerics.nvfp4_kernel import kernel_status; print(kernel_status())"], env=_env(REPO / "src"))
    print(f"element kernel: {warm.stdout.decode().strip()} ({warm.wall_s:.1f} s)", flush=True)
    rows = []
    sources = [(args.source, None)] if args.source else [(synth(layers), layers) for layers in args.layers]
    for src, layers in sources:
        layers = layers if layers is not None else json.loads((src / "config.json").read_text()).get("num_hidden_layers")
        gb = sum(p.stat().st_size for p in src.glob("*.safetensors")) / 1e9
        # The "uncached" rate of a cloud VM's disk moves from run to run (a first read after eviction ran at
        # 0.2-0.6 GB/s, repeats at 0.6-2.7 GB/s: the host caches below the guest's page cache). So every
        # uncached arm runs between two raw reads, each after eviction, and is compared with their mean.
        raws: list[float] = [raw_read(src)]
        read_cached = read_all(src)
        print(f"L{layers}: {gb:.2f} GB BF16 | raw read uncached {raws[0]:.3f} GB/s, cached {read_cached:.3f} GB/s", flush=True)
        arms = []
        ours = OUT / f"q-fp4forge-L{layers}"
        eager_out = OUT / f"q-fp4forge-eager-L{layers}"
        base_out = OUT / f"q-fp4forge-baseline-L{layers}"
        plan = []
        for _ in range(args.repeat):
            plan.append(("fp4forge", REPO / "src", [], False))
            if args.baseline_src:
                plan.append(("fp4forge baseline", args.baseline_src, [], False))
        if not args.no_bound:
            plan += [("I/O bound: raw read + writing the output's size", None, [], False)]
            if args.shm.is_dir() and shutil.disk_usage(args.shm).free > 4 * gb * 1e9 / 6.5 + 2e9:
                plan += [("fp4forge, output in RAM (/dev/shm)", REPO / "src", [], False)]
            else:
                print(f"  (no /dev/shm arm: {args.shm} is missing or has too little room)", flush=True)
            plan += [("fp4forge, compute threads niced", REPO / "src", [], False)]
        plan += [
            ("fp4forge", REPO / "src", [], True),
            ("fp4forge --no-error-report", REPO / "src", ["--no-error-report"], False),
            ("fp4forge --no-error-report", REPO / "src", ["--no-error-report"], True),
            *([] if args.no_eager else [("fp4forge eager element path", REPO / "src", [], False)]),
        ]
        digests: dict[str, dict[str, str]] = {}
        for label, tree, extra, cached in plan:
            if cached and args.uncached_only:
                continue
            if tree is None:  # the I/O bound: no process, no imports
                rate, read_rate = io_bound(src, output_bytes(ours), ours.parent)
                raws.append(raw_read(src))
                disk = (raws[-2] + raws[-1]) / 2
                arms.append({"label": label, "source": "uncached", "stats": None, "rate": rate, "disk": disk})
                print(f"  {label}: {rate:.3f} GB/s of input (the reads alone {read_rate:.3f}); raw reads around it {raws[-2]:.3f} / {raws[-1]:.3f} GB/s: {100 * rate / disk:.0f} % of their mean", flush=True)
                continue
            eager = label.endswith("eager element path")
            in_ram = label.endswith("(/dev/shm)")
            out = base_out if label.endswith("baseline") else eager_out if eager else args.shm / f"fp4forge-bench-{os.getpid()}" if in_ram else ours
            env = {"FP4FORGE_KERNEL": "eager"} if eager else {"FP4FORGE_COMPUTE_NICE": "5"} if label.endswith("niced") else None
            try:
                stats = run_fp4forge(tree, src, out, cached, extra, env)
                digest = shard_digests(out)
            finally:
                if in_ram:
                    shutil.rmtree(out, ignore_errors=True)
            result = json.loads(stats.stdout)
            inside = result["seconds"]  # from the start of quantize_checkpoint: no imports
            row = {"label": label, "source": "cached" if cached else "uncached", "stats": stats, "inside_s": inside}
            note = ""
            if not cached:
                raws.append(raw_read(src))
                disk = (raws[-2] + raws[-1]) / 2  # the raw reads just before and just after this arm
                row["disk"] = disk
                note = f"; raw reads around it {raws[-2]:.3f} / {raws[-1]:.3f} GB/s: {100 * gb / inside / disk:.0f} % of their mean"
            arms.append(row)
            if out == ours and label in digests and digests[label] != digest:
                raise AssertionError(f"{label}: two runs wrote different shards")
            digests[label] = digest
            row["rate"] = gb / inside
            print(
                f"  {label} ({row['source']}): {stats.wall_s:.1f} s wall, {stats.cpu_s:.1f} s CPU, peak {stats.peak_rss_mib:.0f} MiB; "
                f"after start-up {inside:.1f} s = {gb / inside:.3f} GB/s{note}; element kernel {result.get('element_kernel', '?')}",
                flush=True,
            )
        reference = digests["fp4forge"]
        for label, digest in digests.items():
            same = digest == reference
            print(f"  shards byte-identical, {label} vs fp4forge: {same}", flush=True)
            assert same, f"{label}'s shards differ from fp4forge's"
        ours_modules = quantized_modules(ours)
        if not args.no_lc:
            theirs = OUT / f"q-lc-L{layers}"
            stats = run_llm_compressor(args.lc_venv, src, theirs, cached=False)
            raws.append(raw_read(src))
            arms.append({"label": "llm-compressor model_free_ptq", "source": "uncached", "stats": stats, "disk": (raws[-2] + raws[-1]) / 2})
            print(f"  llm-compressor (uncached): {stats.wall_s:.1f} s wall, {stats.cpu_s:.1f} s CPU, peak {stats.peak_rss_mib:.0f} MiB; raw read after it {raws[-1]:.3f} GB/s", flush=True)
            lc_modules = quantized_modules(theirs)
            assert ours_modules == lc_modules, f"the tools quantized different Linears: only fp4forge {sorted(ours_modules - lc_modules)[:5]}, only llm-compressor {sorted(lc_modules - ours_modules)[:5]}"
            print(f"  both quantized the same {len(ours_modules)} Linears", flush=True)
        print(f"  raw uncached reads, in run order: {' '.join(f'{r:.3f}' for r in raws)} GB/s ({summarize(raws)})", flush=True)
        rows.append((layers, gb, raws, read_cached, arms))
    # what each tool's process pays before its first byte: the imports (same run, same load)
    ours_start = run_measured([sys.executable, "-c", "import fp4forge.cli, fp4forge.quantize.export, fp4forge.report.tables"], env=_env(REPO / "src"))
    print(f"start-up (imports) fp4forge: {ours_start.wall_s:.1f} s wall, {ours_start.cpu_s:.1f} s CPU", flush=True)
    if not args.no_lc:
        lc_start = run_measured([str(args.lc_venv / "bin" / "python"), "-c", "import llmcompressor; from llmcompressor import model_free_ptq"])
        print(f"start-up (imports) llm-compressor: {lc_start.wall_s:.1f} s wall, {lc_start.cpu_s:.1f} s CPU", flush=True)
    load_after = os.getloadavg()
    print(f"load average (1/5/15 min) before {'/'.join(f'{x:.2f}' for x in load_before)}, after {'/'.join(f'{x:.2f}' for x in load_after)}; {os.cpu_count()} CPUs")

    print("\n| layers | BF16 GB | source | tool | wall s | GB/s | after start-up GB/s | % of the raw reads around it | % of the I/O bound | CPU s | GB per CPU-s | peak RSS MiB | GB/s vs llm-compressor | RSS vs llm-compressor |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for layers, gb, raws, cac, arms in rows:
        lc = next((a["stats"] for a in arms if a["label"].startswith("llm-compressor")), None)
        # the I/O bound's own share of the raw reads around it: an arm's share over this one is its
        # share of what the disk can do for this job (reads and output writes together)
        bound = next((100 * a["rate"] / a["disk"] for a in arms if a["stats"] is None), None)
        for arm in arms:
            s = arm["stats"]
            rate = arm.get("rate") or gb / s.wall_s
            share = 100 * rate / arm["disk"] if "disk" in arm else None
            of_bound = f"{100 * share / bound:.0f} %" if share is not None and bound else "—"
            share_text = f"{share:.0f} %" if share is not None else "—"
            if s is None:
                print(f"| {layers} | {gb:.2f} | {arm['source']} | {arm['label']} | | | {rate:.3f} | {share_text} | {of_bound} | | | | | |")
                continue
            speed = f"x{lc.wall_s / s.wall_s:.2f}" if lc else "—"
            rss = f"{s.peak_rss_mib / lc.peak_rss_mib:.2f}" if lc else "—"
            inside = f"{gb / arm['inside_s']:.3f}" if "inside_s" in arm else "—"
            print(f"| {layers} | {gb:.2f} | {arm['source']} | {arm['label']} | {s.wall_s:.1f} | {gb / s.wall_s:.3f} | {inside} | {share_text} | {of_bound} | {s.cpu_s:.1f} | {gb / s.cpu_s:.3f} | {s.peak_rss_mib:,.0f} | {speed} | {rss} |")
        print(f"| {layers} | {gb:.2f} | uncached | raw read of the files ({len(raws)}×, median, min–max) | | {statistics.median(raws):.3f} ({min(raws):.3f}–{max(raws):.3f}) | | | | | | | | |")
        print(f"| {layers} | {gb:.2f} | cached | raw read of the files | | {cac:.3f} | | | | | | | | |")


if __name__ == "__main__":
    main()
