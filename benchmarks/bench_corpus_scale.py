"""`fp4forge bytes` and `fp4forge audit` at real-release scale: DeepSeek-R1 in ModelOpt NVFP4
(the corpus entry `deepseek-r1-nvfp4-modelopt`, tests/corpus), rebuilt header-only as
**180,730 tensors in 163 shards** (DeepSeek's own release ships 163 shards), beside a bare
header-parsing loop run in the same process and as a fresh interpreter.

Each tool runs as a fresh process (imports included): `bytes --json`; `audit --json` warm (the
expected-name skeleton cached, the page cache warm) and cold (an empty skeleton cache and the
shards evicted from the page cache first). The bare loop reads each shard's 8-byte length and
its JSON header and json-parses it: the floor any header tool pays. Ratios to it are printed.

    .venv/bin/python benchmarks/bench_corpus_scale.py [--runs 3] [--baseline-src DIR] [--bytes-only]

``--baseline-src DIR``: the same commands again with ``PYTHONPATH=DIR`` (an older tree's ``src``,
e.g. from ``git archive``), interleaved run by run with the current code, so both arms share the
machine's load. CPU seconds (user + sys of the child) are printed beside wall time: on a shared
machine they move less than wall time. ``--bytes-only`` skips the audit runs (more `bytes` runs
in the same time, when only the header path changed).

Each arm's `fp4forge` package is byte-compiled first (``compileall``, into its ignored
``__pycache__``), so the tools start as an installed package does (pip compiles at install time):
where ``PYTHONDONTWRITEBYTECODE`` is set and nothing is compiled, every run would otherwise
compile every imported module from source (the imports of `bytes` took ≈ 0.07 CPU s instead of
≈ 0.04, those of an audit ≈ 0.13 instead of ≈ 0.07, measured in process), a cost no installed
copy pays. ``--no-compile`` measures without it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import struct
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._util import OUT, drop_page_cache, run_measured, summarize  # noqa: E402

ENTRY = "deepseek-r1-nvfp4-modelopt"
SHARDS = 163
BARE_LOOP = """
import json, struct, sys, pathlib
n = 0
for shard in sorted(pathlib.Path(sys.argv[1]).glob("*.safetensors")):
    with open(shard, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        n += len(json.loads(f.read(length))) - 1
print(n)
"""


def build(out: Path) -> Path:
    from fp4forge.testbed.corpus import build_header_only, entry_specs, load_entry

    if (out / "config.json").exists():
        return out
    from fp4forge.checkpoint.writer import plan_shards

    entry = load_entry(Path(__file__).resolve().parent.parent / "tests" / "corpus" / ENTRY)
    specs = entry_specs(entry)
    # the smallest shard size the writer's greedy packing fits into SHARDS shards
    low, high = math.ceil(sum(s.nbytes for s in specs) / SHARDS), 2**40
    while low < high:
        middle = (low + high) // 2
        low, high = (low, middle) if len(plan_shards(specs, middle)) <= SHARDS else (middle + 1, high)
    return build_header_only(entry, out, max_shard_bytes=low)


def bare_in_process(ckpt: Path) -> tuple[float, int]:
    start = time.perf_counter()
    n = 0
    for shard in sorted(ckpt.glob("*.safetensors")):
        with open(shard, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            n += len(json.loads(f.read(length))) - 1
    return time.perf_counter() - start, n


def compile_package(env: dict[str, str]) -> str:
    """Byte-compile the fp4forge package the arm's environment imports; its directory."""
    import subprocess

    where = subprocess.run([sys.executable, "-c", "import fp4forge, os; print(os.path.dirname(fp4forge.__file__))"], env=env, capture_output=True, text=True, check=True).stdout.strip()
    subprocess.run([sys.executable, "-m", "compileall", "-q", where], env={**env, "PYTHONDONTWRITEBYTECODE": ""}, check=True, stdout=subprocess.DEVNULL)
    return where


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--baseline-src", type=Path, default=None, help="an older tree's src/, run side by side")
    parser.add_argument("--bytes-only", action="store_true", help="skip the audit runs")
    parser.add_argument("--no-compile", action="store_true", help="do not byte-compile the arms' packages first")
    args = parser.parse_args()
    ckpt = build(OUT / f"{ENTRY}-{SHARDS}")
    shards = sorted(ckpt.glob("*.safetensors"))
    fp4forge = str(Path(sys.executable).parent / "fp4forge")
    print(f"{ckpt.name}: {len(shards)} shards, load average {os.getloadavg()[0]:.1f}")
    arms = {"": dict(os.environ)}
    if args.baseline_src is not None:
        arms[" [baseline]"] = {**os.environ, "PYTHONPATH": str(args.baseline_src.resolve())}

    if not args.no_compile:
        for suffix, env in arms.items():
            print(f"byte-compiled{suffix}: {compile_package(env)}")

    bare = [bare_in_process(ckpt) for _ in range(args.runs)]
    tensors = bare[0][1]
    bare_proc = [run_measured([sys.executable, "-c", BARE_LOOP, str(ckpt)]) for _ in range(args.runs)]
    rows = {"bare loop, in process": [(b[0], None) for b in bare], "bare loop, fresh python": [(r.wall_s, r.cpu_s) for r in bare_proc]}
    rss: dict[str, float] = {}
    docs: dict[str, dict] = {}

    def measure(label: str, cmd: list[str], env_of) -> None:
        for suffix, env in arms.items():
            run = run_measured(cmd, env=env_of(env))
            rows.setdefault(label + suffix, []).append((run.wall_s, run.cpu_s))
            rss[label + suffix] = max(rss.get(label + suffix, 0.0), run.peak_rss_mib)
            docs[label + suffix] = {"returncode": run.returncode, "stdout": run.stdout}

    same = lambda env: env  # noqa: E731
    for _ in range(args.runs):
        measure("fp4forge bytes --json", [fp4forge, "bytes", str(ckpt), "--json"], same)
    for suffix, env in arms.items():
        assert docs["fp4forge bytes --json" + suffix]["returncode"] == 0, docs["fp4forge bytes --json" + suffix]["stdout"][:500]
    compared = ["fp4forge bytes --json"]
    if not args.bytes_only:
        for env in arms.values():
            run_measured([fp4forge, "audit", str(ckpt), "--json"], env=env)  # prime the skeleton cache
        for _ in range(args.runs):
            measure("fp4forge audit --json, warm", [fp4forge, "audit", str(ckpt), "--json"], same)
        for _ in range(args.runs):
            evicted = all(drop_page_cache(p) for p in shards)
            label = "fp4forge audit --json, cold" + ("" if evicted else " (page cache not evicted)")
            measure(label, [fp4forge, "audit", str(ckpt), "--json"], lambda env: {**env, "FP4FORGE_CACHE_DIR": tempfile.mkdtemp(prefix="bench-cache-")})
        doc = json.loads(docs["fp4forge audit --json, warm"]["stdout"])
        print(f"{tensors:,} tensors; audit summary {doc['summary']}, rules {sorted({f['rule'] for f in doc['findings']})}")
        compared.append("fp4forge audit --json, warm")
    if len(arms) > 1:
        for label in compared:
            agree = docs[label]["stdout"] == docs[label + " [baseline]"]["stdout"] and docs[label]["returncode"] == docs[label + " [baseline]"]["returncode"]
            print(f"  {label}: output and exit code {'identical to' if agree else 'DIFFER from'} the baseline's")
    floor = statistics.median(w for w, _ in rows["bare loop, fresh python"])
    floor_cpu = statistics.median(c for _, c in rows["bare loop, fresh python"])
    for label, runs in rows.items():
        walls = [w for w, _ in runs]
        cpus = [c for _, c in runs if c is not None]
        cpu = f"   cpu {statistics.median(cpus):.2f} s (x{statistics.median(cpus) / floor_cpu:.1f} its)" if cpus else ""
        print(f"  {label:54s} {summarize(walls)} s   x{statistics.median(walls) / floor:.1f} the fresh bare loop{cpu}")
    print("  peak RSS MiB " + ", ".join(f"{k} {v:.0f}" for k, v in rss.items()))
    print(f"load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
