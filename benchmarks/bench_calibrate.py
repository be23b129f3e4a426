"""Layer-streamed calibration at real scale: peak RSS (goal: flat in depth) and tokens/s.

Builds (once) shape-true synthetic checkpoints of the laguna-s-2.1-like preset with N = 2 and
N = 4 decoder layers (real names and shapes: 256 experts x 3072 hidden per MoE layer, ~4.8 GB
of BF16 each; seeded heavy-tailed values), then runs `calibrate_checkpoint` on each in a fresh
process and measures its wall time and peak RSS (ru_maxrss via wait4). The preset has no
tokenizer, so the samples are the built-in corpus rendered by the tiny testbed's tokenizer
(ids < 4096, valid in the 100,352 vocabulary); both runs use the same samples.

Optionally (``--lc``) the same model and samples go through llm-compressor's sequential
``oneshot`` NVFP4 in the llm-compressor venv (``scripts/setup-lc-venv.sh``), measured the same way
(it loads the whole model first, so it needs the whole checkpoint in RAM).

``--fidelity-tiny`` instead scores W4A4 exports of the tiny Laguna testbed with one evaluator
(`fp4forge fidelity`, held-out split, true W4A4 numerics + FP8 KV): fp4forge's own (calibrated
input and KV scales; block scales minmax and mse) beside llm-compressor's NVFP4 + FP8-KV export
(scripts/lc_export.py), the same Linears quantized in both (every Linear but lm_head, the
router and the per-head output gate g_proj).

    .venv/bin/python benchmarks/bench_calibrate.py [--layers 2 4] [--samples 4 --seq-len 256] [--lc]
    .venv/bin/python benchmarks/bench_calibrate.py --fidelity-tiny
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._util import OUT, REPO, run_measured  # noqa: E402

PRESET = "laguna-s-2.1-like"
LC_PYTHON = REPO / ".venv-lc" / "bin" / "python"


EXPERTS = {"value": None}  # --experts K: the preset with K routed experts (fits llm-compressor's whole-model load)


def synth_dir(layers: int) -> Path:
    experts = EXPERTS["value"]
    return OUT / (f"synth-{PRESET}-L{layers}" if experts is None else f"synth-{PRESET}-e{experts}-L{layers}")


def synth_source() -> str | Path:
    """The preset, or a config.json of it with fewer routed experts."""
    from fp4forge.testbed.synth import load_preset

    experts = EXPERTS["value"]
    if experts is None:
        return PRESET
    path = OUT / f"{PRESET}-e{experts}" / "config.json"
    if not path.exists():
        config = load_preset(PRESET)
        config["num_experts"] = experts
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(config, indent=2) + "\n")
    return path


def tokenizer_dir() -> Path:
    return OUT / "testbed-tokenizer"


def build_inputs(layers: list[int]) -> None:
    from fp4forge.testbed import build_tokenizer, synth_checkpoint

    if not (tokenizer_dir() / "tokenizer.json").exists():
        build_tokenizer().save_pretrained(tokenizer_dir())
    for n in layers:
        if not (synth_dir(n) / "config.json").exists():
            synth_checkpoint(synth_source(), n, synth_dir(n), seed=0)


def samples_file(samples: int, seq_len: int) -> Path:
    """The token ids every run uses, written once (so llm-compressor gets the very same)."""
    import torch

    from fp4forge.model.samples import load_samples, load_tokenizer

    path = OUT / f"calib-ids-{samples}x{seq_len}.pt"
    if not path.exists():
        torch.save(load_samples(load_tokenizer(tokenizer_dir()), samples=samples, seq_len=seq_len).input_ids, path)
    return path


def child(src: Path, ids_path: Path, batch_size: int, ram_budget_gb: float, policy: str) -> None:
    """Runs in the measured process: calibrate and print a JSON summary."""
    import torch

    from fp4forge.calibrate import CalibrationOptions, calibrate_checkpoint
    from fp4forge.model.samples import Samples

    ids = torch.load(ids_path)
    options = CalibrationOptions(samples=ids.shape[0], seq_len=ids.shape[1], batch_size=batch_size, policy=policy, ram_budget_bytes=int(ram_budget_gb * 2**30))
    result = calibrate_checkpoint(src, options, samples=Samples.from_rows(ids, ("builtin:calibration",)))
    print(json.dumps({**result.summary(), "timings": result.timings}))


LC_SCRIPT = r"""
import json, sys, time, torch
from datasets import Dataset
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import QuantizationModifier
from transformers import AutoModelForCausalLM, AutoTokenizer
src, ids_path, tokenizer_dir = sys.argv[1], sys.argv[2], sys.argv[3]
ids = torch.load(ids_path).tolist()
t0 = time.perf_counter()
model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
t1 = time.perf_counter()
dataset = Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * len(x) for x in ids]})
recipe = QuantizationModifier(targets="Linear", scheme="NVFP4", ignore=["lm_head", "re:.*mlp\\.gate$", "re:.*self_attn\\.g_proj$"])
oneshot(model=model, tokenizer=AutoTokenizer.from_pretrained(tokenizer_dir), recipe=recipe, dataset=dataset, num_calibration_samples=len(ids), max_seq_length=len(ids[0]),
        shuffle_calibration_samples=False, moe_calibrate_all_experts=True, pipeline="sequential")
