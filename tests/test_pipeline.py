"""`fp4forge pipeline` on the tiny Laguna: every step's artifact, skip by content hash, resume after
a failed step and after Ctrl-C, refusal of outputs it does not own.

The oracles are the files themselves: an artifact that a re-run must not redo keeps its inode and
mtime; one it must redo changes; the checkpoint the pipeline writes equals `fp4forge quantize`'s
with the same statistics byte for byte (safetensors reads both).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from safetensors import safe_open

from fp4forge.calibrate.run import CalibrationOptions
from fp4forge.errors import ConfigError
from fp4forge.fidelity.evaluate import FidelityOptions
from fp4forge.quantize.job import QuantizeJob
from fp4forge.pipeline import PipelineFailed, PipelineOptions, run_pipeline
from fp4forge.pipeline.steps import STEPS
from fp4forge.serve.recommend import cpu_has_fp8_kv

RECIPE = "nvfp4-experts-fp8-attn"
SMALL = PipelineOptions(quantize=QuantizeJob(recipe=RECIPE), calibration=CalibrationOptions(samples=4, seq_len=64),
                        fidelity=FidelityOptions(samples=2, seq_len=64, builtin_corpus=True, allow_unreadable=True))  # random: reads no text
LOCAL_STEPS = ["calibrate", "quantize", "kv", "audit", "bytes", "fidelity", "serve-cmd", "card"]
OFF_STEPS = ["diff", "serve", "perf", "quality", "quality-teacher"]
FP4FORGE = str(Path(sys.executable).with_name("fp4forge"))  # the installed command, as people run it


def statuses(out: Path) -> dict[str, str]:
    doc = json.loads((out / "reports" / "pipeline.json").read_text())
    return {s["name"]: s["status"] for s in doc["steps"]}


def stamp(path: Path) -> tuple[int, int]:
    st = path.stat()
    return st.st_ino, st.st_mtime_ns


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from fp4forge.testbed import build_tiny_laguna

    return build_tiny_laguna(tmp_path_factory.mktemp("pipeline") / "tiny-laguna", seed=0)


@pytest.fixture(scope="module")
def first_run(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("pipeline-out") / "out"
    run_pipeline(model, out, SMALL)
    return out


def test_every_step_writes_its_artifact(first_run: Path) -> None:
    state = statuses(first_run)
    assert [n for n, s in state.items() if s == "done"] == LOCAL_STEPS
    assert [n for n, s in state.items() if s == "off"] == OFF_STEPS
    reports = first_run / "reports"
    for name in ("calibration.json", "calibration-stats.safetensors", "quantize.json", "kv.json", "audit.json", "shards.json",
                 "bytes.json", "fidelity.json", "serve-cmd.json", "plots/bytes.png"):
        assert (reports / name).is_file(), name
    from huggingface_hub import ModelCard

    assert ModelCard.load(first_run / "README.md").text.lstrip().startswith("# out")  # after the Hub front matter
    # The first screen carries the verdict and its reasons: not served here, so not established.
    first_screen = "\n".join((first_run / "README.md").read_text().splitlines()[:25])
    assert "## Verdict" in first_screen and "**NOT ESTABLISHED.** Decided by:" in first_screen
    assert "- **served: not established**" in first_screen and "`reports/serve.json` is missing" in first_screen
    assert "- **audit: holds**" in first_screen and "Decision rule:" in first_screen
    assert json.loads((reports / "audit.json").read_text())["summary"]["errors"] == 0
    assert not (first_run / ".fp4forge-staging").exists()


def test_checkpoint_equals_quantize_with_the_same_statistics(first_run: Path, model: Path, tmp_path: Path) -> None:
    """The pipeline adds no numerics of its own: `quantize --stats` on its statistics gives the same tensors."""
    from fp4forge.quantize.act_scales import parse_act_scales
    from fp4forge.quantize.export import QuantizeOptions, quantize_checkpoint
    from fp4forge.quantize.recipe import load_recipe

    direct = tmp_path / "direct"
    stats = first_run / "reports" / "calibration-stats.safetensors"
    quantize_checkpoint(model, direct, QuantizeOptions(recipe=load_recipe(RECIPE), act_amax=parse_act_scales(None, stats)))
    with safe_open(direct / "model.safetensors", "pt") as a, safe_open(first_run / "model.safetensors", "pt") as b:
        assert sorted(a.keys()) == sorted(b.keys())
        for name in a.keys():
            assert a.get_tensor(name).reshape(-1).view(torch.uint8).equal(b.get_tensor(name).reshape(-1).view(torch.uint8)), name
    assert json.loads((direct / "config.json").read_text()) == json.loads((first_run / "config.json").read_text())


def test_rerun_skips_every_step_and_touches_nothing(first_run: Path, model: Path) -> None:
    watched = [first_run / "model.safetensors", first_run / "README.md", first_run / "reports" / "fidelity.json",
               first_run / "reports" / "calibration-stats.safetensors"]
    before = [stamp(p) for p in watched]
    run_pipeline(model, first_run, SMALL)
    state = statuses(first_run)
    assert [n for n, s in state.items() if s == "skipped"] == LOCAL_STEPS
    assert [stamp(p) for p in watched] == before


def test_keys_hashed_beside_the_steps_are_the_keys_taken_first(first_run: Path, model: Path) -> None:
    """The first run hashed every key beside its step (no previous record): each recorded key is the
    one a fresh hasher (no cache) computes before any step, as a re-run does."""
    from fp4forge.pipeline.run import step_key
    from fp4forge.pipeline.state import Hasher, Manifest, previous_records
    from fp4forge.pipeline.steps import CARD_STEP, Context

    records = previous_records(first_run / "reports" / "pipeline.json")
    manifest = Manifest(first_run / "reports" / "pipeline.json", str(model), str(first_run), {}, records)
    ctx = Context(model, first_run, SMALL)
    for step in (*STEPS, CARD_STEP):
        if step.name in LOCAL_STEPS:
            assert records[step.name].key == step_key(step, ctx, Hasher(None), manifest), step.name


def test_a_changed_source_redoes_the_steps_that_read_it(first_run: Path, model: Path, tmp_path: Path) -> None:
    """A copy of the finished run over a copy of its source, the source then given one more file:
    the steps keyed by the source run again."""
    import shutil

    src, out = tmp_path / "src", tmp_path / "out"
    shutil.copytree(model, src)
    shutil.copytree(first_run, out)
    (src / "NOTES.md").write_text("one more file in the source\n")
    before = {s["name"]: s["key"] for s in json.loads((out / "reports" / "pipeline.json").read_text())["steps"]}
    run_pipeline(src, out, SMALL)
    state = statuses(out)
    after = {s["name"]: s["key"] for s in json.loads((out / "reports" / "pipeline.json").read_text())["steps"]}
    for name in ("calibrate", "quantize", "fidelity"):
        assert state[name] == "done" and after[name] not in (None, before[name]), name


def test_a_changed_option_redoes_only_the_steps_that_depend_on_it(first_run: Path, model: Path) -> None:
    fidelity = first_run / "reports" / "fidelity.json"
    ckpt_before = stamp(first_run / "model.safetensors")
    run_pipeline(model, first_run, replace(SMALL, fidelity=replace(SMALL.fidelity, samples=3)))
    state = statuses(first_run)
    assert state["fidelity"] == "done" and state["card"] == "done"
    assert all(state[n] == "skipped" for n in ("calibrate", "quantize", "kv", "audit", "bytes", "serve-cmd"))
    assert json.loads(fidelity.read_text())["data"]["samples"] == 3
    assert stamp(first_run / "model.safetensors") == ckpt_before


def test_an_edited_artifact_is_redone(first_run: Path, model: Path) -> None:
    byte_doc = first_run / "reports" / "bytes.json"
    original = byte_doc.read_text()
    byte_doc.write_text(original.replace('"laguna"', '"tampered"'))
    run_pipeline(model, first_run, replace(SMALL, fidelity=replace(SMALL.fidelity, samples=3)))
    state = statuses(first_run)
    assert state["bytes"] == "done" and state["quantize"] == "skipped"
    assert byte_doc.read_text() == original
    # The redone artifact has the content the card was made from: the card is keyed by content.
    assert state["card"] == "skipped"


def test_a_failed_step_stops_the_run_and_a_fixed_rerun_resumes_after_it(model: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    # More held-out tokens than the built-in corpus has: fidelity (step 7) fails, after the export.
    with pytest.raises(PipelineFailed, match="fidelity"):
        run_pipeline(model, out, replace(SMALL, fidelity=replace(SMALL.fidelity, samples=100_000)))
    state = statuses(out)
    assert state["fidelity"] == "failed" and state["card"] == "pending"
    records = {r["name"]: r for r in json.loads((out / "reports" / "pipeline.json").read_text())["steps"]}
    assert records["fidelity"]["artifacts"] == {}  # it failed before writing its report: nothing is this run's
    assert all(state[n] == "done" for n in ("calibrate", "quantize", "kv", "audit", "bytes"))
    assert json.loads((out / "reports" / "pipeline.json").read_text())["status"] == "failed"
    assert not (out / "README.md").exists()
    ckpt = stamp(out / "model.safetensors")
    run_pipeline(model, out, SMALL)
    state = statuses(out)
    assert all(state[n] == "skipped" for n in ("calibrate", "quantize", "kv", "audit", "bytes"))
    assert state["fidelity"] == "done" and state["card"] == "done"
    assert stamp(out / "model.safetensors") == ckpt


def test_ctrl_c_mid_run_resumes_without_redoing_finished_steps(model: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    manifest = out / "reports" / "pipeline.json"
    command = [FP4FORGE, "pipeline", str(model), str(out), "--recipe", RECIPE, "--json",
               "--calib-samples", "4", "--calib-seq-len", "64", "--fidelity-samples", "16", "--fidelity-seq-len", "256",
               "--fidelity-builtin", "--fidelity-allow-unreadable"]
    # A test run started in the background (`cmd &` in a script) ignores SIGINT and children inherit
    # that: give the command the default a terminal user has.
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if statuses(out).get("fidelity") == "running":
                break
        except (OSError, ValueError):
            pass
        time.sleep(0.02)
    assert proc.poll() is None, "the pipeline ended before fidelity started"
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr
    assert "re-run the same command to resume" in stderr
    state = statuses(out)
    assert state["fidelity"] == "interrupted"
    assert all(state[n] == "done" for n in ("calibrate", "quantize", "kv", "audit", "bytes"))
    assert json.loads(manifest.read_text())["status"] == "interrupted"
    finished = {p: stamp(p) for p in (out / "model.safetensors", out / "reports" / "calibration-stats.safetensors")}
    rerun = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stderr
    doc = json.loads(rerun.stdout)
    state = {s["name"]: s["status"] for s in doc["steps"]}
    assert all(state[n] == "skipped" for n in ("calibrate", "quantize", "kv", "audit", "bytes"))
    assert all(state[n] == "done" for n in ("fidelity", "serve-cmd", "card")) and doc["status"] == "complete"
    assert {p: stamp(p) for p in finished} == finished


def test_refuses_a_directory_it_does_not_own(model: Path, tmp_path: Path) -> None:
    out = tmp_path / "someone-elses"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(ConfigError, match="not empty"):
        run_pipeline(model, out, SMALL)
    assert [p.name for p in out.iterdir()] == ["notes.txt"]


def test_bad_input_exits_2_with_one_line_and_writes_nothing(tmp_path: Path, model: Path) -> None:
    cases = [
        ([str(tmp_path / "nowhere"), str(tmp_path / "o1"), "--recipe", RECIPE], "no config.json"),
        ([str(model), str(tmp_path / "o2"), "--recipe", "no-such-recipe"], "no recipe"),
        ([str(model), str(tmp_path / "o3"), "--recipe", RECIPE, "--bench", "speed"], "--bench"),
        ([str(model), str(tmp_path / "o4"), "--recipe", RECIPE, "--serve", "--vllm-venv", str(tmp_path)], "vLLM venv"),
    ]
    for args, message in cases:
        proc = subprocess.run([FP4FORGE, "pipeline", *args], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 2, (args, proc.stderr)
        assert message in proc.stderr and "Traceback" not in proc.stderr
    assert not any(p.name.startswith("o") for p in tmp_path.iterdir())


def test_a_failed_step_records_only_what_it_wrote(tmp_path: Path) -> None:
    """A failed step's reports written before it failed are recorded (the card quotes them as this
    run's); an earlier run's file it never reached is not."""
    import os

    from fp4forge.pipeline.run import _written_since
    from fp4forge.pipeline.state import Hasher
    from fp4forge.pipeline.steps import Context, Step

    reports = tmp_path / "out" / "reports"
    reports.mkdir(parents=True)
    (reports / "old.json").write_text("{}")
    os.utime(reports / "old.json", (1_000_000, 1_000_000))
    since = time.time() - 1
    (reports / "new.json").write_text('{"errors": 1}')
    step = Step("x", "x", lambda ctx: {}, ("reports/old.json", "reports/new.json", "reports/never.json"), ())
    written = _written_since(step, Context(tmp_path, tmp_path / "out", SMALL), Hasher(tmp_path / "h.json"), since)
    assert list(written) == ["reports/new.json"]
    import hashlib

    assert written["reports/new.json"] == hashlib.sha256(b'{"errors": 1}').hexdigest()


def test_the_cards_key_follows_which_steps_finished(tmp_path: Path) -> None:
    """A re-run without --serve turns the serve step off: the card's key changes, so the card is
    rendered again from the current manifest instead of being skipped with the old step table."""
    from fp4forge.pipeline.run import step_key
    from fp4forge.pipeline.state import Hasher, Manifest, StepRecord
    from fp4forge.pipeline.steps import CARD_STEP, Context

    (tmp_path / "out" / "reports").mkdir(parents=True)
    ctx = Context(tmp_path, tmp_path / "out", SMALL)
    hasher = Hasher(tmp_path / "hashes.json")

    def key(serve: str, card: str = "pending") -> str:
        steps = {name: StepRecord(name, name, status) for name, status in (("audit", "done"), ("serve", serve), ("card", card))}
        return step_key(CARD_STEP, ctx, hasher, Manifest(tmp_path / "m.json", "s", "o", {}, steps))

    assert key("done") == key("skipped")  # an unchanged re-run keeps the card
    assert key("done") != key("off")
    assert key("off", card="done") == key("off", card="running")  # the card's own record is not its input


def test_steps_table_is_consistent() -> None:
    """Every key input names something the key function knows; artifacts are under reports/ or the checkpoint."""
    known = {"src", "checkpoint", "recipe", "sibling", "vllm", "calibration-stats.safetensors", "quality"}
    for step in STEPS:
        assert set(step.inputs) <= known, step.name
        assert all(SMALL.has_option(param) for param in step.params), step.name
        assert not step.options or SMALL.has_option(step.options), step.name
        assert all(a == "." or a.startswith("reports/") for a in step.artifacts), step.name
    assert len({s.name for s in STEPS}) == len(STEPS)


def assert_bench_context(bench: dict[str, Any], samples: Path) -> None:
    """Issue 36: the speed figures carry their host and the served log's warnings, sent in random rounds."""
    host = bench["run"]["host"]
    assert host["cores_logical"] >= 1 and host["load_before"] and host["load_after"]
    assert host["server_warnings"]["before_run"]["count"] > 0  # vLLM CPU warns at start-up (no Triton, ...)
    rounds = {json.loads(line).get("round") for line in samples.read_text().splitlines()}
    assert bench["run"]["order"]["repeats"] > 1 and len(rounds - {None}) == bench["run"]["order"]["repeats"]


