"""Reliability suite, part 1: property-based fuzzing of the checkpoint readers (docs/reliability.md).

Every input is a valid file (written by the ``safetensors`` library and ``json``) damaged in one
way: truncated or extended, a corrupt 8-byte length prefix, non-UTF-8 / non-JSON / wrong-schema
headers, overlapping / gapped / out-of-range offsets, unknown dtypes, shape x dtype mismatches,
huge numbers, deep nesting, lone surrogates; an index with traversal paths, missing shards or
wrong types; a config.json of garbage or nonsense. The mutations live in
tests/reliability_support.py, shared with benchmarks/bench_reliability.py, which runs thousands.

The contract checked on every input:
- the library (``open_checkpoint``, strict, lenient and single-file) returns or raises a named
  ``Fp4forgeError`` with a one-line message, and writes nothing;
- a damaged shard is accepted only if the ``safetensors`` library (the oracle) accepts it with
  the same tensors, and refused only if the oracle refuses it — except the two documented cases
  where fp4forge is deliberately stricter (duplicate tensor names, extra keys in an entry);
- ``fp4forge bytes --json`` exits 0 or 2, ``fp4forge audit --json`` 0, 1 (an error finding) or 2;
  exit 2 comes with one ``error:`` line; no traceback; a checkpoint the reader refuses never gets a
  silent exit 0; nothing is written in the checkpoint or the working directory.

Counts (CI): 200 library inputs per target (shard, index, config), 10 command-line inputs per
target run in-process through ``fp4forge.cli.main`` (each runs ``bytes`` and ``audit``), and 3
inputs through a real ``fp4forge`` subprocess.

Values (``audit --deep``): valid exports (NVFP4 in both layouts, FP8) with one tensor's values
replaced by zero, negative, NaN, infinite, subnormal or huge scales, NaN / negative / zero FP8
block scales and codes, zeroed or random packed codes: exit 0 or 1 with JSON, never a traceback,
exit 1 on every defect; the figures are stated in docs/reliability.md and recomputed here.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.reliability_support import (
    SHARDS,
    check_cli_outcome,
    fuzz_cli_case,
    fuzz_library_case,
    fuzz_value_case,
    mutate_shard,
    tree_state,
    write_base_checkpoint,
)

hypothesis = pytest.importorskip("hypothesis", reason="the reliability fuzzer needs hypothesis (pip install -e '.[test]')")
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

LIBRARY_EXAMPLES = 200
CLI_EXAMPLES = 10
VALUE_EXAMPLES = 12  # per template export (three of them)
VALUE_TEMPLATES = (("nvfp4-experts", "compressed-tensors"), ("nvfp4-experts", "modelopt"), ("fp8", "compressed-tensors"))
# Deterministic (derandomize): CI runs the same inputs every time; the benchmark explores.
FUZZ = settings(deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def base_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_base_checkpoint(tmp_path_factory.mktemp("fuzz-base") / "base")


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory):
    """The audit's skeleton cache in a private directory (never the user's ~/.cache)."""
    path = tmp_path_factory.mktemp("skeleton-cache")
    old = os.environ.get("FP4FORGE_CACHE_DIR")
    os.environ["FP4FORGE_CACHE_DIR"] = str(path)
    yield path
    if old is None:
        os.environ.pop("FP4FORGE_CACHE_DIR", None)
    else:
        os.environ["FP4FORGE_CACHE_DIR"] = old


class _Cases:
    """A fresh work directory per generated input (hypothesis reuses the test's fixtures)."""

    def __init__(self, root: Path):
        self.root = root
        self.count = 0

    def next(self) -> Path:
        self.count += 1
        path = self.root / f"case{self.count}"
        shutil.rmtree(path, ignore_errors=True)
        return path


def test_the_base_checkpoint_is_valid(base_template: Path) -> None:
    """The starting point of every mutation reads cleanly (else every refusal would be trivial)."""
    from fp4forge.checkpoint.reader import open_checkpoint

    ckpt = open_checkpoint(base_template)
    assert sorted(ckpt.headers) == list(SHARDS) and ckpt.index is not None and ckpt.config is not None
    assert sum(len(h.tensors) for h in ckpt.headers.values()) == 6


@pytest.mark.parametrize("target", ["shard", "index", "config"])
def test_library_gives_a_named_error_or_a_faithful_read(target: str, base_template: Path, tmp_path: Path) -> None:
    cases = _Cases(tmp_path)
    outcomes: dict[str, int] = {}

    @settings(FUZZ, max_examples=LIBRARY_EXAMPLES)
    @given(rng=st.randoms(use_true_random=False))
    def check(rng: random.Random) -> None:
        workdir = cases.next()
        record = fuzz_library_case(target, rng, base_template, workdir)
        outcomes[record["outcome"]] = outcomes.get(record["outcome"], 0) + 1
        shutil.rmtree(workdir, ignore_errors=True)

    check()
    assert sum(outcomes.values()) >= LIBRARY_EXAMPLES, outcomes  # the count docs/reliability.md states
    # The generator reaches both sides of the line: refusals and (still-valid) acceptances.
    assert len(outcomes) >= 2 and "accepted" in outcomes, outcomes


@pytest.mark.parametrize("target", ["shard", "index", "config"])
def test_cli_exit_codes_one_line_errors_nothing_written(target: str, lc_source_dir: Path, cache_dir: Path, tmp_path: Path) -> None:
    cases = _Cases(tmp_path)
    codes: dict[str, set[int]] = {"bytes": set(), "audit": set()}

    @settings(FUZZ, max_examples=CLI_EXAMPLES)
    @given(rng=st.randoms(use_true_random=False))
    def check(rng: random.Random) -> None:
        workdir = cases.next()
        record = fuzz_cli_case(target, rng, lc_source_dir, workdir)
        codes["bytes"].add(int(record["bytes"]))
        codes["audit"].add(int(record["audit"]))
        shutil.rmtree(workdir, ignore_errors=True)

    check()
    assert cases.count >= CLI_EXAMPLES
    assert codes["bytes"] and codes["audit"]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_real_process_on_a_damaged_shard(seed: int, lc_source_dir: Path, cache_dir: Path, tmp_path: Path) -> None:
    """The same contract through the installed entry point in its own process (what a shell sees)."""
    rng = random.Random(seed)
    checkpoint = tmp_path / "checkpoint"
    shutil.copytree(lc_source_dir, checkpoint, copy_function=os.link)
    shard = checkpoint / sorted(p.name for p in checkpoint.glob("*.safetensors"))[seed % 3]
    damaged, label = mutate_shard(rng, shard.read_bytes())
    shard.unlink()
    shard.write_bytes(damaged)
    before = tree_state(checkpoint, tmp_path)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in [str(Path(__file__).parents[1] / "src"), os.environ.get("PYTHONPATH")] if p)}
    from fp4forge.checkpoint.reader import open_checkpoint
    from fp4forge.errors import Fp4forgeError

    try:
        open_checkpoint(checkpoint)
        refuses = False
    except Fp4forgeError:
        refuses = True
    for command in ("bytes", "audit"):
        proc = subprocess.run([sys.executable, "-m", "fp4forge.cli", command, str(checkpoint), "--json"], capture_output=True, text=True,
                              cwd=tmp_path, env=env, timeout=300)
        check_cli_outcome(command, label, proc.returncode, proc.stdout, proc.stderr, refuses)
        if command == "audit" and proc.returncode != 2:
            json.loads(proc.stdout)
    assert tree_state(checkpoint, tmp_path) == before


