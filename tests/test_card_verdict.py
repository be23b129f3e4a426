"""The card's verdict block and its consistency with the manifest (tests/fixtures/card: a real
pipeline run on the tiny Laguna served by vLLM CPU).

From the fixture an all-holds set of artifacts is made (the fidelity intervals and the quality power
statement the newer reports carry, the target's numerics from ``serve.recommend.target_numerics``,
a teacher that can read the text): its card says **ship**. Then each test plants one defect or one
contradiction in one artifact and checks the card's verdict line and text say it; oracles are the
planted values, read back out of the Markdown here.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from fp4forge.report.card import render_card
from fp4forge.serve.recommend import target_numerics

FIXTURE = Path(__file__).parent / "fixtures" / "card" / "ckpt"
BF16_LOG = Path(__file__).parent / "fixtures" / "vllm_logs" / "cpu-plugin-bf16-moe-fixed-parser.log"
FIRST_SCREEN = 25  # lines a reader sees before scrolling


def edit(ckpt: Path, name: str, change: Callable[[dict[str, Any]], None]) -> None:
    path = ckpt / "reports" / name
    doc = json.loads(path.read_text())
    change(doc)
    path.write_text(json.dumps(doc))


def _fidelity_with_intervals(doc: dict[str, Any]) -> None:
    m = doc["metrics"]
    m["perplexity"] = {"teacher": 18.0, "student": 18.4}  # a teacher that reads the text
    m["top1_agreement"] = 0.93
    m["kl"]["mean"] = 0.012
    m["intervals"] = {"kl": {"low": 0.010, "high": 0.014, "level": 0.95},
                      "top1_agreement": {"low": 0.91, "high": 0.95, "level": 0.95}}
    m["documents"], m["tokens"] = 25, 4096
    doc["served_numerics"] = {**target_numerics("gb10").to_json(), "describe": target_numerics("gb10").describe()}


def _power_stated(doc: dict[str, Any]) -> None:
    doc["power"] = {**doc["power"], "floor": {"measured": False, "why": "floor not measured: greedy is deterministic"},
                    "min_discordant": 6, "floor_effect": None, "descriptive_categories": True}


@pytest.fixture()
def ckpt(tmp_path: Path) -> Path:
    """The fixture with every verdict line holding."""
    copy = tmp_path / "tiny-laguna-nvfp4"
    shutil.copytree(FIXTURE, copy)
    edit(copy, "fidelity.json", _fidelity_with_intervals)
    edit(copy, "quality-teacher/compare.json", _power_stated)
    edit(copy, "serve-cmd.json", lambda d: d.update(numerics=target_numerics("gb10").to_json()))
    return copy


def verdict_block(markdown: str) -> tuple[str, dict[str, tuple[str, str]]]:
    """The decision and, per topic, (state, text) of the card's verdict block."""
    block = markdown.split("## Verdict\n", 1)[1].split("\n## ", 1)[0]
    decision = re.search(r"^\*\*([A-Z ]+)\.\*\*", block, re.M)[1].lower()
    lines = {m[1]: (m[2], m[3]) for m in re.finditer(r"^- \*\*([a-z ]+): ([a-z ]+)\*\*(?: \([^\n]*?\))?: (.*)$", block, re.M)}
    return decision, lines


def test_every_line_holding_is_ship_on_the_first_screen(ckpt: Path) -> None:
    markdown = render_card(ckpt).markdown
    decision, lines = verdict_block(markdown)
    assert decision == "ship"
    assert {topic: state for topic, (state, _) in lines.items()} == {
        "audit": "holds", "served": "holds", "fidelity": "holds", "quality": "holds", "target numerics": "holds"}
    first = "\n".join(markdown.splitlines()[:FIRST_SCREEN])
    assert "**SHIP.**" in first and all(f"- **{topic}: holds**" in first for topic in lines)
    # the audit's warning is on the line by its message, not a count
    audit = json.loads((ckpt / "reports" / "audit.json").read_text())
    warning = next(f for f in audit["findings"] if f["severity"] == "warning")
    assert warning["message"][:80] in lines["audit"][1]
    assert "KL 0.012 [0.01, 0.014]" in lines["fidelity"][1] and "93.0% [91.0%, 95.0%]" in lines["fidelity"][1]
    assert "25 documents, 4,096 tokens" in lines["fidelity"][1]
    assert "at least 6 one-way discordant scenarios of 72" in lines["quality"][1]
    assert "floor not measured: greedy is deterministic" in lines["quality"][1]
    assert "Decision rule:" in first
    # each line links the report behind it, relative to the card
    assert "([`reports/audit.json`](reports/audit.json))" in markdown
    assert "[`reports/quality-teacher/compare.json`](reports/quality-teacher/compare.json)" in markdown