@pytest.mark.slow
def test_pipeline_serves_benches_and_writes_the_whole_card(model: Path, tmp_path: Path, vllm_venv: Path) -> None:
    """The README's main job with serving: vLLM CPU + the plugin serves the export, the doctor reads
    its log, bench perf and two quality runs measure it, and the card has every section."""
    out = tmp_path / "served"
    options = replace(SMALL, serve=True, vllm_venv=vllm_venv, bench=("perf", "quality"), quality_teacher=True,
                      quality_categories=("restraint", "missing_tool"), quality=replace(SMALL.quality, max_tokens=32))
    events = []
    manifest = run_pipeline(model, out, options, on_event=events.append)
    assert manifest.status == "complete"
    assert [n for n, s in statuses(out).items() if s == "done"] == [
        *LOCAL_STEPS[:-1], "serve", "perf", "quality", "quality-teacher", "card"]
    # Issue 19: a live start-up status from the vLLM log while each server starts, per step.
    starting = [e.detail for e in events if e.status == "running" and "starting vLLM" in e.detail]
    assert any(d.startswith("starting vLLM (student: served), ") and " s: " in d for d in starting)
    assert any(d.startswith("starting vLLM (teacher: ") for d in starting)
    # Each server's whole life is kept, with what it served; the card's commands carry no path.
    lives = {role: json.loads((out / "reports" / "servers" / f"{role}.json").read_text()) for role in ("student", "teacher")}
    assert lives["student"]["served_steps"] == ["serve", "perf", "quality"]
    assert lives["teacher"]["served_steps"] == ["quality-teacher"]
    for life in lives.values():
        assert life["log_lines"] > life["ready_line"] > 0  # kept past readiness: every request's line
        assert not [f for f in life["findings_after_ready"] if f["severity"] == "error"]
        assert 'vllm serve "$MODEL"' in life["command"] and "VLLM_CPU_KVCACHE_SPACE=" in life["command"]
    card_text = (out / "README.md").read_text()
    assert str(vllm_venv) not in card_text and str(tmp_path) not in card_text
    assert "--served-model-name served" in card_text and "--port 8000" in card_text
    assert "FP4FORGE_VLLM_NUMERICS=" in card_text
    compare = json.loads((out / "reports" / "quality-teacher" / "compare.json").read_text())
    assert (compare["arms"]["A"]["label"], compare["arms"]["B"]["label"]) == ("quantized", "bf16-teacher")
    assert compare["runs"] == {"A": 2, "B": 2}
    served = json.loads((out / "reports" / "serve.json").read_text())
    ids = {f["id"] for f in served["findings"]}
    assert "fp4forge-plugin-active" in ids and not [f for f in served["findings"] if f["severity"] == "error"]
    bench = json.loads((out / "reports" / "bench" / "summary.json").read_text())
    assert bench["totals"]["failed"] == 0 and bench["totals"]["kept_ok"] > 0
    assert_bench_context(bench, out / "reports" / "bench" / "samples.jsonl")
    score = json.loads((out / "reports" / "quality" / "score.json").read_text())
    assert [r["run"] for r in score["runs"]] == [1, 2]
    assert all(Path(r["path"]).is_file() for r in score["runs"])  # transcripts where the score says
    # The random testbed never closes its reasoning: every turn is cut at max_tokens, so the arm is
    # refused (issue 19), the steps still finish, and the card says why instead of a verdict.
    assert score["answers"]["refused"] and compare["verdict"]["label"] == "refused"
    summary = {s["name"]: s["summary"] for s in json.loads((out / "reports" / "pipeline.json").read_text())["steps"]}
    assert "REFUSED (not scored)" in summary["quality"] and summary["quality"]["points"].endswith(f"/ {score['runs'][1]['max']}")
    card = (out / "README.md").read_text()
    assert "**REFUSED TO SCORE: the suite could not read the answers.**" in card
    assert "_Not measured" not in card and "is missing" not in card
    assert "### Against the BF16 teacher (paired)" in card
    # The teacher is the unquantized reference: its start-up table does not say the plugin computes NVFP4.
    teacher = card.split("The BF16 teacher (", 1)[1]
    assert "the unquantized reference arm" in teacher and "computes NVFP4" not in teacher
    assert "- **quality: not established**" in card and "- **served: holds**" in card
    # The recipe declares an FP8 KV cache: kept where this CPU can (AVX-512/AMX), else served
    # unquantized with the serve line's override, and the card says so.
    fallback = served["kv_fallback"]
    if cpu_has_fp8_kv():
        assert fallback is None
        assert served["command"][served["command"].index("--kv-cache-dtype") + 1] == "auto"  # the declaration's FP8
    else:
        assert fallback["declared"] == "fp8" and fallback["served_dtype"] == "bfloat16"
        assert all(part in served["command"] for part in fallback["argv"])
        assert "served here with an unquantized bfloat16 cache" in card
    assert not (out / ".fp4forge-staging").exists()
    # The server is gone: nothing listens any more on the recorded port.
    import httpx

    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{served['command'][served['command'].index('--port') + 1]}/v1/models", timeout=2)
    # Issue 36: a re-run without --serve turns the serving steps off; the card is rendered again
    # from that manifest: no step table says `serve | done`, and the old server's reports are named
    # as left from the earlier run, not quoted.
    run_pipeline(model, out, SMALL)
    state = statuses(out)
    assert state["serve"] == "off" and state["card"] == "done"
    card = (out / "README.md").read_text()
    assert "| serve | off |" in card and "| serve | done |" not in card and "| serve | skipped |" not in card
    assert "`reports/serve.json` is left from an earlier run" in card
    assert "- **served: not established**" in card


