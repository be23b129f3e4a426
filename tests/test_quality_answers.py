"""Reading the served answers, and refusing to score an arm whose answers the suite cannot read
(issue 19, finding 1), against answers recorded from real vLLM CPU servers with the plugin
(tests/fixtures/quality_served, README.md there says how they were made):

* ``trained-laguna-answers.json``: one scenario's first turn asked of the trained tiny Laguna,
  plain and streamed, (a) with the template's own generation prompt (thinking on, ``<think>``)
  and (b) with the reasoning already closed in the prompt (``…</think>``, what a template that
  does not think renders) while the parser, without ``chat_template_kwargs``, assumes thinking:
  the finding's mismatch. The oracle for the streamed assembly is vLLM's own non-streamed parse.
* ``trained-laguna-transcript.jsonl`` / ``random-laguna-transcript.jsonl``: streamed
  ``quality run`` transcripts of four scenarios from the trained model (tool calls parsed) and
  from the untrained testbed the demo serves (every turn cut at max_tokens, reasoning only).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

import fp4forge
from fp4forge.cli.quality import register
from fp4forge.errors import ExitCode, UnreadableAnswersError
from fp4forge.quality.answers import UNREADABLE_SHARE, AnswerHealth, refusal_error
from fp4forge.quality.report import compare_document, score_document
from fp4forge.quality.runner import read_stream, rescore_transcript
from fp4forge.quality.scorer import ModelTurn, ParsedCall, turn_from_message
from fp4forge.quality.suite import load_suite

FIXTURES = Path(__file__).parent / "fixtures" / "quality_served"
TRAINED = FIXTURES / "trained-laguna-transcript.jsonl"
RANDOM = FIXTURES / "random-laguna-transcript.jsonl"


@pytest.fixture(scope="module")
def answers() -> dict[str, Any]:
    return json.loads((FIXTURES / "trained-laguna-answers.json").read_text())["cases"]


def plain(case: dict[str, Any]) -> tuple[dict[str, Any], str]:
    choice = case["response"]["choices"][0]
    return choice["message"], choice["finish_reason"]


# -- reading a streamed answer --------------------------------------------------------------------
def test_streamed_answer_assembles_to_the_servers_own_plain_parse(answers: dict[str, Any]) -> None:
    """Same request, same greedy tokens: the streamed deltas must add up to vLLM's plain answer."""
    message, finish = plain(answers["template-prompt/plain"])
    streamed, streamed_finish, usage, error = read_stream(answers["template-prompt/streamed"]["sse_lines"])
    assert error is None and streamed_finish == finish == "tool_calls"
    assert streamed["content"] == message["content"] and streamed["reasoning"] == message["reasoning"]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in streamed["tool_calls"]] == [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]
    ]
    assert usage["completion_tokens"] > 0  # the include_usage chunk was read


def test_finding_1_closed_reasoning_prompt_plain_answer_hides_the_tool_call_in_reasoning(answers: dict[str, Any]) -> None:
    """The prompt already closed the reasoning; the plain path still treats the whole answer as
    reasoning (vLLM 0.32 never looks at the prompt there), the streamed path parses the call."""
    message, finish = plain(answers["closed-reasoning-prompt/plain"])
    assert "<tool_call>get_weather" in message["reasoning"] and not message.get("tool_calls") and message["content"] is None
    hidden = turn_from_message(message, finish)
    assert AnswerHealth.of_turns([hidden]).reasoning_only == 1

    streamed, streamed_finish, _, error = read_stream(answers["closed-reasoning-prompt/streamed"]["sse_lines"])
    assert error is None and streamed_finish == "tool_calls" and streamed["reasoning"] is None
    [call] = turn_from_message(streamed, streamed_finish).calls
    assert call.name == "get_weather" and call.arguments is not None and call.arguments["city"] == "Va"
    assert AnswerHealth.of_turns([turn_from_message(streamed, streamed_finish)]) == AnswerHealth(turns=1, with_calls=1)


@pytest.mark.parametrize(("lines", "error"), [
    (['data: {"choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": null}]}'], "without [DONE]"),
    (["data: {not json", "data: [DONE]"], "unparseable"),
    (['data: {"error": {"message": "boom", "code": 500}}', "data: [DONE]"], "stream error"),
])
def test_a_broken_stream_is_a_failed_request(lines: list[str], error: str) -> None:
    message, _, _, text = read_stream(lines)
    assert message is None and error in text


# -- counting unread turns ------------------------------------------------------------------------
def turn(content: str | None = None, reasoning: str | None = None, calls: int = 0, finish: str = "stop",
         error: str | None = None) -> ModelTurn:
    parsed = [ParsedCall(name="f", arguments={}, arguments_raw="{}")] * calls
    return ModelTurn(content=content, reasoning=reasoning, calls=parsed, finish_reason=finish, error=error)


def test_answer_health_counts_each_unread_turn_once() -> None:
    health = AnswerHealth.of_turns([
        turn(reasoning="r", finish="length"),  # truncated and reasoning only: one unread turn
        turn(content="answer"),
        turn(calls=1, reasoning="r"),
        turn(content="cut", finish="length"),
        turn(),  # empty
        turn(error="http 500"),  # a failed request is not an answer
    ])
    assert health == AnswerHealth(turns=5, truncated=2, reasoning_only=1, empty=1, unread=3, with_calls=1)
    assert health.unreadable  # 3 of 5


