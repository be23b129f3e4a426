"""`fp4forge bytes` and `fp4forge audit` on a shape-true NVFP4 laguna-s-2.1-like checkpoint at
full scale.

Builds (once) a header-only, sparse checkpoint: the laguna-s-2.1-like preset's 48 layers planned
through the `nvfp4-experts-fp8-attn` recipe (routed experts NVFP4 W4A4, attention + shared
expert FP8, FP8 KV scales) in the ModelOpt and compressed-tensors layouts, 7 shards each.
Weights are file holes; per-tensor scales hold real values (an audit reads them). Then times
`fp4forge bytes --json` and `fp4forge audit --json` (headers only) as fresh processes (imports
included), reports wall time and peak RSS against the < 1 s goal, and the bytes a remote bytes
and audit fetch through a loopback HTTP server with Range support, as a fraction of the checkpoint.

    .venv/bin/python benchmarks/bench_header_tools.py [--runs 5]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._util import OUT, run_measured, summarize  # noqa: E402
from fp4forge.checkpoint.layout import layout_by_name  # noqa: E402
import torch  # noqa: E402

from fp4forge.checkpoint.writer import CheckpointWriter  # noqa: E402
from fp4forge.quantize.qconfig import modelopt_configs  # noqa: E402
from fp4forge.quantize.plan import plan_export  # noqa: E402
from fp4forge.quantize.recipe import load_recipe  # noqa: E402

SHARDS = 7
SCALE_VALUES = {"F32": (0.0123, torch.float32), "BF16": (0.0123, torch.bfloat16)}


def build_sparse_quantized(layout_format: str, out: Path) -> Path:
    from fp4forge.checkpoint.skeleton import checkpoint_specs
    from fp4forge.testbed.synth import load_preset

    if (out / "config.json").exists():
        return out
    config = load_preset("laguna-s-2.1-like")
    specs = checkpoint_specs(config)
    plan = plan_export(specs, layout_by_name("laguna"), load_recipe("nvfp4-experts-fp8-attn"), layout_format)
    total = sum(s.nbytes for s in plan.output_specs)
    with CheckpointWriter(out, plan.output_specs, max_shard_bytes=math.ceil(total / SHARDS) + 2**20, sparse=True) as writer:
        # Weights stay file holes; per-tensor scales get plausible values, because an audit
        # reads those (a hole reads as 0.0, which is a defect it would rightly report).
        for spec in plan.output_specs:
            if math.prod(spec.shape) == 1:
                writer.write(spec.name, torch.full(spec.shape, SCALE_VALUES[spec.dtype][0], dtype=SCALE_VALUES[spec.dtype][1]))
        config = {k: v for k, v in config.items() if not k.startswith("_")}
        config["quantization_config"] = quantization_config(plan, specs, layout_format)
        writer.write_json("config.json", config)
        if layout_format == "modelopt":
            writer.write_json("hf_quant_config.json", modelopt_configs(plan, linear_names(specs), "bench")[1])
    return out


def quantization_config(plan, specs, layout_format):
    from fp4forge.quantize.qconfig import compressed_tensors_config

    if layout_format == "compressed-tensors":
        return compressed_tensors_config(plan, linear_names(specs))
    return modelopt_configs(plan, linear_names(specs), "bench")[0]


def linear_names(specs):
    from fp4forge.quantize.export import linear_names as names

    return names(specs, layout_by_name("laguna"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    fp4forge = str(Path(sys.executable).parent / "fp4forge")
    for layout_format in ("modelopt", "compressed-tensors"):
        ckpt = build_sparse_quantized(layout_format, OUT / f"laguna-s-2.1-like-nvfp4-{layout_format}")
        shards = sorted(ckpt.glob("*.safetensors"))
        apparent = sum(p.stat().st_size for p in shards)
        for command in ("bytes", "audit"):
            if command == "audit":  # a first audit on a machine builds the skeleton cache
                cold_env = {**os.environ, "FP4FORGE_CACHE_DIR": tempfile.mkdtemp(prefix="bench-cache-")}
                cold = [run_measured([fp4forge, command, str(ckpt), "--json"], env=cold_env) for _ in range(1)]
                print(f"  audit, empty skeleton cache: wall {cold[0].wall_s:.2f} s, peak RSS {cold[0].peak_rss_mib:.0f} MiB")
            runs = [run_measured([fp4forge, command, str(ckpt), "--json"]) for _ in range(args.runs)]
            assert all(r.returncode in (0, 1) for r in runs), runs[0]
            doc = json.loads(runs[0].stdout)
            walls = [r.wall_s for r in runs]
            rss = [r.peak_rss_mib for r in runs]
            if command == "bytes":
                tensors = sum(c["tensors"] for c in doc["components"])
                print(f"{layout_format}: {tensors:,} tensors in {len(shards)} shards, {apparent / 2**30:.2f} GiB apparent")
                print(f"  headline {doc['total']['bpp']:.3f} bpp, routed experts {doc['experts_bpp']:.3f} bpp, params {doc['total']['params'] / 1e9:.2f} B")
            else:
                print(f"  audit summary {doc['summary']}, rules {sorted({f['rule'] for f in doc['findings']})}")
            print(f"  {command:5s} wall s   {summarize(walls)}   goal < 1 s -> {'met' if min(walls) < 1 else 'NOT met'}")
            print(f"  {command:5s} peak RSS {summarize(rss)} MiB", flush=True)
    remote_fraction()


def remote_fraction() -> None:
    """Bytes a remote `bytes` and a remote `audit` fetch over a loopback Range server (the
    server counts what it sends), vs checkpoint size."""
    import os

    from tests.http_repo_server import RepoServer

    ckpt = OUT / "laguna-s-2.1-like-nvfp4-modelopt"
    size = sum(p.stat().st_size for p in ckpt.iterdir())
    fp4forge = str(Path(sys.executable).parent / "fp4forge")
    with RepoServer({"bench/laguna": ckpt}) as server:
        for command in ("bytes", "audit"):
            server.bytes_sent = 0
            env = {**os.environ, "HF_ENDPOINT": server.endpoint}
            stats = run_measured([fp4forge, command, "bench/laguna", "--json"], env=env)
            print(f"remote {command}: exit {stats.returncode}, {stats.wall_s:.1f} s, fetched {server.bytes_sent:,} bytes of {size:,} ({server.bytes_sent / size:.2e} of the checkpoint)")


if __name__ == "__main__":
    main()
