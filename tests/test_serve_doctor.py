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

FAILED = ("error", "server-failed-to-start")
DIED = ("error", "engine-died")
HTTP = ("error", "http-errors")
# file -> the non-info findings it must produce (exactly), and some info findings it must contain.
EXPECTED: dict[str, tuple[set[tuple[str, str]], set[str]]] = {
    "cpu-plugin-ct-w4a4.log": (set(), {"fp4forge-plugin-active", "fp8-linear-kernel", "shutdown", "engine-dead"}),
    "cpu-plugin-ct-nokv-compiled.log": (set(), {"fp4forge-plugin-active", "fp8-linear-kernel"}),
    # this AVX2 machine cannot keep an FP8 KV cache: no pattern knew it when these were captured
    "cpu-avx2-plugin-ct-w4a4-compiled.log": ({("error", "cpu-fp8-kv-needs-avx512"), FAILED}, {"fp4forge-plugin-active"}),
    "cpu-plugin01-ct-w4a4-no-enforce-eager.log": ({("error", "compile-data-dependent-loop"), FAILED}, {"fp4forge-plugin-active"}),
    # an FP8 KV cache (kv_cache_dtype=fp8 on the engine line) whose checkpoint the doctor is not
    # given: a warning that names how to check the scales
    "cpu-plugin-modelopt-w4a16-stock-parser.log": (
        {("warning", "fp4forge-plugin-active"), ("warning", "reasoning-autoinit-failed"), ("warning", "kv-cache-scales")},
        {"q-scale-benign", "quantization-method"},
    ),
    "cpu-plugin-bf16-moe-fixed-parser.log": (set(), {"fp4forge-plugin-active", "cpu-unquantized-moe"}),
    # the requests in flight when the engine died got HTTP 500
    "cpu-plugin-bf16-seeded-sampling-chunked.log": (
        {("error", "cpu-seeded-sampling-chunked-prefill"), DIED, ("error", "engine-dead"), HTTP}, {"fp4forge-plugin-active"}),
    "cpu-noplugin-ct-nvfp4-moe.log": (
        {("error", "no-nvfp4-moe-backend"), ("warning", "fp8-linear-kernel"), FAILED},
        {"fp4forge-plugin-disabled"},
    ),
    "cpu-noplugin-nvfp4-linear-removed-env-var.log": (
        {("error", "no-nvfp4-linear-kernel"), ("warning", "unknown-env-var"), FAILED},
        {"fp4forge-plugin-disabled"},
    ),
    "cpu-noplugin-fp8-static-attention.log": (
        {("error", "cpu-fp8-quant-op-missing"), ("warning", "fp8-linear-kernel"), FAILED},
        set(),
    ),
    "cpu-stock-laguna-moe-sigmoid-router.log": (
        {("error", "cpu-router-softmax-only"), ("error", "engine-dead"), DIED, HTTP}, set()),
    "cpu-stock-laguna-moe-compiled.log": (
        {("error", "cpu-router-softmax-only"), ("error", "compile-failed"), FAILED}, {"fp4forge-plugin-disabled"}),
    "cpu-plugin-modelopt-kv-declared-no-scales.log": ({("warning", "kv-scale-1.0")}, {"q-scale-benign"}),
    # FP8 KV at scale 1.0 (these runs then stopped at the AVX2 limit): compressed-tensors without
    # its k/v scales is silent (without the checkpoint the doctor says it cannot tell); an
    # undeclared ModelOpt checkpoint with --kv-cache-dtype fp8 gets vLLM's own scale-1.0 line
    "cpu-avx2-plugin-ct-kv-scales-removed.log": (
        {("error", "cpu-fp8-kv-needs-avx512"), FAILED}, {"fp4forge-plugin-active", "kv-cache-scales"}),
    "cpu-avx2-plugin-modelopt-undeclared-kv-fp8.log": (
        {("warning", "kv-scale-1.0"), ("error", "cpu-fp8-kv-needs-avx512"), FAILED}, {"fp4forge-plugin-active"}),
    "cpu-plugin-ct-missing-weight-tracked.log": ({("error", "weights-not-initialized"), FAILED}, set()),
    "cpu-plugin-ct-fp8-moe-calibrated.log": (
        {("warning", "fp8-moe-input-scales-maxed"), ("error", "fp8-moe-unsupported"), FAILED}, {"fp8-linear-kernel"}),
    "cpu-unrecognized-argument.log": ({("error", "unrecognized-arguments"), FAILED}, set()),
    "gpu-from-source-h200-nvfp4-humming.log": ({("warning", "nvfp4-moe-backend")}, {"q-scale-benign"}),
    "gpu-from-source-h100-nvfp4-marlin.log": (
        {("warning", "nvfp4-moe-backend"), ("warning", "marlin-fp4-fallback"), ("warning", "kv-scale-1.0")},
        set(),
    ),
    "gpu-from-source-gb10-nvfp4-flashinfer-cutlass.log": ({("warning", "kv-cache-scales")}, {"nvfp4-moe-backend", "q-scale-benign"}),
    "gpu-from-source-b200-nvfp4-trtllm.log": (set(), {"nvfp4-moe-backend", "nvfp4-linear-kernel"}),
}

