"""The reliability suite at full count (docs/reliability.md): the figures CI's small counts stand for.

    .venv/bin/python benchmarks/bench_reliability.py [--fuzz 2000] [--cli-fuzz 300] [--value-fuzz 200] [--kills 50]
        [--chain 5] [--commands calibrate,quantize,kv,pipeline] [--bench-kills 20] [--seed 0] [--json FILE]

1. Fuzz: ``--fuzz`` malformed inputs per target (shard, index, config) through the library
   (tests/reliability_support.py ``fuzz_library_case``), and ``--cli-fuzz`` per target through
   ``fp4forge bytes`` and ``fp4forge audit`` in-process (``fuzz_cli_case``) on the tiny Laguna.
2. kill -9: ``--kills`` SIGKILLs per command at seeded random points, in chains of ``--chain``
   kills each followed by a run to completion compared byte for byte with an uninterrupted run
   (tests/reliability_kill.py).
3. ``--bench-kills`` runs of ``fp4forge bench perf`` whose fake server is SIGKILLed after a random
   number of samples (tests/test_reliability_kill.py's check, many times).

Every violation is printed with the input that caused it; the exit code is 1 if there was any.
Needs hypothesis only for the tests, not here (seeded ``random.Random`` drives the mutations).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.reliability_kill import (
    CALIBRATION,
    KV_BASE_RECIPE,
    _env,
    bench_kill_case,
    calibrate_target,
    kill_chain,
    kv_target,
    pipeline_target,
    quantize_target,
    reference_run,
)
from tests.reliability_support import (
    Violation,
    fuzz_cli_case,
    fuzz_library_case,
    fuzz_value_case,
    write_base_checkpoint,
)

TARGETS = ("shard", "index", "config")


def run_fuzz(count: int, cli_count: int, seed: int, work: Path, testbed: Path) -> dict:
    template = write_base_checkpoint(work / "base")
    report: dict = {"library": {}, "cli": {}, "violations": []}
    for target in TARGETS:
        outcomes: collections.Counter = collections.Counter()
        labels: set[str] = set()
        started = time.monotonic()
        for i in range(count):
            case = work / f"lib-{target}-{i}"
            try:
                record = fuzz_library_case(target, random.Random(f"{seed}-{target}-{i}"), template, case)
                outcomes[record["outcome"]] += 1
                labels.add(record["label"])
            except Violation as exc:
                outcomes["VIOLATION"] += 1
                report["violations"].append(f"library {target} #{i}: {str(exc).splitlines()[0]}")
            shutil.rmtree(case, ignore_errors=True)
        report["library"][target] = {"inputs": count, "outcomes": dict(outcomes), "mutation_kinds": len(labels), "seconds": round(time.monotonic() - started, 1)}
        print(f"fuzz library {target}: {count} inputs, {len(labels)} mutation kinds, {dict(outcomes)}", flush=True)
    os.environ["FP4FORGE_CACHE_DIR"] = str(work / "skeleton-cache")
    for target in TARGETS:
        codes: collections.Counter = collections.Counter()
        started = time.monotonic()
        for i in range(cli_count):
            case = work / f"cli-{target}-{i}"
            try:
                record = fuzz_cli_case(target, random.Random(f"{seed}-cli-{target}-{i}"), testbed, case)
                codes[f"reader {record['library']}, bytes {int(record['bytes'])}, audit {int(record['audit'])}"] += 1
            except Violation as exc:
                codes["VIOLATION"] += 1
                report["violations"].append(f"cli {target} #{i}: {str(exc).splitlines()[0]}")
            shutil.rmtree(case, ignore_errors=True)
        report["cli"][target] = {"inputs": cli_count, "outcomes": dict(codes), "seconds": round(time.monotonic() - started, 1)}
        print(f"fuzz cli {target}: {cli_count} inputs (bytes + audit each), {dict(codes)}", flush=True)
    return report


def run_value_fuzz(count: int, seed: int, work: Path, testbed: Path) -> dict:
    """``count`` value mutations per export (NVFP4 in both layouts, FP8) under ``audit --deep``."""
    from fp4forge.quantize.act_scales import ConstantAmax
    from fp4forge.quantize.export import QuantizeOptions, quantize_checkpoint
    from fp4forge.quantize.recipe import load_recipe

    report: dict = {"exports": {}, "violations": []}
    for recipe, layout in (("nvfp4-experts", "compressed-tensors"), ("nvfp4-experts", "modelopt"), ("fp8", "compressed-tensors")):
        template = work / f"values-{recipe}-{layout}"
        quantize_checkpoint(testbed, template, QuantizeOptions(load_recipe(recipe), layout, act_amax=ConstantAmax(8.0)))
        codes: collections.Counter = collections.Counter()
        started = time.monotonic()
        for i in range(count):
            case = work / f"values-{i}"
            try:
                record = fuzz_value_case(random.Random(f"{seed}-values-{template.name}-{i}"), template, case)
                codes[f"{'defect' if record['defect'] else 'other'}, audit {record['audit']}"] += 1
            except Violation as exc:
                codes["VIOLATION"] += 1
                report["violations"].append(f"values {template.name} #{i}: {str(exc).splitlines()[0]}")
            shutil.rmtree(case, ignore_errors=True)
        report["exports"][template.name] = {"inputs": count, "outcomes": dict(codes), "seconds": round(time.monotonic() - started, 1)}
        print(f"fuzz values {template.name}: {count} inputs (audit --deep each), {dict(codes)}", flush=True)
    return report


def run_kills(commands: list[str], kills: int, chain: int, seed: int, work: Path, testbed: Path) -> dict:
    report: dict = {}
    stats = work / "kv-input" / "stats.safetensors"
    quantized = work / "kv-input" / "quantized"
    for name in commands:
        if name == "kv" and not quantized.exists():
            for args in (["calibrate", str(testbed), "--out", str(stats), *CALIBRATION],
                         ["quantize", str(testbed), str(quantized), "--recipe", KV_BASE_RECIPE, "--act-scales", "constant:8"]):
                subprocess.run([sys.executable, "-m", "fp4forge.cli", *args], check=True, capture_output=True, env=_env())
        target = {"calibrate": calibrate_target(testbed), "quantize": quantize_target(testbed), "kv": kv_target(stats, quantized),
                  "pipeline": pipeline_target(testbed)}[name]
        reference = reference_run(target, work / f"kill-{name}")  # every chain runs in this same directory
        entry = {"reference_s": round(reference.seconds, 1), "kill_window_s": [round(x, 1) for x in reference.kill_window()], "kills": 0, "killed_after_output": 0, "finished_before_kill": 0, "chains": 0, "staging_seen": 0,
                 "identical": 0, "violations": [], "litter": 0}
        rng = random.Random(f"{seed}-{name}")
        while entry["kills"] < kills:
            workdir = work / f"kill-{name}"
            try:
                record = kill_chain(target, reference, workdir, rng, min(chain, kills - entry["kills"]))
                entry["identical"] += 1
                entry["staging_seen"] += record["staging_seen"]
                entry["litter"] += len(record["litter"])
                entry["kills"] += record["killed"]
                entry["finished_before_kill"] += record["finished_before_kill"]
                entry["killed_after_output"] += record.get("killed_after_output", 0)
            except Violation as exc:
                entry["violations"].append(str(exc).splitlines()[0])
                entry["kills"] += 1  # a chain that broke counts its kill, so the loop ends
            entry["chains"] += 1
            shutil.rmtree(workdir, ignore_errors=True)
            print(f"kill {name}: chain {entry['chains']}: {entry['kills']} kills so far, {len(entry['violations'])} violations", flush=True)
        report[name] = entry
        print(f"kill {name}: {json.dumps(entry)}", flush=True)
    return report


def run_bench_kills(count: int, seed: int, work: Path) -> dict:
    passed = 0
    failures = []
    for i in range(count):
        try:
            bench_kill_case(random.Random(f"{seed}-bench-{i}"), work / f"bench-kill-{i}")
            passed += 1
        except Violation as exc:
            failures.append(str(exc).splitlines()[0])
        print(f"bench kill {i + 1}/{count}: {passed} passed, {len(failures)} failed", flush=True)
    return {"runs": count, "passed": passed, "failed": len(failures), "failures": failures}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fuzz", type=int, default=2000, help="library inputs per target")
    parser.add_argument("--cli-fuzz", type=int, default=300, help="command-line inputs per target")
    parser.add_argument("--value-fuzz", type=int, default=200, help="value mutations under audit --deep, per export (three exports)")
    parser.add_argument("--kills", type=int, default=50, help="SIGKILLs per command")
    parser.add_argument("--chain", type=int, default=5, help="kills per chain before the run to completion")
    parser.add_argument("--commands", default="calibrate,quantize,kv,pipeline")
    parser.add_argument("--bench-kills", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--testbed", type=Path, help="an existing `fp4forge testbed tiny-laguna DIR --seed 0` (else built)")
    parser.add_argument("--json", type=Path, help="write the figures here too")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="fp4forge-reliability-"))
    testbed = args.testbed
    if testbed is None:
        testbed = work / "tiny-laguna"
        subprocess.run([sys.executable, "-m", "fp4forge.cli", "testbed", "tiny-laguna", str(testbed), "--seed", "0"], check=True,
                       capture_output=True, env=_env())
    started = time.monotonic()
    figures: dict = {"seed": args.seed}
    if args.fuzz or args.cli_fuzz:
        figures["fuzz"] = run_fuzz(args.fuzz, args.cli_fuzz, args.seed, work, testbed)
    if args.value_fuzz:
        figures["value_fuzz"] = run_value_fuzz(args.value_fuzz, args.seed, work, testbed)
    if args.kills:
        figures["kill"] = run_kills([c for c in args.commands.split(",") if c], args.kills, args.chain, args.seed, work, testbed)
    if args.bench_kills:
        figures["bench_kill"] = run_bench_kills(args.bench_kills, args.seed, work)
    figures["seconds"] = round(time.monotonic() - started, 1)
    shutil.rmtree(work, ignore_errors=True)
    text = json.dumps(figures, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    violations = len(figures.get("fuzz", {}).get("violations", [])) + sum(len(e["violations"]) for e in figures.get("kill", {}).values())
    violations += figures.get("bench_kill", {}).get("failed", 0) + len(figures.get("value_fuzz", {}).get("violations", []))
    return 1 if violations else 0


if __name__ == "__main__":
    raise SystemExit(main())