def test_exactly_half_unread_is_not_mostly() -> None:
    assert UNREADABLE_SHARE == 0.5
    assert not AnswerHealth.of_turns([turn(reasoning="r"), turn(content="a")]).unreadable
    assert AnswerHealth.of_turns([turn(reasoning="r"), turn(reasoning="r"), turn(content="a")]).unreadable


# -- the refusal, from the real transcripts -------------------------------------------------------
def test_untrained_testbed_arm_is_refused_and_the_reason_is_named() -> None:
    suite = load_suite()
    result = rescore_transcript(RANDOM, suite)
    assert result.answers == AnswerHealth(turns=4, truncated=4, reasoning_only=4, unread=4)
    doc = score_document([result], suite)
    assert doc["answers"]["refused"] and not doc["answers"]["allowed"]
    error = refusal_error(doc)
    assert isinstance(error, UnreadableAnswersError) and error.exit_code == ExitCode.FINDINGS
    assert "4 of 4 turns unread (4 cut at max_tokens, 4 reasoning only" in str(error) and "max_tokens 128" in str(error)
    allowed = score_document([result], suite, allow_unreadable=True)
    assert allowed["answers"]["allowed"] and refusal_error(allowed) is None


def test_trained_testbed_arm_is_scored_with_its_tool_calls_parsed() -> None:
    suite = load_suite()
    result = rescore_transcript(TRAINED, suite)
    assert result.header["request"]["stream"] is True
    assert result.answers == AnswerHealth(turns=4, with_calls=3)
    assert (result.earned, result.max) == (3, 20)
    assert refusal_error(score_document([result], suite)) is None


def test_compare_refuses_when_either_arm_is_unreadable() -> None:
    suite = load_suite()
    trained, untrained = rescore_transcript(TRAINED, suite), rescore_transcript(RANDOM, suite)
    doc = compare_document([trained], [untrained], suite, n_boot=200)
    assert doc["verdict"]["label"] == "refused" and "arm 'B (random-laguna)'" in doc["verdict"]["text"]
    assert refusal_error(doc) is not None and "points" in doc  # the statistics stay as evidence
    allowed = compare_document([trained], [untrained], suite, n_boot=200, allow_unreadable=True)
    assert allowed["verdict"]["label"] != "refused" and allowed["verdict"]["text"].startswith("UNREADABLE ANSWERS")
    assert any(w.startswith("UNREADABLE ANSWERS, scored anyway") for w in allowed["warnings"])


# -- the CLI ------------------------------------------------------------------------------------
def invoke(*args: str) -> Any:
    app = typer.Typer()
    register(app)
    return CliRunner().invoke(app, ["quality", *args])


def test_cli_score_and_compare_refuse_with_exit_1_and_the_override_warns(tmp_path: Path) -> None:
    refused = invoke("score", str(RANDOM), "--out", str(tmp_path / "score"))
    assert refused.exit_code == ExitCode.FINDINGS and "refused to score" in refused.output
    assert "REFUSED TO SCORE" in (tmp_path / "score" / "score.md").read_text()  # the evidence is written
    allowed = invoke("score", str(RANDOM), "--allow-unreadable", "--json")
    assert allowed.exit_code == 0 and json.loads(allowed.stdout)["answers"]["allowed"]
    assert "WARNING" in allowed.stderr
    compared = invoke("compare", str(TRAINED), "--bootstrap", "200", "--json", "--", str(RANDOM))
    assert compared.exit_code == ExitCode.FINDINGS and json.loads(compared.stdout)["verdict"]["label"] == "refused"
    assert invoke("score", str(TRAINED)).exit_code == 0


# -- the pipeline's summary and the card ------------------------------------------------------------
def test_pipeline_summary_shows_points_of_the_maximum_and_the_refusal() -> None:
    from fp4forge.pipeline.steps import _answers_summary, _points

    suite = load_suite()
    trained, untrained = rescore_transcript(TRAINED, suite), rescore_transcript(RANDOM, suite)
    # every untrained turn was cut at max_tokens: no restraint point for a turn that never ended
    assert _points([untrained, trained]) == "0 / 20, 3 / 20"
    assert _answers_summary(score_document([trained], suite)["answers"]) == {}
    summary = _answers_summary(score_document([untrained], suite)["answers"])
    assert summary == {"REFUSED (not scored)": "random-laguna: 4 of 4 turns unread (4 cut at max tokens, 4 reasoning only)"}


def test_card_quality_section_carries_the_refusal(tmp_path: Path) -> None:
    from fp4forge.report.card import render_card
    from fp4forge.report.quality_files import write_score

    ckpt = tmp_path / "ckpt"
    shutil.copytree(Path(__file__).parent / "fixtures" / "card" / "ckpt", ckpt)
    shutil.rmtree(ckpt / "reports" / "quality-teacher")
    suite = load_suite()
    write_score(score_document([rescore_transcript(RANDOM, suite)], suite), ckpt / "reports" / "quality")
    assert json.loads((ckpt / "reports" / "quality" / "score.json").read_text())["fp4forge_version"] == fp4forge.__version__
    card = render_card(ckpt, None, tmp_path / "README.md").markdown
    quality = card.split("## Quality", 1)[1].split("\n## ", 1)[0]
    assert "**REFUSED TO SCORE: the suite could not read the answers.**" in quality
    assert "4 of 4 turns unread" in quality and "answers read streamed" in quality
    assert "Agentic tool-use quality was not measured: the suite could not read most answers" in card
