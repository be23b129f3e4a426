"""`fp4forge serve doctor` against its corpus of real vLLM logs (tests/doctor_corpus/corpus.toml):
fp4forge's own vLLM CPU servers driven into failures, and start-up logs users published in public
vLLM threads (GPU: Hopper, Ampere, Blackwell datacenter and consumer, GB10, Jetson; ROCm; XPU;
vLLM 0.5 to 0.32). Each log's truth (how the run ended, the phase, the cause) comes from the run or
the thread, never from the doctor. Pure parsing: no server is started here."""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from fp4forge.errors import NotAVllmLogError
from fp4forge.serve.doctor import LogDoctor, diagnose_text, iter_lines
from fp4forge.serve.doctor_startup import STATES, load_startup_table, split_prefix
from tests.test_serve_doctor import app  # noqa: F401  (the CLI harness fixture)

CORPUS = Path(__file__).parent / "doctor_corpus"
SERVE = Path(__file__).parents[1] / "src" / "fp4forge" / "serve"
ENTRIES: list[dict[str, Any]] = tomllib.loads((CORPUS / "corpus.toml").read_text(encoding="utf-8"))["log"]
BY_FILE = {entry["file"]: entry for entry in ENTRIES}
DEAD = ("failed", "died")
PHASES = {p.id for p in load_startup_table().phases}
FAILURE_IDS = {"server-failed-to-start", "engine-died"}


def read(entry: dict[str, Any]) -> str:
    # newline="": a progress bar's "\r" is not a line break (as the CLI reads a file)
    with open(CORPUS / entry["file"], encoding="utf-8", errors="replace", newline="") as handle:
        return handle.read()


def diagnosis_of(entry: dict[str, Any]):  # type: ignore[no-untyped-def]
    # find_checkpoint=False: the model paths in the logs may exist on the machine running the tests
    return diagnose_text(read(entry), find_checkpoint=False)


def test_the_corpus_is_whole_and_well_formed() -> None:
    assert len(ENTRIES) >= 40
    listed = {(CORPUS / e["file"]).resolve() for e in ENTRIES}
    assert {p.resolve() for p in CORPUS.glob("*.log")} <= listed  # no log without its truth
    for entry in ENTRIES:
        assert (CORPUS / entry["file"]).is_file(), entry["file"]
        assert entry["state"] in STATES and entry["diagnosis"] and entry["source"]
        assert entry["source"] == "fp4forge" or entry["source"].startswith("https://github.com/")
        assert entry.get("phase", "") in PHASES | {""}, entry["file"]
        if entry["state"] in DEAD or entry["state"] == "cannot-tell":
            assert "phase" in entry, entry["file"]
    assert sum(e["source"] != "fp4forge" for e in ENTRIES) >= 20


@pytest.mark.parametrize("name", sorted(BY_FILE))
def test_verdict_state_per_log(name: str) -> None:
    """How each run ended is the verdict (the phase and the cause are counted in the figures)."""
    entry = BY_FILE[name]
    diagnosis = diagnosis_of(entry)
    assert diagnosis.verdict.state == entry["state"], diagnosis.verdict_line
    errors = {f.id for f in diagnosis.findings if f.severity == "error"}
    if entry["state"] in ("ready", "cannot-tell"):
        assert errors == set(entry.get("errors", [])), errors
    if entry["state"] in DEAD:
        assert errors & FAILURE_IDS, errors
        assert not diagnosis.passes() and not diagnosis.passes(partial=True)


