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

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.reliability_kill import (
    CALIBRATION,
    RECIPE,
    KillTarget,
    calibrate_target,
    kill_chain,
    kv_target,
    pipeline_target,
    quantize_target,
    reference_run,
    _env,
)

KILLS = 3
BENCH_KILL_POINTS = 3
FAKE_SERVER_SCRIPT = Path(__file__).with_name("test_bench_client.py")


def _chain(target: KillTarget, tmp_path: Path, seed: int) -> dict:
    reference = reference_run(target, tmp_path / "reference")
    record = kill_chain(target, reference, tmp_path / "chain", random.Random(seed), KILLS)
    assert record["killed"] + record["finished_before_kill"] >= 1
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
                 ["quantize", str(lc_source_dir), str(quantized), "--recipe", RECIPE, "--act-scales", "constant:8"]):
        proc = subprocess.run([sys.executable, "-m", "fp4forge.cli", *args], capture_output=True, text=True, env=_env(), timeout=1800)
        assert proc.returncode == 0, proc.stderr
    _chain(kv_target(stats, quantized), tmp_path, seed=13)


@pytest.mark.slow
def test_pipeline_killed_at_random_points(lc_source_dir: Path, tmp_path: Path) -> None:
    _chain(pipeline_target(lc_source_dir), tmp_path, seed=14)


# -- part 3: the bench keeps what it finished -------------------------------------------------------
def _samples(path: Path) -> list[str]:
    """Complete lines only (a line being written has no newline yet)."""
    if not path.is_file():
        return []
    text = path.read_text()
    return text.splitlines()[: text.count("\n")]


@pytest.mark.parametrize("seed", range(BENCH_KILL_POINTS))
def test_bench_keeps_every_finished_sample_when_its_server_is_killed(seed: int, tmp_path: Path) -> None:
    rng = random.Random(seed)
    kill_after = rng.randint(1, 40)  # finished samples before the SIGKILL
    from fp4forge.serve import pick_free_port

    port = pick_free_port()
    server = subprocess.Popen([sys.executable, str(FAKE_SERVER_SCRIPT), "--serve", "--port", str(port), "--ttft", "0.01", "--token-gap", "0.005"],
                              stdout=subprocess.PIPE, text=True, env=_env())
    out = tmp_path / "bench"
    try:
        assert server.stdout.readline().startswith("READY")
        bench = subprocess.Popen(
            [sys.executable, "-m", "fp4forge.cli", "bench", "perf", "--url", f"http://127.0.0.1:{port}", "--model", "normal",
             "--out", str(out), "--prompt-tokens", "16,32", "--output-tokens", "8", "--warmups", "0", "--samples", "500", "--no-plots"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**_env(), "COLUMNS": "200"},
        )
        samples_file = out / "samples.jsonl"
        deadline = time.monotonic() + 120
        while len(_samples(samples_file)) < kill_after:
            assert bench.poll() is None, bench.communicate()
            assert time.monotonic() < deadline, f"fewer than {kill_after} samples within 120 s"
            time.sleep(0.01)
        os.kill(server.pid, signal.SIGKILL)
        finished_at_kill = _samples(samples_file)
        server.wait(10)
        _, stderr = bench.communicate(timeout=120)
    finally:
        if server.poll() is None:
            os.kill(server.pid, signal.SIGKILL)
            server.wait(10)

    assert bench.returncode == 3, stderr  # ExitCode.ABORTED
    assert "Traceback" not in stderr
    message = " ".join(stderr.split())
    assert "stopped answering" in message
    lines = _samples(samples_file)
    assert lines[: len(finished_at_kill)] == finished_at_kill  # every sample finished before the kill is kept as written
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]  # and every line is whole
    assert len(samples) == len(lines)
    assert sum(s["ok"] for s in samples) >= kill_after
    said = re.search(r"Stopped after (\d+) finished requests \((\d+) kept\)", message)
    assert said, message  # it says how many it finished and kept, and those are the file's counts
    assert (int(said.group(1)), int(said.group(2))) == (len(samples), sum(s["ok"] for s in samples)), message
    summary = json.loads((out / "summary.json").read_text())
    assert summary["run"]["status"] == "aborted"
    assert summary["totals"]["kept_ok"] == sum(s["ok"] for s in samples)