# How each real run ended, as observed when the log was captured (the launcher's readiness poll,
# the process's exit code), independent of the doctor: "ready" (served, then stopped by SIGTERM),
# "failed-start" (the process exited before it listed the model), "died" (ready, then the engine
# died on a request).
OUTCOMES: dict[str, str] = {
    "cpu-plugin-ct-w4a4.log": "ready",
    "cpu-plugin-ct-nokv-compiled.log": "ready",
    "cpu-avx2-plugin-ct-w4a4-compiled.log": "failed-start",
    "cpu-plugin01-ct-w4a4-no-enforce-eager.log": "failed-start",
    "cpu-plugin-modelopt-w4a16-stock-parser.log": "ready",
    "cpu-plugin-bf16-moe-fixed-parser.log": "ready",
    "cpu-noplugin-ct-nvfp4-moe.log": "failed-start",
    "cpu-noplugin-nvfp4-linear-removed-env-var.log": "failed-start",
    "cpu-noplugin-fp8-static-attention.log": "failed-start",
    "cpu-stock-laguna-moe-sigmoid-router.log": "died",
    "cpu-plugin-bf16-seeded-sampling-chunked.log": "died",
    "cpu-stock-laguna-moe-compiled.log": "failed-start",
    "cpu-plugin-modelopt-kv-declared-no-scales.log": "ready",
    "cpu-avx2-plugin-ct-kv-scales-removed.log": "failed-start",
    "cpu-avx2-plugin-modelopt-undeclared-kv-fp8.log": "failed-start",
    "cpu-plugin-ct-missing-weight-tracked.log": "failed-start",
    "cpu-plugin-ct-fp8-moe-calibrated.log": "failed-start",
    "cpu-unrecognized-argument.log": "failed-start",
}
# the root exception each failed run's finding must quote (read off the log by hand)
AVX2_ROOT = "NotImplementedError: FP8 KV cache on CPU requires x86 with AVX-512 or AMX."
ROOT_EXCEPTIONS: dict[str, str] = {
    "cpu-avx2-plugin-ct-w4a4-compiled.log": AVX2_ROOT,
    "cpu-plugin-ct-fp8-moe-calibrated.log": "ValueError: Unsupported FP8 MoE backend: NONE",
    "cpu-avx2-plugin-ct-kv-scales-removed.log": AVX2_ROOT,
    "cpu-avx2-plugin-modelopt-undeclared-kv-fp8.log": AVX2_ROOT,
    "cpu-plugin01-ct-w4a4-no-enforce-eager.log": "GuardOnDataDependentSymNode",
    "cpu-noplugin-ct-nvfp4-moe.log": "NotImplementedError: No NvFp4 MoE backend supports the deployment configuration.",
    "cpu-noplugin-nvfp4-linear-removed-env-var.log": "ValueError: Failed to find a kernel that can implement the NVFP4 linear layer.",
    "cpu-noplugin-fp8-static-attention.log": "RuntimeError: _C::static_scaled_fp8_quant() expected at most 0 argument(s)",
    "cpu-stock-laguna-moe-sigmoid-router.log": 'AssertionError (at: assert self.scoring_func == "softmax")',
    # torch.compile's warm-up traces into the router's assertion
    "cpu-stock-laguna-moe-compiled.log": "torch._dynamo.exc.Unsupported: Data-dependent assertion failed",
    "cpu-plugin-ct-missing-weight-tracked.log": "ValueError: Following weights were not initialized from checkpoint",
    "cpu-unrecognized-argument.log": "unrecognized arguments: --moe-backnd marlin",
    "cpu-plugin-bf16-seeded-sampling-chunked.log": "RuntimeError: CPU Generator does not use offset",
}