def measure(app: typer.Typer) -> dict[str, Any]:
    """The figures docs/reliability.md states, from the command line on every log."""
    runner = CliRunner()
    figures: dict[str, Any] = {"logs": len(ENTRIES), "threads": sum(e["source"] != "fp4forge" for e in ENTRIES),
                               "dead": 0, "dead_exit_0": [], "phased": 0, "phase_right": 0, "phase_wrong": [],
                               "caused": 0, "cause_right": 0, "cause_wrong": [], "healthy": 0, "false_errors": []}
    for entry in ENTRIES:
        result = runner.invoke(app, ["serve", "doctor", str(CORPUS / entry["file"]), "--json"])
        doc = json.loads(result.stdout)
        verdict, state = doc["verdict"], entry["state"]
        if state in DEAD:
            figures["dead"] += 1
            if result.exit_code == 0:
                figures["dead_exit_0"].append(entry["file"])
        if state != "ready":
            figures["phased"] += 1
            right = verdict["state"] == state and (verdict["phase"] or "") == entry["phase"]
            figures["phase_right"] += right
            if not right:
                figures["phase_wrong"].append(entry["file"])
        if entry.get("cause"):
            figures["caused"] += 1
            right = entry["cause"] in verdict["evidence"]
            figures["cause_right"] += right
            if not right:
                figures["cause_wrong"].append(entry["file"])
        if state in ("ready", "cannot-tell"):  # not known to be dead: every error must be a true one
            figures["healthy"] += 1
            errors = {f["id"] for f in doc["findings"] if f["severity"] == "error"}
            if errors - set(entry.get("errors", [])):
                figures["false_errors"].append(entry["file"])
    return figures


def test_reliability_figures(app: typer.Typer) -> None:
    """issue 35's bar: no dead server exits 0; the phase is right on >= 95 %, the quoted cause on
    >= 90 %; no false error on a healthy log. docs/reliability.md states these very counts."""
    f = measure(app)
    assert f["dead_exit_0"] == [] and f["false_errors"] == []
    assert f["phase_right"] >= 0.95 * f["phased"], f["phase_wrong"]
    assert f["cause_right"] >= 0.90 * f["caused"], f["cause_wrong"]
    figure = (f"{f['logs']} real vLLM logs ({f['threads']} from public threads), {f['dead']} of them from servers that "
              f"failed to start or died: {len(f['dead_exit_0'])} exit 0. The phase is right on {f['phase_right']} of "
              f"{f['phased']} logs that did not come up, the quoted cause on {f['cause_right']} of {f['caused']} logs "
              f"that hold it; {f['healthy']} logs from servers that came up or were still starting: "
              f"{len(f['false_errors'])} false errors")
    reliability = (Path(__file__).parents[1] / "docs" / "reliability.md").read_text(encoding="utf-8")
    assert figure in " ".join(reliability.split()), figure
    misses = sorted(set(f["phase_wrong"]) | set(f["cause_wrong"]))
    assert all(Path(m).name in reliability for m in misses), misses  # every miss is named there


# -- what is not a whole vLLM log ------------------------------------------------------------------
HEALTHY = CORPUS / "cpu-healthy-served.log"


@pytest.mark.parametrize(("content", "kind"), [
    (b"", "empty"),
    (b"\n\n   \n", "empty"),
    (bytes(range(256)) * 40, "binary"),
    (b"GET /index.html 200\nnginx: worker process started\n", "not-vllm"),
])
def test_not_a_vllm_log_is_a_named_error(app: typer.Typer, tmp_path: Path, content: bytes, kind: str) -> None:
    path = tmp_path / "input.log"
    path.write_bytes(content)
    result = CliRunner().invoke(app, ["serve", "doctor", str(path), "--json"])
    assert result.exit_code == 2
    doc = json.loads(result.stdout)
    assert doc["verdict"] == {"state": kind} and doc["error"]
    with pytest.raises(NotAVllmLogError) as raised:
        diagnose_text(content.decode("utf-8", errors="replace"))
    assert raised.value.kind == kind


def test_a_log_cut_during_start_up_cannot_tell(app: typer.Typer, tmp_path: Path) -> None:
    """A healthy start-up cut after its weights loaded: the verdict names the phase it ends at,
    exit 1 (the log does not show the server came up), exit 0 with --partial."""
    lines = HEALTHY.read_text(encoding="utf-8").split("\n")
    cut = next(i for i, line in enumerate(lines) if "Loading weights took" in line) + 1
    path = tmp_path / "cut.log"
    path.write_text("\n".join(lines[:cut]) + "\n", encoding="utf-8")
    runner = CliRunner()
    result = runner.invoke(app, ["serve", "doctor", str(path)])
    assert result.exit_code == 1
    first = result.stdout.splitlines()[0]
    assert first.startswith("cannot tell: the log ends at phase kv-cache"), first
    assert runner.invoke(app, ["serve", "doctor", str(path), "--partial"]).exit_code == 0
    doc = json.loads(runner.invoke(app, ["serve", "doctor", str(path), "--json"]).stdout)
    assert doc["verdict"]["state"] == "cannot-tell" and doc["verdict"]["phase"] == "kv-cache"
    assert not [f for f in doc["findings"] if f["severity"] == "error"]


