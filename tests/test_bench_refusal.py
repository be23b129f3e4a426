"""`bench perf` refuses a workload the server cannot hold, names what fits, and writes nothing
(issue 19, finding 6); the fake server of tests/test_bench_client.py reports max_model_len 4096,
the size of the server the issue was found on. The same check against the real vLLM server is in
tests/test_bench_vllm.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fp4forge.bench.perf import PerfOptions, run_perf
from fp4forge.bench.runner import workloads_that_fit
from fp4forge.errors import ConfigError
from tests.test_bench_client import fake_url  # noqa: F401  (the module-scoped fake server)


def test_workloads_that_fit_by_hand() -> None:
    # default: 9,325 + 128 > 4,096; cpu-small 1,536 + 32, cpu-tiny 1,536 + 16, decode 128 + 256 fit.
    assert workloads_that_fit(4096) == ["cpu-small", "cpu-tiny", "decode"]
    assert workloads_that_fit(1000) == ["decode"]
    assert workloads_that_fit(10_000) == ["cpu-small", "cpu-tiny", "decode", "default"]


def test_default_workload_refused_with_what_fits_and_no_output(fake_url: str, tmp_path: Path) -> None:  # noqa: F811
    out = tmp_path / "run"
    with pytest.raises(ConfigError) as caught:
        run_perf(PerfOptions(url=fake_url, model="normal", out_dir=out))
    error = caught.value
    assert error.option == "workload"
    assert "Workloads that fit: cpu-small, cpu-tiny, decode" in error.message
    assert "p4700-o128" in error.message and "p9325-o128" in error.message
    assert "81,160,320,633,1250,2500" in error.message  # the default ladder's shapes that fit 4,096
    assert list(tmp_path.iterdir()) == []


def test_a_run_that_starts_lands_in_out(fake_url: str, tmp_path: Path) -> None:  # noqa: F811
    out = tmp_path / "run"
    result = run_perf(PerfOptions(url=fake_url, model="normal", out_dir=out, workload="cpu-tiny", prompt_tokens=[32],
                                  warmups=0, samples=2), plots=False)
    assert result.summary is not None and result.summary["totals"]["kept_ok"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
    assert json.loads((out / "run.json").read_text())["config"]["out_dir"] == str(out)


def test_a_run_whose_every_request_failed_says_nothing_was_measured(fake_url: str, tmp_path: Path) -> None:  # noqa: F811
    from typer.testing import CliRunner

    from fp4forge.cli import app

    out = tmp_path / "run"
    result = CliRunner().invoke(app, ["bench", "perf", "--url", fake_url, "--model", "http-500", "--out", str(out), "--workload", "cpu-tiny",
                                      "--prompt-tokens", "32", "--warmups", "0", "--samples", "2", "--no-plots"])
    assert result.exit_code == 1 and "nothing was measured" in result.output, result.output