def diagnose_file(name: str):  # type: ignore[no-untyped-def]
    # find_checkpoint=False: the model paths in the logs may exist on the machine running the tests
    return diagnose(iter_lines((LOGS / name).read_text(encoding="utf-8")), find_checkpoint=False)


def test_every_fixture_has_expectations() -> None:
    assert {p.name for p in LOGS.glob("*.log")} == set(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_findings_per_log(name: str) -> None:
    diagnosis = diagnose_file(name)
    must_problems, must_infos = EXPECTED[name]
    problems = {(f.severity, f.id) for f in diagnosis.findings if f.severity != "info"}
    # vLLM's CPU worker warns when tcmalloc / iomp are not preloaded: a finding exactly when the log says so
    allocator = ("warning", "cpu-allocator-not-preloaded")
    assert (allocator in problems) == ("is not found in LD_PRELOAD" in (LOGS / name).read_text(encoding="utf-8"))
    assert problems - {allocator} == must_problems
    assert must_infos <= {f.id for f in diagnosis.findings}
    expected_version = None if name == "cpu-unrecognized-argument.log" else "0.32.0"
    assert diagnosis.vllm_version == expected_version


def test_every_real_log_has_its_outcome() -> None:
    assert set(OUTCOMES) == {p.name for p in LOGS.glob("cpu-*.log")}
    assert set(ROOT_EXCEPTIONS) == {name for name, outcome in OUTCOMES.items() if outcome != "ready"}


def test_no_failed_server_passes(app: typer.Typer) -> None:
    """issue 17: over every real log, zero exit-0 on a server that failed to start or died, and no
    failure finding on one that served."""
    runner = CliRunner()
    passed_dead, flagged_healthy, failed_runs = [], [], 0
    for name, outcome in sorted(OUTCOMES.items()):
        result = runner.invoke(app, ["serve", "doctor", str(LOGS / name), "--json"])
        ids = {f["id"] for f in json.loads(result.stdout)["findings"] if f["severity"] == "error"}
        if outcome == "ready":
            if ids & {FAILED[1], DIED[1]}:
                flagged_healthy.append(name)
            continue
        failed_runs += 1
        if result.exit_code != 1 or not ids & {FAILED[1], DIED[1]}:
            passed_dead.append(name)
    assert failed_runs == 13
    assert passed_dead == [] and flagged_healthy == []
    # docs/reliability.md states this figure; it must be the one measured here.
    figure = (f"{len(OUTCOMES)} real vLLM logs, {failed_runs} of them from servers that failed to start or died: "
              f"{len(passed_dead)} exit 0, {failed_runs - len(passed_dead)} exit 1 with a failure finding; "
              f"{len(OUTCOMES) - failed_runs} from servers that served: {len(flagged_healthy)} flagged as failed")
    reliability = (Path(__file__).parents[1] / "docs" / "reliability.md").read_text(encoding="utf-8")
    assert figure in " ".join(reliability.split()), figure


@pytest.mark.parametrize("name", sorted(ROOT_EXCEPTIONS))
def test_failure_finding_quotes_the_root_exception_and_a_fix(name: str) -> None:
    findings = diagnose_file(name).findings
    (failure,) = [f for f in findings if f.id in (FAILED[1], DIED[1])]
    assert ROOT_EXCEPTIONS[name] in failure.message
    assert (FAILED[1] if OUTCOMES[name] == "failed-start" else DIED[1]) == failure.id
    specific = [f for f in findings if f.severity == "error" and f.id not in (FAILED[1], DIED[1], "engine-dead")]
    assert specific and specific[0].fix and specific[0].fix in (failure.fix or "")


@pytest.mark.parametrize(
    ("log", "pattern", "exception"),
    [("cpu-noplugin-ct-nvfp4-moe.log", "no-nvfp4-moe-backend", "NotImplementedError"),
     # captured before fp4forge had a pattern for it: the doctor said "failed" all the same
     ("cpu-avx2-plugin-ct-w4a4-compiled.log", "cpu-fp8-kv-needs-avx512", AVX2_ROOT)],
)
def test_an_unknown_failure_is_still_an_error(log: str, pattern: str, exception: str) -> None:
    """A start-up failure no pattern knows (a real log, the doctor without the pattern that knows
    it) still fails the log, quoting the root exception."""
    import fp4forge.serve.doctor as doctor_module

    version_regexes, patterns = load_patterns()
    unknown = (version_regexes, tuple(p for p in patterns if p.id != pattern))
    original = doctor_module.load_patterns
    doctor_module.load_patterns = lambda: unknown  # the pattern that knows this failure is gone
    try:
        diagnosis = diagnose(iter_lines((LOGS / log).read_text()), find_checkpoint=False)
    finally:
        doctor_module.load_patterns = original
    assert pattern not in {f.id for f in diagnosis.findings}
    (failure,) = [f for f in diagnosis.findings if f.severity == "error"]
    assert failure.id == FAILED[1] and exception in failure.message
    assert "fp4forge knows no fix" in (failure.fix or "")


def test_a_log_cut_at_readiness_or_still_starting_is_not_a_failure() -> None:
    text = (LOGS / "cpu-plugin-ct-w4a4.log").read_text().splitlines()
    ready = next(i for i, line in enumerate(text) if "Application startup complete" in line)
    assert not [f for f in diagnose(text[: ready + 1]).findings if f.severity == "error"]
    assert not [f for f in diagnose(text[:40]).findings if f.severity == "error"]


def test_a_process_that_exited_before_ready_is_a_failure_even_without_a_traceback() -> None:
    """serve up sees the process exit; a SIGKILLed server (out of memory) leaves no exception."""
    text = (LOGS / "cpu-plugin-ct-w4a4.log").read_text().splitlines()
    ready = next(i for i, line in enumerate(text) if "Application startup complete" in line)
    doctor = LogDoctor()
    for line in text[: ready - 5]:
        doctor.feed(line)
    assert not [f for f in doctor.diagnosis().findings if f.severity == "error"]
    (failure,) = [f for f in doctor.diagnosis(process_exited=True).findings if f.severity == "error"]
    assert failure.id == FAILED[1] and "exited with no exception" in failure.message


def test_the_laguna_router_failure_says_start_up() -> None:
    finding = next(f for f in diagnose_file("cpu-stock-laguna-moe-compiled.log").findings if f.id == "cpu-router-softmax-only")
    assert "at start-up" in finding.message and "--enforce-eager" in finding.message
    assert "Application startup complete" not in (LOGS / "cpu-stock-laguna-moe-compiled.log").read_text()


def test_fp8_moe_max_input_scale_is_recognised() -> None:
    """Calibrated FP8 experts have differing input scales; vLLM uses their max (real run)."""
    findings = {f.id: f for f in diagnose_file("cpu-plugin-ct-fp8-moe-calibrated.log").findings}
    finding = findings["fp8-moe-input-scales-maxed"]
    assert finding.severity == "warning" and "maximum over all experts" in finding.message
    assert "Found input_scales that are not equal for fp8 MoE layer" in finding.text


def test_line_numbers_match_the_file(app: typer.Typer) -> None:
    """A progress bar's carriage return is not a line break: the CLI's line is the file's line."""
    path = LOGS / "cpu-plugin-ct-fp8-moe-calibrated.log"
    raw = path.read_bytes().split(b"\n")
    result = CliRunner().invoke(app, ["serve", "doctor", str(path), "--json"])
    finding = next(f for f in json.loads(result.stdout)["findings"] if f["id"] == "fp8-moe-input-scales-maxed")
    assert b"Found input_scales that are not equal" in raw[finding["line"] - 1]


def test_compile_failure_names_enforce_eager() -> None:
    findings = {f.id: f for f in diagnose_file("cpu-plugin01-ct-w4a4-no-enforce-eager.log").findings}
    assert "--enforce-eager" in (findings["compile-data-dependent-loop"].fix or "")
    assert "--enforce-eager" in (findings[FAILED[1]].fix or "")


def test_json_contract() -> None:
    doc = diagnose_file("cpu-noplugin-ct-nvfp4-moe.log").to_json()
    assert list(doc) == ["verdict", "vllm_version", "findings"]  # the verdict first
    assert set(doc["verdict"]) == {"state", "phase", "phase_name", "line", "evidence", "summary"}
    assert doc["verdict"]["state"] == "failed" and doc["verdict"]["phase"] == "kernels"
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
    whole = {(f.id, f.line) for f in diagnose(iter_lines(text)).findings}
    assert {(f.id, f.line) for f in streamed} | {(f.id, f.line) for f in doctor.diagnosis().findings} == whole
    # what only the whole log can say (did it come up, the KV cache's scales) comes with diagnosis()
    assert {i for i, _ in whole - {(f.id, f.line) for f in streamed}} <= {FAILED[1], DIED[1], "kv-cache-scales"}


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


# -- FP8 KV cache at scale 1.0, inferred from the log and the checkpoint ----------------------------
def _strip_kv_scales(src: Path, out: Path) -> Path:
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, out)
    for shard in out.glob("*.safetensors"):
        tensors = load_file(shard)
        save_file({k: v for k, v in tensors.items() if not k.endswith(("k_scale", "v_scale"))}, shard, metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def kv_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The checkpoints the kv logs were served from, rebuilt the same way (tests/fixtures/vllm_logs/README.md)."""
    from fp4forge.quantize.act_scales import parse_act_scales
    from fp4forge.quantize.export import QuantizeOptions, quantize_checkpoint
    from fp4forge.quantize.recipe import load_recipe
    from fp4forge.testbed import build_tiny_laguna

    root = tmp_path_factory.mktemp("doctor-kv")
    bf16 = build_tiny_laguna(root / "bf16", seed=0)

    def quantize(name: str, recipe: str, layout: str) -> Path:
        options = QuantizeOptions(recipe=load_recipe(recipe), layout_format=layout, act_amax=parse_act_scales("constant:8", None))
        quantize_checkpoint(bf16, root / name, options)
        return root / name

    ct = quantize("ct", "nvfp4-experts-fp8-attn", "compressed-tensors")
    return {
        "ct": ct,
        "ct-kv-scales-removed": _strip_kv_scales(ct, root / "ct-kv-scales-removed"),
        "modelopt-undeclared": quantize("modelopt-undeclared", "nvfp4-experts", "modelopt"),
    }


def test_silent_kv_scale_one_is_a_warning_with_the_checkpoint(kv_checkpoints: dict[str, Path]) -> None:
    """compressed-tensors FP8 KV whose k/v scales were deleted: vLLM 0.32 says nothing."""
    text = (LOGS / "cpu-avx2-plugin-ct-kv-scales-removed.log").read_text()
    checkpoint, says = "ct-kv-scales-removed", "only 0/8 k/v scales ship"
    # vLLM had loaded the weights (the scale-1.0 line comes from that step) and said nothing
    assert "Loading weights took" in text and "Using KV cache scaling factor 1.0" not in text
    path = str(kv_checkpoints[checkpoint])
    (finding,) = [f for f in diagnose(iter_lines(text), checkpoint=path).findings if f.id == "kv-cache-scales"]
    assert finding.severity == "warning" and says in finding.message
    assert f"fp4forge kv show {path}" in (finding.fix or "") and "fp4forge audit" in (finding.fix or "")
    # without the checkpoint the doctor cannot tell, and says how to check
    unknown = [f for f in diagnose(iter_lines(text), find_checkpoint=False).findings if f.id == "kv-cache-scales"]
    assert all(f.severity == "info" for f in unknown)


def test_vllms_own_scale_one_line_is_not_repeated(kv_checkpoints: dict[str, Path]) -> None:
    """An undeclared ModelOpt checkpoint served with --kv-cache-dtype fp8: vLLM 0.32 says it (the
    real run shows the line), the doctor reports that line and adds no second finding; serve cmd's
    rule (kv_cache_verdict) calls the same case a warning."""
    from fp4forge.serve.recommend import kv_cache_verdict, read_checkpoint_facts

    path = str(kv_checkpoints["modelopt-undeclared"])
    text = (LOGS / "cpu-avx2-plugin-modelopt-undeclared-kv-fp8.log").read_text()
    assert "--kv-cache-dtype fp8" in text.splitlines()[0]
    ids = [f.id for f in diagnose(iter_lines(text), checkpoint=path).findings]
    assert "kv-scale-1.0" in ids and "kv-cache-scales" not in ids
    verdict = kv_cache_verdict(read_checkpoint_facts(path), "fp8")
    assert verdict is not None and verdict.severity == "warning" and "declares no KV quantization" in verdict.message


def test_kv_with_calibrated_scales_is_quiet(kv_checkpoints: dict[str, Path]) -> None:
    text = (LOGS / "cpu-plugin-ct-w4a4.log").read_text()
    assert "kv-cache-scales" not in {f.id for f in diagnose(iter_lines(text), checkpoint=str(kv_checkpoints["ct"])).findings}


def test_doctor_and_serve_cmd_share_the_kv_rule(kv_checkpoints: dict[str, Path]) -> None:
    from fp4forge.serve.recommend import read_checkpoint_facts, recommend

    path = str(kv_checkpoints["ct-kv-scales-removed"])
    text = (LOGS / "cpu-avx2-plugin-ct-kv-scales-removed.log").read_text()
    doctor = next(f for f in diagnose(iter_lines(text), checkpoint=path).findings if f.id == "kv-cache-scales")
    # the scale rule speaks where the FP8 cache runs: a CPU with AVX-512/AMX
    rec = recommend(path, read_checkpoint_facts(path), "cpu", "0.32.0", cpu_fp8_kv=True)
    assert any(doctor.message in w for w in rec.warnings)


def test_doctor_fix_for_avx2_names_the_serve_lines_override(kv_checkpoints: dict[str, Path]) -> None:
    """On a CPU without AVX-512/AMX the doctor's fix and serve cmd give the same override."""
    from fp4forge.serve.recommend import read_checkpoint_facts, recommend

    text = (LOGS / "cpu-avx2-plugin-ct-w4a4-compiled.log").read_text()
    fix = next(f for f in diagnose(iter_lines(text)).findings if f.id == "cpu-fp8-kv-needs-avx512").fix or ""
    path = str(kv_checkpoints["ct"])
    rec = recommend(path, read_checkpoint_facts(path), "cpu", "0.32.0", cpu_fp8_kv=False)
    assert rec.kv_fallback is not None
    override = " ".join(rec.kv_fallback.to_json()["argv"])
    assert override == "--dtype bfloat16 --kv-cache-dtype bfloat16"  # checked with a real vLLM 0.32 start on AVX2
    assert f"`{override}`" in fix


def test_cli_doctor_takes_the_checkpoint(app: typer.Typer, kv_checkpoints: dict[str, Path]) -> None:
    log = str(LOGS / "cpu-avx2-plugin-ct-kv-scales-removed.log")
    result = CliRunner().invoke(app, ["serve", "doctor", log, "--checkpoint", str(kv_checkpoints["ct-kv-scales-removed"]), "--json"])
    assert result.exit_code == 1, result.output  # the run itself failed (AVX2)
    assert ("warning", "kv-cache-scales") in {(f["severity"], f["id"]) for f in json.loads(result.stdout)["findings"]}
    missing = CliRunner().invoke(app, ["serve", "doctor", log, "--checkpoint", "/nonexistent/ckpt"])
    assert missing.exit_code == 2
