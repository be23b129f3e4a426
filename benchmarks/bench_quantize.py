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

    .venv/bin/python benchmarks/bench_quantize.py [--layers 1 2] [--lc-venv .venv-lc] [--baseline-src DIR] [--no-lc]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._util import OUT, REPO, drop_page_cache, run_measured  # noqa: E402

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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, nargs="+", default=[1])
    parser.add_argument("--lc-venv", type=Path, default=REPO / ".venv-lc")
    parser.add_argument("--no-lc", action="store_true", help="fp4forge arms only")
    parser.add_argument("--baseline-src", type=Path, help="a src/ tree of another fp4forge version, run as one more arm")
    parser.add_argument("--uncached-only", action="store_true", help="skip the cached fp4forge arms")
    args = parser.parse_args()
    # build (or load) the element kernel once, outside the timed arms
    warm = run_measured([sys.executable, "-c", "from fp4forge.numerics.nvfp4_kernel import kernel_status; print(kernel_status())"], env=_env(REPO / "src"))
    print(f"element kernel: {warm.stdout.decode().strip()} ({warm.wall_s:.1f} s)", flush=True)
    rows = []
    for layers in args.layers:
        src = synth(layers)
        gb = sum(p.stat().st_size for p in src.glob("*.safetensors")) / 1e9
        evict(src)
        read_uncached = read_all(src)
        read_cached = read_all(src)
        print(f"L{layers}: {gb:.2f} GB BF16 | read uncached {read_uncached:.3f} GB/s, cached {read_cached:.3f} GB/s", flush=True)
        arms = []
        ours = OUT / f"q-fp4forge-L{layers}"
        eager_out = OUT / f"q-fp4forge-eager-L{layers}"
        for label, tree, extra, cached in [
            ("fp4forge", REPO / "src", [], False),
            ("fp4forge", REPO / "src", [], True),
            ("fp4forge --no-error-report", REPO / "src", ["--no-error-report"], False),
            ("fp4forge --no-error-report", REPO / "src", ["--no-error-report"], True),
            ("fp4forge eager element path", REPO / "src", [], False),
            *([("fp4forge baseline", args.baseline_src, [], False)] if args.baseline_src else []),
        ]:
            if cached and args.uncached_only:
                continue
            eager = label.endswith("eager element path")
            out = OUT / f"q-fp4forge-baseline-L{layers}" if label.endswith("baseline") else eager_out if eager else ours
            stats = run_fp4forge(tree, src, out, cached, extra, {"FP4FORGE_KERNEL": "eager"} if eager else None)
            arms.append((label, "cached" if cached else "uncached", stats))
            result = json.loads(stats.stdout)
            inside = result["seconds"]  # from the start of quantize_checkpoint: no imports
            print(
                f"  {label} ({arms[-1][1]}): {stats.wall_s:.1f} s wall, {stats.cpu_s:.1f} s CPU, peak {stats.peak_rss_mib:.0f} MiB; "
                f"after start-up {inside:.1f} s = {gb / inside:.3f} GB/s; element kernel {result.get('element_kernel', '?')}",
                flush=True,
            )
        same = shard_digests(ours) == shard_digests(eager_out)
        print(f"  shards byte-identical, kernel vs eager element path: {same}", flush=True)
        assert same, "the kernel's shards differ from the eager path's"
        ours_modules = quantized_modules(ours)
        if args.baseline_src:
            same = shard_digests(ours) == shard_digests(OUT / f"q-fp4forge-baseline-L{layers}")
            print(f"  shards byte-identical to the baseline's: {same}", flush=True)
            assert same, "the shards differ from the baseline's"
        if not args.no_lc:
            theirs = OUT / f"q-lc-L{layers}"
            stats = run_llm_compressor(args.lc_venv, src, theirs, cached=False)
            arms.append(("llm-compressor model_free_ptq", "uncached", stats))
            print(f"  llm-compressor (uncached): {stats.wall_s:.1f} s wall, {stats.cpu_s:.1f} s CPU, peak {stats.peak_rss_mib:.0f} MiB", flush=True)
            lc_modules = quantized_modules(theirs)
            assert ours_modules == lc_modules, f"the tools quantized different Linears: only fp4forge {sorted(ours_modules - lc_modules)[:5]}, only llm-compressor {sorted(lc_modules - ours_modules)[:5]}"
            print(f"  both quantized the same {len(ours_modules)} Linears", flush=True)
        rows.append((layers, gb, read_uncached, read_cached, arms))
    # what each tool's process pays before its first byte: the imports (same run, same load)
    ours_start = run_measured([sys.executable, "-c", "import fp4forge.cli, fp4forge.quantize.export, fp4forge.report.tables"], env=_env(REPO / "src"))
    print(f"start-up (imports) fp4forge: {ours_start.wall_s:.1f} s wall, {ours_start.cpu_s:.1f} s CPU", flush=True)
    if not args.no_lc:
        lc_start = run_measured([str(args.lc_venv / "bin" / "python"), "-c", "import llmcompressor; from llmcompressor import model_free_ptq"])
        print(f"start-up (imports) llm-compressor: {lc_start.wall_s:.1f} s wall, {lc_start.cpu_s:.1f} s CPU", flush=True)

    print("\n| layers | BF16 GB | source | tool | wall s | GB/s | CPU s | GB per CPU-s | peak RSS MiB | GB/s vs llm-compressor | RSS vs llm-compressor |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for layers, gb, unc, cac, arms in rows:
        lc = next((s for label, _, s in arms if label.startswith("llm-compressor")), None)
        for label, source, s in arms:
            speed = f"x{lc.wall_s / s.wall_s:.2f}" if lc else "—"
            rss = f"{s.peak_rss_mib / lc.peak_rss_mib:.2f}" if lc else "—"
            print(f"| {layers} | {gb:.2f} | {source} | {label} | {s.wall_s:.1f} | {gb / s.wall_s:.3f} | {s.cpu_s:.1f} | {gb / s.cpu_s:.3f} | {s.peak_rss_mib:,.0f} | {speed} | {rss} |")
        print(f"| {layers} | {gb:.2f} | uncached / cached | raw read of the files | | {unc:.3f} / {cac:.3f} | | | | | |")


if __name__ == "__main__":
    main()