@pytest.fixture(scope="module")
def value_templates(lc_source_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    from fp4forge.quantize.act_scales import ConstantAmax
    from fp4forge.quantize.export import QuantizeOptions, quantize_checkpoint
    from fp4forge.quantize.recipe import load_recipe

    root = tmp_path_factory.mktemp("value-fuzz")
    out = []
    for recipe, layout in VALUE_TEMPLATES:
        quantize_checkpoint(lc_source_dir, root / f"{recipe}-{layout}", QuantizeOptions(load_recipe(recipe), layout, act_amax=ConstantAmax(8.0)))
        out.append(root / f"{recipe}-{layout}")
    return out


def value_figure(records: list[dict]) -> str:
    """The sentence docs/reliability.md states about the value fuzzer."""
    defects = [r for r in records if r["defect"]]
    others = [r for r in records if not r["defect"]]
    flagged = sum(r["audit"] == 1 for r in others)
    return (f"{len(records)} value mutations under `audit --deep`: 0 tracebacks, 0 exit 2; {len(defects)} defects, "
            f"{sum(r['audit'] == 1 for r in defects)} of them exit 1; {len(others)} other changes: {len(others) - flagged} exit 0, {flagged} exit 1")


def test_deep_audit_on_any_value(value_templates: list[Path], cache_dir: Path, tmp_path: Path) -> None:
    """Seeded (the same inputs every run): the figure in docs/reliability.md is this run's."""
    cases = _Cases(tmp_path)
    records = []
    for template in value_templates:
        for i in range(VALUE_EXAMPLES):
            workdir = cases.next()
            records.append(fuzz_value_case(random.Random(f"values-{template.name}-{i}"), template, workdir))
            shutil.rmtree(workdir, ignore_errors=True)
    assert any(r["defect"] for r in records) and any(not r["defect"] for r in records)
    reliability = (Path(__file__).parents[1] / "docs" / "reliability.md").read_text(encoding="utf-8")
    figure = value_figure(records)
    assert figure in " ".join(reliability.split()), figure