def _audit_error(doc: dict[str, Any]) -> None:
    doc["findings"].insert(0, {"rule": "scale-nonfinite", "severity": "error", "count": 2, "file": "model.safetensors",
                               "tensors": ["a.weight_scale", "b.weight_scale"], "title": "Non-finite scale",
                               "message": "2 weight scales are NaN: a.weight_scale, b.weight_scale. vLLM multiplies by "
                                          "them. Fix: Re-export with finite scales."})
    doc["summary"]["errors"] = 1


def _served_failed(doc: dict[str, Any]) -> None:
    doc["verdict"] = {"state": "failed", "summary": "failed at phase 4 (load weights): KeyError"}
    doc["findings"].insert(0, {"id": "server-failed-to-start", "severity": "error", "line": 7, "fix": None, "text": "",
                               "message": "The server failed to start at load weights: KeyError 'x'."})


def _interval(key: str, low: float, high: float) -> Callable[[dict[str, Any]], None]:
    return lambda doc: doc["metrics"]["intervals"][key].update(low=low, high=high)


CASES = {  # (artifact, change, topic, state, text on the line)
    "audit error": ("audit.json", _audit_error, "audit", "do not ship", "2 weight scales are NaN: a.weight_scale, b.weight_scale"),
    "headers-only audit": ("audit.json", lambda d: d["audit"].update(deep=False), "audit", "not established", "headers only"),
    "server failed": ("serve.json", _served_failed, "served", "do not ship", "failed at phase 4 (load weights)"),
    "no fidelity interval": ("fidelity.json", lambda d: d["metrics"].pop("intervals"), "fidelity", "not established",
                             "not established: no interval"),
    "KL beyond its level": ("fidelity.json", _interval("kl", 0.2, 0.3), "fidelity", "do not ship", "[0.2, 0.3]"),
    "top-1 across its level": ("fidelity.json", _interval("top1_agreement", 0.80, 0.90), "fidelity", "not established", "[80.0%, 90.0%]"),
    "unreadable text": ("fidelity.json", lambda d: d["metrics"]["perplexity"].update(teacher=4213.0), "fidelity", "not established",
                        "teacher perplexity 4213 on a 4,096-token vocabulary (over 50% of it)"),
    "teacher better": ("quality-teacher/compare.json", lambda d: d["verdict"].update(ordering="B>A", label="B better", text="B scores higher"),
                       "quality", "do not ship", "the teacher scores higher: B scores higher"),
    "power not stated": ("quality-teacher/compare.json", lambda d: d["power"].pop("min_discordant"), "quality", "not established",
                         "power not stated"),
    "floor effect": ("quality-teacher/compare.json", lambda d: d["power"].update(floor_effect="both arms below 20 % of the points"),
                     "quality", "not established", "both arms below 20 % of the points"),
    "quality refused": ("quality-teacher/compare.json", lambda d: d["verdict"].update(label="refused", text="refused to score: x"),
                        "quality", "not established", "refused"),
    "numerics not fidelity's": ("fidelity.json", lambda d: d["served_numerics"].update(moe_input_scale="per_expert"),
                                "target numerics", "not established", "its numbers are not this target's"),
    "numerics not recorded": ("serve-cmd.json", lambda d: d.pop("numerics"), "target numerics", "not established", "not recorded"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_each_planted_defect_decides_its_line_and_the_card(ckpt: Path, case: str) -> None:
    artifact, change, topic, state, text = CASES[case]
    edit(ckpt, artifact, change)
    markdown = render_card(ckpt).markdown
    decision, lines = verdict_block(markdown)
    assert lines[topic][0] == state, lines[topic]
    assert text in lines[topic][1]
    assert decision == state
    assert all(s == "holds" for t, (s, _) in lines.items() if t != topic)
    first = "\n".join(markdown.splitlines()[:FIRST_SCREEN])
    assert f"**{state.upper()}.** Decided by: {topic}." in first and text in first


def test_the_audit_table_shows_each_findings_message_and_fix(ckpt: Path) -> None:
    edit(ckpt, "audit.json", _audit_error)
    text = render_card(ckpt).markdown.split("### Audit", 1)[1].split("###", 1)[0]
    assert "| `scale-nonfinite` | error | 2 | 2 weight scales are NaN: a.weight_scale, b.weight_scale. vLLM multiplies by them. " \
           "| Re-export with finite scales. |" in text


@pytest.mark.parametrize(("artifact", "topics"), [
    ("audit.json", {"audit"}), ("serve.json", {"served"}), ("quality-teacher/compare.json", {"quality"}),
    ("serve-cmd.json", {"target numerics"}),
    ("fidelity.json", {"fidelity", "target numerics"}),  # nothing then shows fidelity measured the target's numerics
])
def test_a_missing_report_is_not_established_never_ship(ckpt: Path, artifact: str, topics: set[str]) -> None:
    (ckpt / "reports" / artifact).unlink()
    decision, lines = verdict_block(render_card(ckpt).markdown)
    assert decision == "not established"
    assert {topic for topic, (state, _) in lines.items() if state != "holds"} == topics
    assert all(lines[topic][0] == "not established" for topic in topics)


def test_a_report_left_from_an_earlier_run_is_named_stale_and_not_quoted(ckpt: Path) -> None:
    """A re-run without --serve: pipeline.json says serve is off, serve.json is still on disk."""
    def serve_off(doc: dict[str, Any]) -> None:
        step = next(s for s in doc["steps"] if s["name"] == "serve")
        step.update(status="off", artifacts={}, key=None, message="serving not requested (--serve)")

    edit(ckpt, "pipeline.json", serve_off)
    card = render_card(ckpt)
    parts = re.split(r"^## (.+)$", card.markdown, flags=re.M)
    sections = {parts[i].strip(): parts[i + 1] for i in range(1, len(parts), 2)}
    assert "| serve | off |" in sections["Provenance"] and "| serve | done |" not in card.markdown
    assert "serve | skipped" not in card.markdown
    stale = "`reports/serve.json` is left from an earlier run: no step of the current `reports/pipeline.json` wrote it"
    assert stale in sections["Serving"] and stale in sections["What this card does not claim"]
    assert "ready after" not in sections["Serving"]  # nothing of the old server is quoted
    decision, lines = verdict_block(card.markdown)
    assert decision == "not established" and lines["served"][0] == "not established"
    assert "left from an earlier run" in lines["served"][1]
    assert card.problems["reports/serve.json"].startswith("left from an earlier run")


def test_a_failed_steps_report_is_this_runs(ckpt: Path) -> None:
    """The audit step failed on errors: the manifest records the audit.json it wrote, and the card
    says do not ship from it (not "left from an earlier run")."""
    edit(ckpt, "audit.json", _audit_error)

    def audit_failed(doc: dict[str, Any]) -> None:
        for step in doc["steps"]:
            if step["name"] == "audit":
                step.update(status="failed", message="the audit found 1 error(s) (scale-nonfinite)")
                step["artifacts"] = {"reports/audit.json": step["artifacts"]["reports/audit.json"]}
            elif step["name"] not in ("calibrate", "quantize", "kv"):
                step.update(status="pending", artifacts={})

    edit(ckpt, "pipeline.json", audit_failed)
    card = render_card(ckpt)
    decision, lines = verdict_block(card.markdown)
    assert decision == "do not ship" and lines["audit"][0] == "do not ship"
    assert "reports/audit.json" not in card.problems and "reports/fidelity.json" in card.problems  # later steps: stale


def test_corrupt_and_missing_config_are_named_as_what_they_are(ckpt: Path) -> None:
    (ckpt / "config.json").write_text('{"architectures": ["LagunaForCausalLM"], "vocab_si')
    card = render_card(ckpt)
    claims = card.markdown.split("## What this card does not claim", 1)[1]
    assert "`config.json` is present but corrupt (not valid JSON" in claims
    assert "config.json` is missing" not in card.markdown
    decision, lines = verdict_block(card.markdown)
    assert lines["fidelity"][0] == "not established" and "present but corrupt" in lines["fidelity"][1]
    (ckpt / "config.json").unlink()
    card = render_card(ckpt)
    assert "`config.json` is missing" in card.markdown and "present but corrupt" not in card.markdown
    (ckpt / "config.json").write_text("[1, 2]")
    assert "`config.json` is present but corrupt (a JSON list, not an object)" in render_card(ckpt).markdown


def test_a_report_without_the_fields_a_section_reads_is_named_not_a_traceback(ckpt: Path) -> None:
    (ckpt / "reports" / "bytes.json").write_text('{"total": {}}')
    markdown = render_card(ckpt).markdown
    assert "_Not stated: `reports/bytes.json`" in markdown and "lack what this section reads (KeyError" in markdown
    edit(ckpt, "fidelity.json", lambda d: d["metrics"]["kl"].update(mean="n/a"))
    decision, lines = verdict_block(render_card(ckpt).markdown)
    assert decision == "not established" and lines["fidelity"][0] == "not established"
    assert "its report lacks what this line reads (ValueError" in lines["fidelity"][1]


def _teacher_life(ckpt: Path, *, keep_log: bool) -> None:
    """A teacher's life as an older fp4forge recorded it: the plugin said to compute NVFP4 W4A4."""
    servers = ckpt / "reports" / "servers"
    servers.mkdir()
    old = ("fp4forge-vllm 0.2.0 computes NVFP4 layers W4A4: activations fake-quantised per 16 with the checkpoint's "
           "input scales, as a fused CUTLASS/FlashInfer kernel does (MoE input scales: per_expert).")
    (servers / "teacher.json").write_text(json.dumps({
        "role": "teacher", "model": "tiny-laguna", "hardware": "cpu", "vllm_version": "0.32.0", "command": 'vllm serve "$MODEL"',
        "env": {}, "ready_seconds": 30.0, "ready_line": 110, "log_lines": 188, "served_steps": ["quality-teacher"],
        "log": "teacher.log", "verdict": {"state": "ready", "summary": "ready"},
        "startup_findings": [{"id": "fp4forge-plugin-active", "severity": "info", "message": old, "line": 20, "fix": None, "text": ""}],
        "findings_after_ready": []}))
    if keep_log:
        shutil.copyfile(BF16_LOG, servers / "teacher.log")


def test_the_teacher_is_described_as_the_reference_it_is(ckpt: Path) -> None:
    _teacher_life(ckpt, keep_log=True)
    text = render_card(ckpt).markdown.split("### Each server's whole life", 1)[1]
    assert "The BF16 teacher (tiny-laguna), the unquantized reference arm" in text
    assert "computes NVFP4 layers" not in text
    assert "serves the model unquantized (quantization=None): no layer is NVFP4" in text
    assert "read again from its kept log" in text


def test_a_teacher_record_without_its_log_says_it_was_not_read_again(ckpt: Path) -> None:
    _teacher_life(ckpt, keep_log=False)
    text = render_card(ckpt).markdown.split("### Each server's whole life", 1)[1]
    assert "as recorded when it stopped (its log is not kept, so they were not read again)" in text


def test_the_doctor_describes_the_plugin_on_an_unquantized_model_as_a_reference() -> None:
    from fp4forge.serve.doctor import diagnose_text

    bf16 = diagnose_text(BF16_LOG.read_text())
    (plugin,) = [f for f in bf16.findings if f.id == "fp4forge-plugin-active"]
    assert "no layer is NVFP4" in plugin.message and "computes NVFP4" not in plugin.message and plugin.fix is None
    w4a4 = diagnose_text((BF16_LOG.parent / "cpu-plugin-ct-w4a4.log").read_text())
    (plugin,) = [f for f in w4a4.findings if f.id == "fp4forge-plugin-active"]
    assert "computes NVFP4 layers W4A4" in plugin.message