def test_one_server_at_a_time(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The teacher's server starts only after the export's has stopped (and back), never beside it."""
    from fp4forge.pipeline.steps import Context
    from fp4forge.serve import process
    from fp4forge.serve.process import ServeRecord

    events: list[str] = []
    running: set[str] = set()

    def fake_up(model: Path, *, name: str, **kwargs: object) -> tuple[ServeRecord, object]:
        assert not running, f"{name} started while {running} still runs"
        running.add(name)
        events.append(f"up {Path(model).name}")
        return ServeRecord(name, 1, 1, str(model), "log", ["vllm", "serve", str(model)], 0.0), SimpleNamespace(line_count=0)

    def fake_down(names: list[str], **kwargs: object) -> list[ServeRecord]:
        running.difference_update(names)
        events.append("down")
        return []

    monkeypatch.setattr(process, "serve_up", fake_up)
    monkeypatch.setattr(process, "serve_down", fake_down)
    ctx = Context(tmp_path / "src", tmp_path / "out", replace(SMALL, serve=True, vllm_venv=tmp_path))
    assert ctx.slot("student").get() is ctx.slot("student").get()  # shared by the steps, started once
    ctx.slot("teacher").get()
    ctx.slot("student").get()
    ctx.stop_servers()
    assert events == ["up out", "down", "up src", "down", "up out", "down"]
    assert not running
