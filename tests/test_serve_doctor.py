"""`fp4forge serve doctor` on real vLLM CPU logs and on GPU lines written from vLLM's source
(tests/fixtures/vllm_logs/README.md says which is which)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from fp4forge.cli import serve as cli_serve
from fp4forge.serve.doctor import SEVERITIES, LogDoctor, diagnose, iter_lines, load_patterns

LOGS = Path(__file__).parent / "fixtures" / "vllm_logs"

# file -> the non-info findings it must produce (exactly), and some info findings it must contain.
EXPECTED: dict[str, tuple[set[tuple[str, str]], set[str]]] = {
    "cpu-plugin-ct-w4a4.log": (set(), {"fp4forge-plugin-active", "fp8-linear-kernel", "shutdown", "engine-dead"}),
    "cpu-plugin-modelopt-w4a16-stock-parser.log": (
        {("warning", "fp4forge-plugin-active"), ("warning", "reasoning-autoinit-failed")},
        {"q-scale-benign", "quantization-method"},
    ),
    "cpu-plugin-bf16-moe-fixed-parser.log": (set(), {"fp4forge-plugin-active", "cpu-unquantized-moe"}),
    "cpu-noplugin-ct-nvfp4-moe.log": (
        {("error", "no-nvfp4-moe-backend"), ("warning", "fp8-linear-kernel")},
        {"fp4forge-plugin-disabled"},
    ),
    "cpu-noplugin-nvfp4-linear-removed-env-var.log": (
        {("error", "no-nvfp4-linear-kernel"), ("warning", "unknown-env-var")},
        {"fp4forge-plugin-disabled"},
    ),
    "cpu-noplugin-fp8-static-attention.log": (
        {("error", "cpu-fp8-quant-op-missing"), ("warning", "fp8-linear-kernel")},
        set(),
    ),
    "cpu-stock-laguna-moe-sigmoid-router.log": ({("error", "cpu-router-softmax-only"), ("error", "engine-dead")}, set()),
    "cpu-plugin-modelopt-kv-declared-no-scales.log": ({("warning", "kv-scale-1.0")}, {"q-scale-benign"}),
    "cpu-plugin-ct-missing-weight-tracked.log": ({("error", "weights-not-initialized")}, set()),
    "cpu-unrecognized-argument.log": ({("error", "unrecognized-arguments")}, set()),
    "gpu-from-source-h200-nvfp4-humming.log": ({("warning", "nvfp4-moe-backend")}, {"q-scale-benign"}),
    "gpu-from-source-h100-nvfp4-marlin.log": (
        {("warning", "nvfp4-moe-backend"), ("warning", "marlin-fp4-fallback"), ("warning", "kv-scale-1.0")},
        set(),
    ),
    "gpu-from-source-gb10-nvfp4-flashinfer-cutlass.log": (set(), {"nvfp4-moe-backend", "q-scale-benign"}),
    "gpu-from-source-b200-nvfp4-trtllm.log": (set(), {"nvfp4-moe-backend", "nvfp4-linear-kernel"}),
}


def diagnose_file(name: str):  # type: ignore[no-untyped-def]
    return diagnose(iter_lines((LOGS / name).read_text(encoding="utf-8")))


def test_every_fixture_has_expectations() -> None:
    assert {p.name for p in LOGS.glob("*.log")} == set(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_findings_per_log(name: str) -> None:
    diagnosis = diagnose_file(name)
    must_problems, must_infos = EXPECTED[name]
    problems = {(f.severity, f.id) for f in diagnosis.findings if f.severity != "info"}
    assert problems == must_problems
    assert must_infos <= {f.id for f in diagnosis.findings}
    expected_version = None if name == "cpu-unrecognized-argument.log" else "0.32.0"
    assert diagnosis.vllm_version == expected_version


def test_json_contract() -> None:
    doc = diagnose_file("cpu-noplugin-ct-nvfp4-moe.log").to_json()
    assert set(doc) == {"vllm_version", "findings"}
    for finding in doc["findings"]:
        assert {"id", "severity", "message", "line"} <= set(finding)
        assert finding["severity"] in SEVERITIES and isinstance(finding["line"], int) and finding["line"] >= 1
    json.dumps(doc)  # serialisable as is


def test_findings_point_at_their_line_and_explain_the_fix() -> None:
    text = (LOGS / "cpu-noplugin-ct-nvfp4-moe.log").read_text()
    finding = next(f for f in diagnose(iter_lines(text)).findings if f.id == "no-nvfp4-moe-backend")
    assert "No NvFp4 MoE backend supports the deployment configuration" in text.splitlines()[finding.line - 1]
    assert "fp4forge-vllm" in (finding.fix or "")
    assert not re.match(r"^\(\w+ pid=\d+\)", finding.text)  # vLLM's prefix is stripped


def test_backend_cases_say_whether_activation_scales_are_honoured() -> None:
    marlin = next(f for f in diagnose_file("gpu-from-source-h100-nvfp4-marlin.log").findings if f.id == "nvfp4-moe-backend")
    assert "W4A16" in marlin.message and "flashinfer_cutlass" in (marlin.fix or "")
    cutlass = next(f for f in diagnose_file("gpu-from-source-gb10-nvfp4-flashinfer-cutlass.log").findings if f.id == "nvfp4-moe-backend")
    assert cutlass.severity == "info" and "honours the activation scales" in cutlass.message


def test_engine_dead_is_benign_only_after_a_sigterm() -> None:
    stopped = next(f for f in diagnose_file("cpu-plugin-ct-w4a4.log").findings if f.id == "engine-dead")
    crashed = next(f for f in diagnose_file("cpu-stock-laguna-moe-sigmoid-router.log").findings if f.id == "engine-dead")
    assert stopped.severity == "info" and crashed.severity == "error"


def test_version_gating_skips_patterns_of_other_versions() -> None:
    line = "(Worker pid=1) INFO 01-01 00:00:00 [nvfp4.py:270] Using 'MARLIN' NvFp4 MoE backend out of potential backends: ['MARLIN']."
    assert [f.id for f in diagnose([line], vllm_version="0.32.0").findings] == ["nvfp4-moe-backend"]
    assert diagnose([line], vllm_version="0.9.0").findings == []  # the oracle log line is newer
    assert [f.id for f in diagnose([line]).findings] == ["nvfp4-moe-backend"]  # unknown version: all apply


def test_repeated_lines_are_reported_once_and_errors_come_first() -> None:
    diagnosis = diagnose_file("cpu-plugin-ct-w4a4.log")
    assert [f.id for f in diagnosis.findings].count("fp4forge-plugin-active") == 1  # logged by 2 processes
    problems = diagnose_file("cpu-noplugin-ct-nvfp4-moe.log").findings
    order = [SEVERITIES.index(f.severity) for f in problems]
    assert order == sorted(order)


def test_incremental_doctor_equals_whole_log() -> None:
    text = (LOGS / "cpu-plugin-modelopt-w4a16-stock-parser.log").read_text()
    doctor = LogDoctor()
    streamed = [f for line in iter_lines(text) for f in doctor.feed(line)]
    assert {(f.id, f.line) for f in streamed} == {(f.id, f.line) for f in diagnose(iter_lines(text)).findings}


def test_pattern_table_is_well_formed() -> None:
    _, patterns = load_patterns()
    ids = [p.id for p in patterns]
    assert len(ids) == len(set(ids))
    for pattern in patterns:
        for group, cases in pattern.cases.items():
            assert group in pattern.regex.groupindex, (pattern.id, group)
            assert all(case.get("severity", "info") in SEVERITIES for case in cases.values())


# -- CLI ----------------------------------------------------------------------------------------
@pytest.fixture()
def app() -> typer.Typer:
    app = typer.Typer()

    @app.callback()
    def main() -> None:
        """fp4forge (test harness)"""

    cli_serve.register(app)
    return app


def test_cli_json_and_exit_codes(app: typer.Typer) -> None:
    runner = CliRunner()
    failed = runner.invoke(app, ["serve", "doctor", str(LOGS / "cpu-noplugin-ct-nvfp4-moe.log"), "--json"])
    assert failed.exit_code == 1
    assert "no-nvfp4-moe-backend" in {f["id"] for f in json.loads(failed.stdout)["findings"]}
    clean = runner.invoke(app, ["serve", "doctor", str(LOGS / "cpu-plugin-ct-w4a4.log")])
    assert clean.exit_code == 0 and "fp4forge-plugin-active" in clean.stdout


def test_cli_reads_stdin(app: typer.Typer) -> None:
    text = (LOGS / "cpu-plugin-modelopt-kv-declared-no-scales.log").read_text()
    result = CliRunner().invoke(app, ["serve", "doctor", "-", "--json"], input=text)
    assert result.exit_code == 0
    assert "kv-scale-1.0" in {f["id"] for f in json.loads(result.stdout)["findings"]}


def test_cli_unreadable_file(app: typer.Typer, tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["serve", "doctor", str(tmp_path / "missing.log")])
    assert result.exit_code == 2