def test_the_verdict_is_printed_first(app: typer.Typer) -> None:
    runner = CliRunner()
    for name, start in [("cpu-healthy-served.log", "ready: "), ("cpu-max-model-len-too-long.log", "failed at phase config"),
                        ("gh-vllm-20170-custom-allreduce-died.log", "died after ready")]:
        result = runner.invoke(app, ["serve", "doctor", str(CORPUS / name)])
        assert result.stdout.splitlines()[0].startswith(start), result.stdout[:200]
        assert result.exit_code == (0 if start == "ready: " else 1)
        doc = json.loads(runner.invoke(app, ["serve", "doctor", str(CORPUS / name), "--json"]).stdout)
        assert list(doc)[0] == "verdict" and doc["verdict"]["summary"].startswith(start)


def test_the_cause_not_the_wrapper() -> None:
    """The API server's "see root cause above" is never the quoted cause when the engine's own
    exception is in the log; when it is not, the verdict says the log lacks it."""
    for entry in ENTRIES:
        verdict = diagnosis_of(entry).verdict
        if verdict.state in DEAD and "Engine core initialization failed" in read(entry) and entry.get("cause"):
            assert "Engine core initialization failed" not in verdict.evidence
    wrapper_only = diagnosis_of(BY_FILE["gh-vllm-44411-wrapper-only.log"]).verdict
    assert verdict_says_cause_missing(wrapper_only.evidence)


def verdict_says_cause_missing(evidence: str) -> bool:
    return "only the wrapper is in this log" in evidence


def test_a_chat_template_server_answering_400_fails(app: typer.Typer) -> None:
    """A server that answered every chat request with HTTP 400 does not pass (issue 35)."""
    result = CliRunner().invoke(app, ["serve", "doctor", str(CORPUS / "cpu-no-chat-template-http-400.log"), "--json"])
    assert result.exit_code == 1
    doc = json.loads(result.stdout)
    assert doc["verdict"]["state"] == "ready"
    (http,) = [f for f in doc["findings"] if f["id"] == "http-errors"]
    assert http["severity"] == "error" and "2 of 2 requests to /v1/chat/completions" in http["message"]
    completions = [f for f in doc["findings"] if f["id"] == "http-errors" and "/v1/completions" in f["message"]]
    assert completions == []  # the completion request got 200


def test_streamed_and_whole_log_agree() -> None:
    """serve up streams lines into the doctor: asking for the verdict mid-way changes nothing."""
    text = read(BY_FILE["gh-vllm-25837-free-memory-below-utilization.log"])
    doctor = LogDoctor()
    for line in iter_lines(text):
        doctor.feed(line)
        doctor.diagnosis()
    assert doctor.diagnosis().verdict == diagnose_text(text).verdict


