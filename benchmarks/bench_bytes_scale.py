"""`fp4forge bytes` on a shape-true NVFP4 laguna-s-2.1-like checkpoint at full scale.

Builds (once) a header-only, sparse checkpoint: the laguna-s-2.1-like preset's 48 layers planned
through the `nvfp4-experts-fp8-attn` recipe (routed experts NVFP4 W4A4, attention + shared
expert FP8, FP8 KV scales) in the ModelOpt and compressed-tensors layouts, 7 shards each.
Then times `fp4forge bytes --json` as a fresh process (imports included), reports wall time and
peak RSS against the < 1 s goal, and the bytes a remote read fetches through a loopback HTTP
server with Range support, as a fraction of the checkpoint.

    .venv/bin/python benchmarks/bench_bytes_scale.py [--runs 5]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._util import OUT, run_measured, summarize  # noqa: E402
from fp4forge.checkpoint.layout import layout_by_name  # noqa: E402
from fp4forge.checkpoint.writer import CheckpointWriter  # noqa: E402
from fp4forge.quantize.plan import plan_export  # noqa: E402
from fp4forge.quantize.recipe import load_recipe  # noqa: E402

SHARDS = 7


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
        config = {k: v for k, v in config.items() if not k.startswith("_")}
        writer.write_json("config.json", config)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    fp4forge = str(Path(sys.executable).parent / "fp4forge")
    rows = []
    for layout_format in ("modelopt", "compressed-tensors"):
        ckpt = build_sparse_quantized(layout_format, OUT / f"laguna-s-2.1-like-nvfp4-{layout_format}")
        shards = sorted(ckpt.glob("*.safetensors"))
        apparent = sum(p.stat().st_size for p in shards)
        runs = [run_measured([fp4forge, "bytes", str(ckpt), "--json"]) for _ in range(args.runs)]
        assert all(r.returncode == 0 for r in runs), runs[0]
        doc = json.loads(runs[0].stdout)
        tensors = sum(c["tensors"] for c in doc["components"])
        walls = [r.wall_s for r in runs]
        rss = [r.peak_rss_mib for r in runs]
        rows.append((layout_format, tensors, len(shards), apparent, walls, rss, doc))
        print(f"{layout_format}: {tensors:,} tensors in {len(shards)} shards, {apparent / 2**30:.2f} GiB apparent")
        print(f"  wall s   {summarize(walls)}   goal < 1 s -> {'met' if min(walls) < 1 else 'NOT met'}")
        print(f"  peak RSS {summarize(rss)} MiB")
        print(f"  headline {doc['total']['bpp']:.3f} bpp, routed experts {doc['experts_bpp']:.3f} bpp, params {doc['total']['params'] / 1e9:.2f} B")
    remote_fraction()


def remote_fraction() -> None:
    """Bytes fetched by a remote `bytes` over a loopback Range server, vs checkpoint size."""
    from fp4forge.audit.byte_table import compute_byte_table
    from fp4forge.checkpoint.reader import open_checkpoint
    from tests.http_repo_server import RepoServer

    ckpt = OUT / "laguna-s-2.1-like-nvfp4-modelopt"
    size = sum(p.stat().st_size for p in ckpt.iterdir())
    with RepoServer({"bench/laguna": ckpt}) as server:
        remote = open_checkpoint(f"{server.endpoint}/bench/laguna/resolve/main")
        compute_byte_table(remote, layout_by_name("laguna"))
        fetched = remote.source.bytes_fetched
    print(f"remote: fetched {fetched:,} bytes of {size:,} ({fetched / size:.2e} of the checkpoint)")


if __name__ == "__main__":
    main()
