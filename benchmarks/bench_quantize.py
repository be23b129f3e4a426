"""`fp4forge quantize` against llm-compressor's fastest path (data-free NVFP4A16 through
`model_free_ptq`), same machine, same run, same scheme and targets, on shape-true
laguna-s-2.1-like synthetic checkpoints with N = 2 and N = 4 layers.

Reports wall time, GB/s of BF16 read, peak RSS, their ratios, and the raw read rate of the same
files (uncached, after evicting them from the page cache, and cached) as the physical limit.
Every quantizer run starts with the source evicted from the page cache.

    .venv/bin/python benchmarks/bench_quantize.py [--layers 2 4] [--lc-venv .venv-lc]
"""

from __future__ import annotations

import argparse
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
LC_IGNORE = ["lm_head", "re:.*mlp\\.gate$", "re:.*self_attn\\.g_proj$"]


def synth(layers: int) -> Path:
    out = OUT / f"synth-laguna-s-2.1-like-L{layers}"
    if not (out / "config.json").exists():
        fp4forge = str(Path(sys.executable).parent / "fp4forge")
        stats = run_measured([fp4forge, "testbed", "synth", str(out), "--config", "laguna-s-2.1-like", "--layers", str(layers), "--json"])
        assert stats.returncode == 0, "synth failed"
        size = sum(p.stat().st_size for p in out.glob("*.safetensors"))
        print(f"synth L{layers}: {size / 1e9:.2f} GB in {stats.wall_s:.1f} s ({size / 1e9 / stats.wall_s:.3f} GB/s)")
    return out


def evict(ckpt: Path) -> None:
    for path in ckpt.glob("*.safetensors"):
        drop_page_cache(path)


def read_rate(ckpt: Path, cached: bool) -> float:
    files = sorted(ckpt.glob("*.safetensors"))
    if not cached:
        evict(ckpt)
    size = sum(p.stat().st_size for p in files)
    start = time.perf_counter()
    for path in files:
        with open(path, "rb", buffering=0) as fh:
            while fh.readinto(buffer := bytearray(16 * 2**20)) or 0:
                pass
    return size / 1e9 / (time.perf_counter() - start)


def run_fp4forge(src: Path, out: Path) -> tuple[float, float]:
    recipe = OUT / "bench-recipe.toml"
    recipe.write_text(RECIPE)
    shutil.rmtree(out, ignore_errors=True)
    evict(src)
    fp4forge = str(Path(sys.executable).parent / "fp4forge")
    stats = run_measured([fp4forge, "quantize", str(src), str(out), "--recipe", str(recipe), "--json"])
    assert stats.returncode == 0, "fp4forge quantize failed"
    return stats.wall_s, stats.peak_rss_mib


def run_llm_compressor(lc_venv: Path, src: Path, out: Path) -> tuple[float, float]:
    shutil.rmtree(out, ignore_errors=True)
    evict(src)
    code = (
        "from llmcompressor import model_free_ptq;"
        f"model_free_ptq({str(src)!r}, {str(out)!r}, scheme='NVFP4A16', ignore={LC_IGNORE!r})"
    )
    stats = run_measured([str(lc_venv / "bin" / "python"), "-c", code])
    assert stats.returncode == 0, "llm-compressor model_free_ptq failed"
    return stats.wall_s, stats.peak_rss_mib


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--lc-venv", type=Path, default=REPO / ".venv-lc")
    args = parser.parse_args()
    rows = []
    for layers in args.layers:
        src = synth(layers)
        size = sum(p.stat().st_size for p in src.glob("*.safetensors"))
        uncached, cached = read_rate(src, cached=False), read_rate(src, cached=True)
        ours_wall, ours_rss = run_fp4forge(src, OUT / f"q-fp4forge-L{layers}")
        lc_wall, lc_rss = run_llm_compressor(args.lc_venv, src, OUT / f"q-lc-L{layers}")
        rows.append((layers, size, uncached, cached, ours_wall, ours_rss, lc_wall, lc_rss))
        print(
            f"L{layers}: {size / 1e9:.2f} GB BF16 | read uncached {uncached:.3f} GB/s, cached {cached:.3f} GB/s | "
            f"fp4forge {ours_wall:.1f} s ({size / 1e9 / ours_wall:.3f} GB/s, peak {ours_rss:.0f} MiB) | "
            f"llm-compressor {lc_wall:.1f} s ({size / 1e9 / lc_wall:.3f} GB/s, peak {lc_rss:.0f} MiB) | "
            f"speed-up x{lc_wall / ours_wall:.2f}, RSS ratio {ours_rss / lc_rss:.2f}",
            flush=True,
        )
    print("\n| layers | BF16 GB | read uncached GB/s | read cached GB/s | fp4forge s | fp4forge GB/s | fp4forge peak RSS MiB | llm-compressor s | llm-compressor GB/s | llm-compressor peak RSS MiB | speed-up |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for layers, size, unc, cac, ow, orss, lw, lrss in rows:
        gb = size / 1e9
        print(f"| {layers} | {gb:.2f} | {unc:.3f} | {cac:.3f} | {ow:.1f} | {gb / ow:.3f} | {orss:.0f} | {lw:.1f} | {gb / lw:.3f} | {lrss:.0f} | x{lw / ow:.2f} |")


if __name__ == "__main__":
    main()