# -- the pipeline and the card show the verdict line of every server they start --------------------
def test_pipeline_and_card_show_each_servers_verdict(tmp_path: Path) -> None:
    import shutil
    from types import SimpleNamespace

    from fp4forge.pipeline.steps import Context, ServerSlot
    from fp4forge.report.card import render_card
    from fp4forge.serve.doctor import diagnose

    fixtures = Path(__file__).parent / "fixtures"
    ckpt = tmp_path / "tiny-laguna-nvfp4"
    shutil.copytree(fixtures / "card" / "ckpt", ckpt)
    died, clean = fixtures / "vllm_logs" / "cpu-stock-laguna-moe-sigmoid-router.log", HEALTHY
    ctx = Context(ckpt.parent / "tiny-laguna", ckpt, SimpleNamespace(serve_hardware="cpu"))  # type: ignore[arg-type]
    for role, log in (("student", died), ("teacher", clean)):
        slot = ServerSlot(ctx, ckpt if role == "student" else ctx.src, role)
        slot.ready_line, slot.ready_seconds, slot.steps = 100, 60.0, ["serve"]
        command = log.read_text(encoding="utf-8").splitlines()[0][2:].split()  # the launcher's first line
        slot._keep_life(SimpleNamespace(log=str(log), command=command, env={}))
    lives = {role: json.loads((ckpt / "reports" / "servers" / f"{role}.json").read_text()) for role in ("student", "teacher")}
    assert lives["student"]["verdict"]["state"] == "died" and lives["teacher"]["verdict"]["state"] == "ready"
    # serve.json holds the verdict of the start-up the serve step watched (fed up to readiness)
    serve = json.loads((ckpt / "reports" / "serve.json").read_text())
    lines = clean.read_text(encoding="utf-8").split("\n")
    ready = next(i for i, line in enumerate(lines) if "Application startup complete" in line) + 1
    serve["verdict"] = diagnose(lines[:ready]).verdict.to_json()
    (ckpt / "reports" / "serve.json").write_text(json.dumps(serve))
    card = render_card(ckpt).markdown.replace("`", "")
    assert f"The log doctor's verdict: {serve['verdict']['summary']}" in card
    for role, life in lives.items():
        assert f"{role}: the log doctor's verdict over its whole log: {life['verdict']['summary']}" in card


def test_the_engines_exception_is_the_cause_across_processes() -> None:
    """The engine core's traceback, then the API server's "see root cause above" (two real
    excerpts of vLLM >= 0.10, in the order vLLM prints them): the engine's exception is quoted."""
    engine = read(BY_FILE["gh-vllm-25837-free-memory-below-utilization.log"])
    api_server = read(BY_FILE["gh-vllm-44411-wrapper-only.log"])
    verdict = diagnose_text(engine + api_server).verdict
    assert verdict.state == "failed" and verdict.phase == "workers"
    assert verdict.evidence.startswith("ValueError: Free memory on device")


def test_an_exception_the_start_up_survived_is_not_the_cause() -> None:
    """A traceback early in a start-up that then went on to later phases and served was handled."""
    lines = HEALTHY.read_text(encoding="utf-8").split("\n")
    at = next(i for i, line in enumerate(lines) if "Starting to load model" in line)
    early = read(BY_FILE["gh-vllm-14452-rtx5080-no-kernel-image.log"]).split("\n")[:3]  # a bare RuntimeError
    verdict = diagnose_text("\n".join(lines[:at] + early + lines[at:])).verdict
    assert verdict.state == "ready"
    cut_there = diagnose_text("\n".join(lines[:at] + early)).verdict
    assert cut_there.state == "failed" and "no kernel image" in cut_there.evidence


def test_the_explained_lines_are_vllms_own(vllm_venv: Path) -> None:
    """Each pattern that names its vLLM 0.32 source (`in_source`) is checked against the installed
    vLLM: the file exists and holds the literal the pattern's regex matches."""
    table = tomllib.loads((Path(__file__).parents[1] / "src" / "fp4forge" / "serve" / "doctor_patterns.toml").read_text())
    sources = {p["id"]: p["in_source"] for p in table["pattern"] if "in_source" in p}
    assert len(sources) >= 10
    site = next((vllm_venv / "lib").glob("python3.*/site-packages/vllm"), None)
    assert site is not None, f"no vllm package in {vllm_venv}"
    for pattern_id, (path, literal) in sources.items():
        text = (site / path).read_text(encoding="utf-8")
        assert literal in text, (pattern_id, path, literal)


# -- the markers' evidence: vLLM's own sources, release by release ---------------------------------
# scripts/vllm_startup_markers.py reads every line regex of doctor_startup.toml and
# doctor_patterns.toml against the string constants of 17 vLLM releases' source distributions
# (0.5.4 to 0.34.0, from PyPI, by sha256) and of the serving libraries (uvicorn, torch);
# src/fp4forge/serve/_vllm_startup_markers.json keeps the result.
SCRIPT = Path(__file__).parents[1] / "scripts" / "vllm_startup_markers.py"


