"""`audit --json` (and `bytes --json`) of every corpus entry, this tree against an older one: a
speed change must not change a single byte of output or an exit code.

Each entry of tests/corpus is rebuilt header-only (once, under benchmarks/out/corpus/), then each
command runs as a fresh process with this tree's ``src`` and with ``--baseline-src DIR`` (e.g.
``git archive <commit> src | tar -x -C /tmp/before``) on ``PYTHONPATH``, sharing one skeleton
cache. Prints one line per entry and command; exits 1 if any differ.

    PYTHONPATH=$PWD/src .venv/bin/python benchmarks/compare_corpus_outputs.py --baseline-src /tmp/before/src [--deep] [CKPT ...]

Extra checkpoint directories given as arguments are compared too (e.g. the 163-shard rebuild of
bench_corpus_scale.py).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CORPUS = REPO / "tests" / "corpus"
OUT = REPO / "benchmarks" / "out" / "corpus"


def rebuilt(entry: Path) -> Path:
    from fp4forge.testbed.corpus import build_header_only

    target = OUT / entry.name
    if not (target / "config.json").exists():
        build_header_only(entry, target)
    return target


def run(src: Path, args: list[str], cache: str) -> tuple[int, bytes]:
    env = {**os.environ, "PYTHONPATH": str(src), "FP4FORGE_CACHE_DIR": cache}
    done = subprocess.run([sys.executable, "-m", "fp4forge.cli", *args], capture_output=True, env=env)
    return done.returncode, done.stdout


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--baseline-src", type=Path, required=True)
    parser.add_argument("--deep", action="store_true", help="also compare `audit --deep --json`")
    parser.add_argument("extra", nargs="*", type=Path, help="more checkpoint directories")
    args = parser.parse_args()
    checkpoints = [rebuilt(entry) for entry in sorted(CORPUS.iterdir()) if entry.is_dir()] + args.extra
    commands = [["bytes", "--json"], ["audit", "--json"]] + ([["audit", "--json", "--deep"]] if args.deep else [])
    cache = tempfile.mkdtemp(prefix="compare-cache-")
    differ = 0
    for ckpt in checkpoints:
        for command in commands:
            argv = [command[0], str(ckpt), *command[1:]]
            ours, theirs = run(REPO / "src", argv, cache), run(args.baseline_src.resolve(), argv, cache)
            same = ours == theirs
            differ += not same
            print(f"{'same' if same else 'DIFFER'}  exit {ours[0]}/{theirs[0]}  {' '.join(command)}  {ckpt.name}", flush=True)
    print(f"{differ} of {len(checkpoints) * len(commands)} differ")
    sys.exit(1 if differ else 0)


if __name__ == "__main__":
    main()
