"""Reliability suite, part 2: kill -9 at random points (docs/reliability.md).

For ``calibrate``, ``quantize``, ``kv calibrate`` and ``pipeline`` (no serving) on the tiny Laguna
testbed: one uninterrupted reference run, then a chain of SIGKILLs at seeded random points (each
re-run resumes what the last one left), the destination checked after every kill, and a final
run whose bytes must equal the reference's (tests/reliability_kill.py says what is checked per
command). CI runs one chain of ``KILLS`` kills per command; benchmarks/bench_reliability.py runs
many. test_quantize.py's ``test_killed_export_resumes_to_identical_bytes`` (one kill at a fixed
journal point, SIGKILL and SIGINT) stays as the deterministic case.

Part 3 is here too: a bench whose server is SIGKILLed mid-run, at seeded random sample counts,
keeps every sample it finished and says so (exit 3). It extends test_bench_vllm.py's
``test_killed_server_keeps_finished_samples_and_exits_nonzero`` (one kill point, in the slow
suite) to several points in the fast one, against the same fake OpenAI server process.
"""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest

from tests.reliability_kill import (
    CALIBRATION,
    KV_BASE_RECIPE,
    KillTarget,
    _env,
    bench_kill_case,
    calibrate_target,
    kill_chain,
    kv_target,
    pipeline_target,
    quantize_target,
    reference_run,
)

KILLS = 3
BENCH_KILL_POINTS = 3


def _chain(target: KillTarget, tmp_path: Path, seed: int) -> dict:
    reference = reference_run(target, tmp_path / "work")
    record = kill_chain(target, reference, tmp_path / "work", random.Random(seed), KILLS)
    assert record["killed"] >= 1, record
    return record


@pytest.mark.slow
def test_calibrate_killed_at_random_points(lc_source_dir: Path, tmp_path: Path) -> None:
    _chain(calibrate_target(lc_source_dir), tmp_path, seed=11)


@pytest.mark.slow
def test_quantize_killed_at_random_points(lc_source_dir: Path, tmp_path: Path) -> None:
    _chain(quantize_target(lc_source_dir), tmp_path, seed=12)


@pytest.mark.slow
def test_kv_calibrate_killed_at_random_points(lc_source_dir: Path, tmp_path: Path) -> None:
    stats = tmp_path / "stats.safetensors"
    quantized = tmp_path / "quantized"
    for args in (["calibrate", str(lc_source_dir), "--out", str(stats), *CALIBRATION],
                 ["quantize", str(lc_source_dir), str(quantized), "--recipe", KV_BASE_RECIPE, "--act-scales", "constant:8"]):
        proc = subprocess.run([sys.executable, "-m", "fp4forge.cli", *args], capture_output=True, text=True, env=_env(), timeout=1800)
        assert proc.returncode == 0, proc.stderr
    _chain(kv_target(stats, quantized), tmp_path, seed=13)


@pytest.mark.slow
def test_pipeline_killed_at_random_points(lc_source_dir: Path, tmp_path: Path) -> None:
    _chain(pipeline_target(lc_source_dir), tmp_path, seed=14)


# -- part 3: the bench keeps what it finished -------------------------------------------------------
@pytest.mark.parametrize("seed", range(BENCH_KILL_POINTS))
def test_bench_keeps_every_finished_sample_when_its_server_is_killed(seed: int, tmp_path: Path) -> None:
    record = bench_kill_case(random.Random(seed), tmp_path)
    assert record["samples"] >= record["kill_after"]