def _marker_script():  # type: ignore[no-untyped-def]
    import importlib.util

    spec = importlib.util.spec_from_file_location("vllm_startup_markers", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _evidence() -> dict[str, Any]:
    return json.loads(_marker_script().DATA.read_text(encoding="utf-8"))


def test_the_marker_evidence_is_current() -> None:
    """The data file covers exactly the regexes the two tables hold now (regenerate it with the
    script after editing a table)."""
    rows = _evidence()["markers"]
    assert [(r["where"], r["regex"]) for r in rows] == _marker_script().table_markers()


def _in_corpus_logs(regex: str) -> bool:
    compiled = re.compile(regex)
    return any(compiled.search(split_prefix(line)[1]) for entry in ENTRIES for line in read(entry).split("\n"))


def test_every_marker_is_printed_by_vllm_or_seen_in_a_real_log() -> None:
    """No line pattern without evidence: a vLLM release's source prints it, a serving library does,
    or a real log of the corpus holds it (torch's older device warnings, argparse's usage error)."""
    rows = _evidence()["markers"]
    unevidenced = [r["where"] + " " + r["regex"] for r in rows if not (r["vllm"] or r["libraries"] or _in_corpus_logs(r["regex"]))]
    assert not unevidenced, unevidenced
    printed = sum(bool(r["vllm"] or r["libraries"]) for r in rows)
    assert printed / len(rows) >= 0.85, f"only {printed} of {len(rows)} patterns found in the sources"
    stated = (SERVE.parents[2] / "docs" / "serve.md").read_text(encoding="utf-8")
    assert f"Of the {len(rows)} line patterns, {printed} are found in the sources; the other {len(rows) - printed} are" in stated


def test_release_ranges_come_from_the_sources() -> None:
    """One home: a pattern whose line some vLLM release's source prints takes its release range from
    that evidence, so it carries no hand-written `vllm`; the derived range holds every release read
    that prints the line, and the doctor applies it."""
    from fp4forge.serve.doctor import derived_versions, load_patterns, release_evidence

    table = tomllib.loads((SERVE / "doctor_patterns.toml").read_text(encoding="utf-8"))["pattern"]
    releases, printed = release_evidence()
    both = [p["id"] for p in table if p.get("vllm") and printed.get(p["id"])]
    assert not both, f"hand-written vllm ranges where the sources say: {both}"
    compiled = {p.id: p for p in load_patterns()[1]}
    for pattern_id, versions in printed.items():
        if versions:
            derived = derived_versions(versions, releases)
            assert all(v in derived for v in versions), pattern_id
            assert compiled[pattern_id].versions == derived, pattern_id


def test_derived_ranges_by_hand() -> None:
    from fp4forge.serve.doctor import derived_versions

    releases = ("0.5.4", "0.9.2", "0.10.2", "0.32.0", "0.34.0")
    assert str(derived_versions(["0.10.2", "0.32.0"], releases)) == "<0.34.0,>0.9.2"
    assert str(derived_versions(["0.5.4"], releases)) == "<0.9.2"
    assert str(derived_versions(["0.32.0", "0.34.0"], releases)) == ">0.10.2"


@pytest.mark.slow
def test_the_032_evidence_equals_the_installed_vllm(vllm_venv: Path) -> None:
    """The shipped evidence for 0.32.0 (read from PyPI's sdist) equals what the installed vLLM CPU
    build's own files give: the script reads sources the way the engine runs them."""
    script = _marker_script()
    site = next((vllm_venv / "lib").glob("python3.*/site-packages/vllm"))
    constants: set[str] = set()
    for path in site.rglob("*.py"):
        constants |= script.string_constants(path.read_text(encoding="utf-8", errors="replace"))
    installed = script.searchable(constants)
    for row in _evidence()["markers"]:
        assert any(script.found_in(lit, installed) for lit in row["literals"]) == ("0.32.0" in row["vllm"]), row["where"]
