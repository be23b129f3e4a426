"""How `fp4forge audit` scales with the number of routed experts: the corpus entry
`deepseek-r1-nvfp4-modelopt` (tests/corpus) rebuilt header-only with its config's
`n_routed_experts` set to each count asked for (256 is the release), audited in process.

Everything else stays the release's: 61 layers, the MTP layer, the 489-entry ModelOpt exclude
list, NVFP4 everywhere it declares. So the tensor count grows with the expert count alone, and the
audit's time per tensor says whether the routed experts cost what the other tensors cost.

    .venv/bin/python benchmarks/bench_audit_vs_experts.py [--experts 8 32 64 128 256] [--runs 3]

Each count: one audit to warm up (skeleton cache, page cache), then ``--runs`` timed ones in the
same process (wall time, `time.perf_counter`); the median and the microseconds per tensor are
printed. Checkpoints are kept under ``benchmarks/out/audit-vs-experts/`` (file holes: a few MB).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._util import OUT  # noqa: E402

ENTRY = Path(__file__).resolve().parent.parent / "tests" / "corpus" / "deepseek-r1-nvfp4-modelopt"
SHARD_BYTES = 5_000_000_000


def build(experts: int, root: Path) -> Path:
    from fp4forge.testbed.corpus import build_header_only, load_entry

    out = root / f"experts-{experts}"
    if (out / "config.json").exists():
        return out
    entry_dir = root / f"entry-{experts}"
    shutil.rmtree(entry_dir, ignore_errors=True)
    shutil.copytree(ENTRY, entry_dir)
    config = json.loads((entry_dir / "config.json").read_text())
    config["n_routed_experts"] = experts
    (entry_dir / "config.json").write_text(json.dumps(config, indent=2))
    return build_header_only(load_entry(entry_dir), out, max_shard_bytes=SHARD_BYTES)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, nargs="+", default=[8, 32, 64, 128, 256])
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()

    from fp4forge.audit.engine import audit_checkpoint

    root = OUT / "audit-vs-experts"
    print(f"{'experts':>8} {'tensors':>8} {'shards':>6} {'audit s (median)':>17} {'us/tensor':>10}  findings")
    for experts in args.experts:
        ckpt = build(experts, root)
        tensors = len(json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"])
        shards = len(list(ckpt.glob("*.safetensors")))
        report = audit_checkpoint(ckpt)  # warm-up
        times = []
        for _ in range(args.runs):
            start = time.perf_counter()
            audit_checkpoint(ckpt)
            times.append(time.perf_counter() - start)
        median = statistics.median(times)
        rules = sorted({f.rule for f in report.findings})
        print(f"{experts:>8} {tensors:>8,} {shards:>6} {median:>17.3f} {median / tensors * 1e6:>10.2f}  {', '.join(rules)}")


if __name__ == "__main__":
    main()