t2 = time.perf_counter()
print(json.dumps({"load_s": t1 - t0, "oneshot_s": t2 - t1, "tokens": len(ids) * len(ids[0])}))
"""


def run_fp4forge(n: int, ids_path: Path, args: argparse.Namespace) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    cmd = [sys.executable, __file__, "--child", str(synth_dir(n)), str(ids_path), str(args.batch_size), str(args.ram_budget_gb), args.policy]
    stats = run_measured(cmd, env=env)
    if stats.returncode != 0:
        raise SystemExit(f"calibration of L{n} failed (exit {stats.returncode})")
    doc = json.loads(stats.stdout.decode().strip().splitlines()[-1])
    return {"tool": f"fp4forge calibrate (layer-streamed, {args.policy})", "layers": n, "wall_s": stats.wall_s, "peak_rss_mib": stats.peak_rss_mib, **doc}


def run_llm_compressor(n: int, ids_path: Path, args: argparse.Namespace) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    stats = run_measured([str(LC_PYTHON), "-c", LC_SCRIPT, str(synth_dir(n)), str(ids_path), str(tokenizer_dir())], env=env)
    doc = json.loads(stats.stdout.decode().strip().splitlines()[-1]) if stats.returncode == 0 else {}
    return {"tool": "llm-compressor oneshot NVFP4 (sequential, all experts; includes weight quantization)", "layers": n, "wall_s": stats.wall_s, "peak_rss_mib": stats.peak_rss_mib, "returncode": stats.returncode, **doc}


def checkpoint_gib(n: int) -> float:
    return sum(p.stat().st_size for p in synth_dir(n).glob("*.safetensors")) / 2**30


def markdown(rows: list[dict], args: argparse.Namespace) -> str:
    experts = "" if args.experts is None else f" with {args.experts} routed experts per MoE layer (preset: 256)"
    lines = [
        f"Calibration on the shape-true `{PRESET}` synthetic{experts}, {args.samples} samples x {args.seq_len} tokens, batch {args.batch_size}, OMP_NUM_THREADS={args.threads}:",
        "",
        "| tool | layers | checkpoint GiB | peak RSS MiB | wall s | tokens/s (calibration) |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        tps = row.get("tokens_per_s") or (row["tokens"] / row["oneshot_s"] if row.get("oneshot_s") else None)
        lines.append(f"| {row['tool']} | {row['layers']} | {checkpoint_gib(row['layers']):.2f} | {row['peak_rss_mib']:,.0f} | {row['wall_s']:.1f} | {'—' if tps is None else f'{tps:.1f}'} |")
    return "\n".join(lines) + "\n"


# What llm-compressor's targets="Linear" with lc_export.py's ignore list quantizes, as a recipe.
LC_EQUIVALENT_RECIPE = """
name = "nvfp4-like-lc-export"
description = "NVFP4 W4A4 on every Linear except lm_head, the router and g_proj (what scripts/lc_export.py quantizes)"
[[rules]]
components = ["routed_experts", "shared_expert", "attention", "dense_mlp"]
scheme = "nvfp4"
ignore = ['re:.*\\.self_attn\\.g_proj$']
"""


def fidelity_tiny(threads: int) -> list[dict]:
    """W4A4 students of the tiny Laguna, one evaluator: fp4forge (minmax, mse) vs llm-compressor."""
    import subprocess

    import torch

    from fp4forge.calibrate import CalibrationOptions, calibrate_checkpoint
    from fp4forge.calibrate import kv
    from fp4forge.fidelity.evaluate import FidelityOptions, evaluate
    from fp4forge.checkpoint.reader import open_checkpoint
    from fp4forge.checkpoint.stats import write_stats
    from fp4forge.quantize.act_scales import StatsAmax
    from fp4forge.quantize.export import QuantizeOptions, quantize_checkpoint
    from fp4forge.quantize.recipe import parse_recipe
    from fp4forge.testbed import build_tiny_laguna

    torch.set_num_threads(threads)
    root = OUT / "fidelity-tiny"
    source = root / "tiny-laguna"
    if not source.exists():
        build_tiny_laguna(source, seed=0)
    calibration = CalibrationOptions(samples=16, seq_len=256, batch_size=4)
    stats_path = root / "stats.safetensors"
    if not stats_path.exists():
        result = calibrate_checkpoint(source, calibration)
        write_stats(stats_path, result.tensors, result.metadata)
    recipe = parse_recipe(LC_EQUIVALENT_RECIPE, source="bench_calibrate")
    students = {}
    for block_scales in ("minmax", "mse"):
        out = root / f"fp4forge-{block_scales}"
        if not out.exists():
            quantize_checkpoint(source, out, QuantizeOptions(recipe=recipe, block_scales=block_scales, act_amax=StatsAmax(stats_path)))
            kv.install_kv_scales(out, kv.scales_from_stats(stats_path, kv.attention_layers(open_checkpoint(out))))
        students[f"fp4forge W4A4 + FP8 KV, calibrated, block scales {block_scales}"] = out
    lc_out = root / "llm-compressor-nvfp4-kvfp8"
    if not lc_out.exists():
        subprocess.run([str(LC_PYTHON), str(REPO / "scripts" / "lc_export.py"), str(source), str(lc_out), "--scheme", "NVFP4", "--kv-fp8", "--samples", "16", "--seq-len", "256"], check=True, env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(threads)})
    students["llm-compressor NVFP4 + FP8 KV (oneshot, 16 x 256 stdlib samples)"] = lc_out
    rows = []
    for numerics in ("w4a4", "w4a16"):
        for name, path in students.items():
            report = evaluate(source, path, FidelityOptions(samples=16, seq_len=256, batch_size=4, numerics=numerics)).to_json()
            m = report["metrics"]
            rows.append({"student": name, "numerics": numerics, "kl": m["kl"], "top1": m["top1_agreement"], "ppl": m["perplexity"], "last_layer_error": report["layers"][-1]["relative_error"], "positions": m["positions"], "kv_cache": report["kv_cache"]})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def fidelity_markdown(rows: list[dict]) -> str:
    lines = [
        "Fidelity on the tiny Laguna testbed (held-out split, 16 x 256 tokens; student numerics emulated: dequantized weights, NVFP4 activation fake-quant, FP8 KV):",
        "",
        "| student | numerics | KL mean | KL median | KL p99 | top-1 agree | ppl teacher / student | last-layer rel. error |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['student']} | {r['numerics']} | {r['kl']['mean']:.5f} | {r['kl']['median']:.5f} | {r['kl']['p99']:.5f} | {r['top1'] * 100:.1f} % | {r['ppl']['teacher']:.1f} / {r['ppl']['student']:.1f} | {r['last_layer_error']:.4f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--fidelity-tiny":
        rows = fidelity_tiny(threads=1)
        (OUT / "bench_fidelity_tiny.json").write_text(json.dumps(rows, indent=2) + "\n")
        print(fidelity_markdown(rows))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5]), sys.argv[6])
        return
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--ram-budget-gb", type=float, default=4.0)
    parser.add_argument("--lc", action="store_true", help="also run llm-compressor's oneshot (needs .venv-lc)")
    parser.add_argument("--policy", default="routed", help="MoE coverage policy: routed | all-experts (what llm-compressor's oneshot runs here)")
    parser.add_argument("--experts", type=int, default=None, help="routed experts per MoE layer (default: the preset's 256)")
    args = parser.parse_args()
    EXPERTS["value"] = args.experts
    build_inputs(args.layers)
    ids_path = samples_file(args.samples, args.seq_len)
    rows = []
    for n in args.layers:
        rows.append(run_fp4forge(n, ids_path, args))
        print(json.dumps(rows[-1]), flush=True)
        if args.lc:
            rows.append(run_llm_compressor(n, ids_path, args))
            print(json.dumps(rows[-1]), flush=True)
    suffix = ("" if args.experts is None else f"-e{args.experts}") + ("" if args.policy == "routed" else f"-{args.policy}")
    (OUT / f"bench_calibrate{suffix}.json").write_text(json.dumps(rows, indent=2) + "\n")
    print(markdown(rows, args))


if __name__ == "__main__":
    main()
