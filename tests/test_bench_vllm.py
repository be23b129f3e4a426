"""`fp4forge bench perf` against the real vLLM CPU server (tiny dense Laguna), in every mode.

One server for the whole session (the ``vllm_laguna_dense`` fixture of tests/conftest.py); each
run uses the ``cpu-tiny`` workload cut down to a few shapes and samples, so the file stays within
a few minutes on a 2-core machine. The last test kills a server mid-run: it uses the cheap fake
SSE server of tests/test_bench_client.py in its own process, not a second vLLM (a second vLLM
would cost a minute and 3 GiB only to be killed).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from fp4forge.bench.analyze import SUMMARY_FILE, analyze_dir
from fp4forge.cli.bench import EXIT_ABORTED, register
from fp4forge.serve import VllmServer, pick_free_port

pytestmark = pytest.mark.slow

FAKE_SERVER_SCRIPT = Path(__file__).with_name("test_bench_client.py")
SUMMARY_KEYS = {"shape", "load", "n", "median_ttft_s", "bimodal", "modes", "ttft_s", "decode_tok_s", "prefill_regime"}
SAMPLE_KEYS = {"shape", "prompt_tokens", "output_tokens", "ttft_s", "decode_tok_s", "e2e_s", "ok"}


def bench_app() -> typer.Typer:
    app = typer.Typer()
    register(app)
    return app


def perf(server: VllmServer, out: Path, *args: str) -> dict[str, Any]:
    """Run `bench perf --json` in-process; return summary.json after checking the exit code."""
    result = CliRunner().invoke(
        bench_app(),
        ["bench", "perf", "--url", server.base_url, "--model", server.served_model_name, "--out", str(out),
         "--workload", "cpu-tiny", "--json", *args],
        catch_exceptions=False,
    )
    assert result.exit_code == 0, result.output
    summary = json.loads((out / SUMMARY_FILE).read_text())
    return summary


def samples_of(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]


def assert_sound_run(summary: dict[str, Any], out: Path, *, cells: int, samples: int) -> None:
    assert len(summary["shapes"]) == cells
    for entry in summary["shapes"]:
        assert SUMMARY_KEYS <= set(entry)
        assert entry["n"] == samples and entry["n_failed"] == 0
        assert (entry["median_ttft_s"] is None) == entry["bimodal"]
        assert entry["output_tokens"] == entry["target_output_tokens"]
    for sample in samples_of(out):
        assert SAMPLE_KEYS <= set(sample)
        assert sample["ok"], sample["error"]
        assert sample["server_prompt_tokens"] == sample["prompt_tokens"] == sample["target_prompt_tokens"]
        assert sample["token_count_source"] == "continuous_usage"


def test_sequential_completions_unique_prompts_and_reanalysis(vllm_laguna_dense: VllmServer, tmp_path: Path) -> None:
    out = tmp_path / "seq"
    summary = perf(vllm_laguna_dense, out, "--samples", "4")
    assert_sound_run(summary, out, cells=4, samples=4)
    # Unique prompts, proven by the server: no prefix-cache hit in any measured cell.
    for entry in summary["shapes"]:
        assert entry["server"]["prefix_cache_queries"] > 0
        assert entry["server"]["prefix_cache_hits"] == 0
    assert summary["run"]["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    assert sorted(summary["plots"]) == ["decode_vs_context.png", "ttft_distribution.png", "ttft_vs_prompt.png"]
    assert summary["shapes"][0]["prefill_regime"] == "overhead, not throughput"

    # samples.jsonl alone reproduces every per-shape statistic.
    alone = tmp_path / "alone"
    alone.mkdir()
    shutil.copy(out / "samples.jsonl", alone / "samples.jsonl")
    again = analyze_dir(alone, plots=False)
    strip = lambda e: {k: v for k, v in e.items() if k != "server"}  # noqa: E731 - server metrics are a side file
    assert [strip(e) for e in again["shapes"]] == [strip(e) for e in summary["shapes"]]
    assert again["prefill"] == summary["prefill"]

    compared = CliRunner().invoke(bench_app(), ["bench", "compare", str(out), str(alone), "--json"])
    assert compared.exit_code == 0, compared.output
    cells = json.loads(compared.output)["cells"]
    # a run against its own samples moves no way; with 4 samples a noisy cell may not show it alike within 5 %
    assert {row["ttft"]["verdict"] for row in cells} <= {"no difference", "cannot tell apart", "bimodal: compare the modes, not medians"}
    assert all(row["ttft"]["ratio"] in (None, 1.0) for row in cells)


def test_chat_endpoint_times_the_first_token_not_the_role_chunk(vllm_laguna_dense: VllmServer, tmp_path: Path) -> None:
    out = tmp_path / "chat"
    summary = perf(vllm_laguna_dense, out, "--endpoint", "chat", "--prompt-tokens", "32,512", "--samples", "3")
    assert_sound_run(summary, out, cells=2, samples=3)
    for sample in samples_of(out):
        assert sample["ttft_s"] >= sample["first_chunk_s"]  # vLLM sends the role chunk first


def test_concurrency_sweep(vllm_laguna_dense: VllmServer, tmp_path: Path) -> None:
    out = tmp_path / "conc"
    summary = perf(vllm_laguna_dense, out, "--mode", "concurrency", "--concurrency", "1,3", "--prompt-tokens", "32,512", "--samples", "3")
    assert_sound_run(summary, out, cells=4, samples=3)
    assert [e["load"] for e in summary["shapes"]] == ["c1", "c1", "c3", "c3"]
    assert sum(s["warmup"] for s in samples_of(out) if s["load"] == "c3") == 2 * 3  # one warmup per slot


def test_poisson_rate_sweep(vllm_laguna_dense: VllmServer, tmp_path: Path) -> None:
    out = tmp_path / "rate"
    summary = perf(vllm_laguna_dense, out, "--mode", "rate", "--rate", "2,8", "--prompt-tokens", "32,512", "--samples", "4")
    assert_sound_run(summary, out, cells=4, samples=4)
    assert {e["load"] for e in summary["shapes"]} == {"r2", "r8"}
    assert all(s["schedule_lag_s"] is not None for s in samples_of(out))


def test_prefix_cache_mode_shares_prefixes_on_purpose(vllm_laguna_dense: VllmServer, tmp_path: Path) -> None:
    out = tmp_path / "prefix"
    summary = perf(vllm_laguna_dense, out, "--prefix-cache", "--prefix-fraction", "0.75", "--prompt-tokens", "512,1024", "--samples", "3")
    for entry in summary["shapes"]:
        assert entry["server"]["prefix_cache_hits"] > 0
    assert all(s["shared_prefix_tokens"] == round(0.75 * s["prompt_tokens"]) for s in samples_of(out))


def test_killed_server_keeps_finished_samples_and_exits_nonzero(tmp_path: Path) -> None:
    """A fake SSE server process (tests/test_bench_client.py --serve), killed after a few samples."""
    port = pick_free_port()
    server = subprocess.Popen(
        [sys.executable, str(FAKE_SERVER_SCRIPT), "--serve", "--port", str(port), "--ttft", "0.02", "--token-gap", "0.01"],
        stdout=subprocess.PIPE,
        text=True,
    )
    out = tmp_path / "killed"
    try:
        assert server.stdout.readline().startswith("READY")
        bench = subprocess.Popen(
            [sys.executable, "-m", "fp4forge.cli.bench", "bench", "perf", "--url", f"http://127.0.0.1:{port}",
             "--model", "normal", "--out", str(out), "--prompt-tokens", "16,32", "--output-tokens", "8",
             "--warmups", "0", "--samples", "500", "--no-plots"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "COLUMNS": "200"},
        )
        samples_file = out / "samples.jsonl"
        deadline = time.monotonic() + 60
        while not (samples_file.is_file() and len(samples_file.read_text().splitlines()) >= 5):
            assert bench.poll() is None, bench.communicate()
            assert time.monotonic() < deadline, "no samples within 60 s"
            time.sleep(0.05)
        os.kill(server.pid, signal.SIGKILL)
        server.wait(10)
        stdout, stderr = bench.communicate(timeout=60)
    finally:
        if server.poll() is None:
            os.kill(server.pid, signal.SIGKILL)
            server.wait(10)

    assert bench.returncode == EXIT_ABORTED, stderr
    assert "stopped answering" in " ".join(stderr.split())
    lines = (out / "samples.jsonl").read_text().splitlines()
    samples = [json.loads(line) for line in lines]  # every line complete and parseable
    assert sum(s["ok"] for s in samples) >= 5
    assert all(s["error_kind"] in ("disconnect", "connect") for s in samples if not s["ok"])
    assert len(samples) < 1000  # it stopped instead of failing through the rest
    summary = json.loads((out / SUMMARY_FILE).read_text())
    assert summary["run"]["status"] == "aborted"
    assert summary["totals"]["kept_ok"] == sum(s["ok"] for s in samples)


def test_default_workload_on_a_short_server_names_what_fits_and_writes_nothing(vllm_laguna_dense: VllmServer, tmp_path: Path) -> None:
    """Issue 19: the default ladder (up to 9,325 + 128 tokens) against the real 2,048-token server."""
    out = tmp_path / "default"
    result = CliRunner().invoke(
        bench_app(),
        ["bench", "perf", "--url", vllm_laguna_dense.base_url, "--model", vllm_laguna_dense.served_model_name, "--out", str(out)],
        catch_exceptions=False,
    )
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    assert "max_model_len 2048" in text and "Workloads that fit: cpu-small, cpu-tiny, decode" in text
    assert "--workload" in text
    assert not out.exists() and list(tmp_path.iterdir()) == []  # no empty directory, no staging left behind
