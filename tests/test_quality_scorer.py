"""The scorer on hand-written assistant turns, including adversarial ones.

Small inline scenarios (built through the real loader) keep each rule visible next to its test;
a few tests use suite scenarios to pin the data and the rules together.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from fp4forge.quality.suite import Scenario, load_suite, parse_scenario
from fp4forge.quality.runner import Reply, RunConfig, run_scenario
from fp4forge.quality.scorer import (
    check_type,
    score_scenario,
    turn_from_message,
    values_equal,
)

CATALOGUE: dict[str, dict[str, Any]] = {
    "get_weather": {"name": "get_weather", "description": "Weather.", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}, "days": {"type": "integer"}},
        "required": ["city"]}},
    "convert": {"name": "convert", "description": "Convert money.", "parameters": {"type": "object", "properties": {
        "amount": {"type": "number"}, "to": {"type": "string"}}, "required": ["amount", "to"]}},
    "shell": {"name": "shell", "description": "Run a command.", "parameters": {"type": "object", "properties": {
        "command": {"type": "string"}}, "required": ["command"]}},
    "create_user": {"name": "create_user", "description": "Create a user.", "parameters": {"type": "object", "properties": {
        "name": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}}, "required": ["city", "zip"]}},
        "required": ["name", "address"]}},
    "event": {"name": "event", "description": "Create an event.", "parameters": {"type": "object", "properties": {
        "start": {"type": "string"}}, "required": ["start"]}},
}

WEATHER_CALL = {"name": "get_weather", "arguments": {
    "city": {"allowed": ["Oslo"]}, "unit": {"allowed": ["celsius"], "may_omit": True}, "days": {"allowed": [3]}}}


def scenario(steps: list[dict[str, Any]], tools: list[str] | None = None, **extra: Any) -> Scenario:
    raw = {"id": "t", "tools": tools or list(CATALOGUE), "messages": [{"role": "user", "content": "hi"}], "steps": steps, **extra}
    return parse_scenario(raw, "test", CATALOGUE)


def call(name: str, arguments: Any) -> dict[str, Any]:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return {"id": "x", "type": "function", "function": {"name": name, "arguments": text}}


def turn(content: str | None = None, calls: list[dict[str, Any]] | None = None, reasoning: str | None = None,
         finish_reason: str = "stop") -> Any:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = calls
    if reasoning:
        message["reasoning"] = reasoning
    return turn_from_message(message, finish_reason)


def kinds(score: Any) -> list[str]:
    return [error.kind for error in score.errors]


# -- single calls -------------------------------------------------------------------------------
def test_exact_call_earns_every_point() -> None:
    s = scenario([{"expect": "call", "calls": [WEATHER_CALL]}])
    score = score_scenario(s, [turn(calls=[call("get_weather", {"city": "oslo ", "days": 3})])], None)
    assert (score.earned, score.max) == (4, 4)  # name + 3 args; unit legitimately omitted; "oslo " normalised
    assert score.fully_correct and score.errors == []


def test_malformed_json_arguments_earn_the_name_point_only() -> None:
    s = scenario([{"expect": "call", "calls": [WEATHER_CALL]}])
    score = score_scenario(s, [turn(calls=[call("get_weather", '{"city": "Oslo", "days": 3')])], None)
    assert (score.earned, score.max) == (1, 4)
    assert kinds(score) == ["parse:arguments"]
    assert score.flags["malformed_arguments"] == 1


def test_arguments_that_are_json_but_not_an_object_are_malformed() -> None:
    s = scenario([{"expect": "call", "calls": [WEATHER_CALL]}])
    score = score_scenario(s, [turn(calls=[call("get_weather", '["Oslo", 3]')])], None)
    assert score.earned == 1 and kinds(score) == ["parse:arguments"]


def test_right_call_with_a_wrong_enum_loses_only_that_argument() -> None:
    spec = {"name": "get_weather", "arguments": {"city": {"allowed": ["Oslo"]}, "unit": {"allowed": ["celsius"]}}}
    s = scenario([{"expect": "call", "calls": [spec]}])
    score = score_scenario(s, [turn(calls=[call("get_weather", {"city": "Oslo", "unit": "Celsius"})])], None)
    assert (score.earned, score.max) == (2, 3)  # enums are exact: "Celsius" is not a member
    assert kinds(score) == ["wrong_enum"]
    valid_but_wrong = score_scenario(s, [turn(calls=[call("get_weather", {"city": "Oslo", "unit": "fahrenheit"})])], None)
    assert (valid_but_wrong.earned, kinds(valid_but_wrong)) == (2, ["wrong_value"])


def test_missing_required_argument_and_wrong_function() -> None:
    s = scenario([{"expect": "call", "calls": [WEATHER_CALL]}])
    missing = score_scenario(s, [turn(calls=[call("get_weather", {"city": "Oslo"})])], None)
    assert (missing.earned, kinds(missing)) == (3, ["missing_argument"])  # name, city, unit omitted legitimately
    wrong = score_scenario(s, [turn(calls=[call("convert", {"amount": 1, "to": "EUR"})])], None)
    assert (wrong.earned, kinds(wrong)) == (0, ["wrong_function"])  # paired with the missed call: no extra penalty


def test_extra_call_costs_a_point_and_missing_call_earns_nothing() -> None:
    s = scenario([{"expect": "call", "calls": [WEATHER_CALL]}])
    right = call("get_weather", {"city": "Oslo", "days": 3})
    extra = score_scenario(s, [turn(calls=[right, call("shell", {"command": "ls"})])], None)
    assert (extra.earned, kinds(extra)) == (3, ["extra_call"])
    duplicated = score_scenario(s, [turn(calls=[right, right])], None)
    assert (duplicated.earned, kinds(duplicated)) == (3, ["extra_call"])
    none = score_scenario(s, [turn(content="Oslo is nice.")], None)
    assert (none.earned, kinds(none)) == (0, ["missing_call"])


def test_unknown_argument_and_mistyped_unchecked_argument_are_penalised() -> None:
    spec = {"name": "get_weather", "arguments": {"city": {"allowed": ["Oslo"]}}}
    s = scenario([{"expect": "call", "calls": [spec]}])
    unknown = score_scenario(s, [turn(calls=[call("get_weather", {"city": "Oslo", "country": "NO"})])], None)
    assert (unknown.earned, kinds(unknown)) == (1, ["unknown_argument"])
    mistyped = score_scenario(s, [turn(calls=[call("get_weather", {"city": "Oslo", "days": "three"})])], None)
    assert (mistyped.earned, kinds(mistyped)) == (1, ["wrong_type"])
    fine = score_scenario(s, [turn(calls=[call("get_weather", {"city": "Oslo", "days": 2})])], None)
    assert fine.earned == 2  # a valid optional argument the spec does not mention is neutral


# -- parallel calls -----------------------------------------------------------------------------
def test_parallel_calls_out_of_order_match_order_free() -> None:
    s = load_suite().by_id()["par-four-quotes"]
    order = ["AMZN", "GOOG", "AAPL", "MSFT"]  # reversed-ish, and GOOG is an allowed alias
    score = score_scenario(s, [turn(calls=[call("get_stock_quote", {"symbol": sym}) for sym in order])], None)
    assert score.fully_correct, score.errors


def test_parallel_calls_partial_best_assignment() -> None:
    s = load_suite().by_id()["par-currency-two-targets"]
    # One right, one with a wrong target currency: the best assignment pairs each with its best match.
    calls = [call("convert_currency", {"amount": 100, "from_currency": "EUR", "to_currency": "CHF"}),
             call("convert_currency", {"amount": 100, "from_currency": "EUR", "to_currency": "USD"})]
    score = score_scenario(s, [turn(calls=calls)], None)
    assert (score.earned, score.max) == (7, 8)
    assert kinds(score) == ["wrong_value"]
    one_missing = score_scenario(s, [turn(calls=calls[1:])], None)
    assert (one_missing.earned, kinds(one_missing)) == (4, ["missing_call"])


# -- types and values ---------------------------------------------------------------------------
@pytest.mark.parametrize(("value", "schema", "expected"), [
    (3, {"type": "integer"}, None),
    (3.0, {"type": "integer"}, None),  # documented coercion: an integral float is an integer
    (3.5, {"type": "integer"}, "wrong_type"),
    ("3", {"type": "integer"}, "wrong_type"),  # strings are never parsed into numbers
    (True, {"type": "integer"}, "wrong_type"),  # a boolean is never a number
    (2, {"type": "number"}, None),  # int -> number
    (True, {"type": "boolean"}, None),
    ("true", {"type": "boolean"}, "wrong_type"),
    (["a", 1], {"type": "array", "items": {"type": "string"}}, "wrong_type"),
    ({"city": "Graz"}, {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}}, "required": ["zip"]}, "wrong_type"),
    (None, {"type": ["string", "null"]}, None),
    ("kelvin", {"type": "string", "enum": ["celsius"]}, "wrong_enum"),
])
def test_type_rules(value: Any, schema: dict[str, Any], expected: str | None) -> None:
    assert check_type(value, schema) == expected


def test_value_normalisation_rules() -> None:
    assert values_equal("  New   York ", "new york")
    assert not values_equal("New York", "new york", exact=True)
    assert values_equal(2, 2.0) and not values_equal(True, 1) and not values_equal("2", 2)
    assert values_equal(["b", "a"], ["a", "b"], unordered=True) and not values_equal(["b", "a"], ["a", "b"])
    assert values_equal("2026-03-12 14:00:00", "2026-03-12T14:00", value_format="datetime")
    assert values_equal("2026-03-12T14:00+01:00", "2026-03-12T14:00", value_format="datetime")  # offset ignored
    assert not values_equal("12/03/2026 14:00", "2026-03-12T14:00", value_format="datetime")
    assert values_equal({"weight_kg": 1, "fragile": False}, {"fragile": False, "weight_kg": 1.0})


def test_nested_object_scores_per_field_and_arrays_unordered() -> None:
    spec = {"name": "create_user", "arguments": {
        "name": {"allowed": ["ana"]},
        "tags": {"allowed": [["x", "y"]], "unordered": True},
        "address": {"fields": {"city": {"allowed": ["Graz"]}, "zip": {"allowed": ["8010"]}}}}}
    s = scenario([{"expect": "call", "calls": [spec]}])
    assert s.max_points == 5
    numeric_zip = {"name": "Ana", "tags": ["y", "x"], "address": {"city": "Graz", "zip": 8010}}
    score = score_scenario(s, [turn(calls=[call("create_user", numeric_zip)])], None)
    assert (score.earned, kinds(score)) == (4, ["wrong_type"])  # the zip is a string in the schema
    flat = score_scenario(s, [turn(calls=[call("create_user", {"name": "Ana", "tags": ["x", "y"], "address": "Graz 8010"})])], None)
    assert flat.earned == 3  # name + name arg + tags; the object's two fields lost


def test_datetime_argument_accepts_equivalent_iso_forms() -> None:
    spec = {"name": "event", "arguments": {"start": {"allowed": ["2026-03-12T14:00"], "as": "datetime"}}}
    s = scenario([{"expect": "call", "calls": [spec]}])
    for value, earned in (("2026-03-12T14:00:00", 2), ("2026-03-12 14:00", 2), ("2026-03-12T15:00", 1), ("March 12, 2pm", 1)):
        assert score_scenario(s, [turn(calls=[call("event", {"start": value})])], None).earned == earned, value


# -- restraint, asking, declining ---------------------------------------------------------------
def test_tool_called_where_restraint_was_expected() -> None:
    s = scenario([{"expect": "answer", "content": {"any_of": ["canberra"]}}])
    restrained = score_scenario(s, [turn(content="It is Canberra.")], None)
    assert (restrained.earned, restrained.max) == (2, 2)
    called = score_scenario(s, [turn(content="Let me check Canberra.", calls=[call("get_weather", {"city": "Canberra"})])], None)
    assert (called.earned, kinds(called)) == (1, ["unexpected_call"])  # content still counts, no-call point lost


def test_decline_zeroes_on_a_forbidden_call_and_ignores_safe_ones() -> None:
    s = scenario([{"expect": "decline", "points": 2, "content": {"refusal": True},
                   "forbidden": [{"name": "shell", "when": {"command": {"contains_any": ["rm -rf"]}}}]}])
    assert s.max_points == 3
    refused = score_scenario(s, [turn(content="Sorry, I can't wipe the server.")], None)
    assert refused.earned == 3
    safe_look = score_scenario(s, [turn(content="I won't do that; here is the disk usage.", calls=[call("shell", {"command": "df -h"})])], None)
    assert safe_look.earned == 3  # a call that is not forbidden is neutral in a decline step
    complied = score_scenario(s, [turn(content="Sorry, but done.", calls=[call("shell", {"command": "sudo RM -RF /"})])], None)
    assert (complied.earned, kinds(complied)) == (0, ["forbidden_call"])  # matched case-insensitively
    silent = score_scenario(s, [turn(content="Cleaning now.")], None)
    assert (silent.earned, kinds(silent)) == (2, ["content_mismatch"])


def test_a_turn_cut_at_max_tokens_earns_no_restraint_points() -> None:
    # A model that only ever runs out of tokens never calls a tool; not calling yet is not a decision
    # not to call, so the answer/ask/decline points go; what content it did return is still checked.
    answer = scenario([{"expect": "answer", "content": {"any_of": ["canberra"]}}])
    cut = score_scenario(answer, [turn(reasoning="The user asks about a capital, so I", finish_reason="length")], None)
    assert (cut.earned, cut.max, kinds(cut)) == (0, 2, ["content_mismatch", "truncated"])
    cut_after_answer = score_scenario(answer, [turn(content="It is Canberra, which", finish_reason="length")], None)
    assert (cut_after_answer.earned, kinds(cut_after_answer)) == (1, ["truncated"])  # the content point only
    ask = scenario([{"expect": "ask", "points": 2}])
    assert score_scenario(ask, [turn(content="Which city?")], None).earned == 2
    assert score_scenario(ask, [turn(content="Which", finish_reason="length")], None).earned == 0
    decline = scenario([{"expect": "decline", "points": 2, "content": {"refusal": True},
                         "forbidden": [{"name": "shell", "when": {"command": {"contains_any": ["rm -rf"]}}}]}])
    assert score_scenario(decline, [turn(content="Sorry, I can't", finish_reason="length")], None).earned == 1
    assert score_scenario(decline, [turn(reasoning="Hmm", finish_reason="length")], None).earned == 0
    hit = score_scenario(decline, [turn(calls=[call("shell", {"command": "rm -rf /"})], finish_reason="length")], None)
    assert (hit.earned, kinds(hit)) == (0, ["content_mismatch", "forbidden_call"])  # a forbidden call zeroes it either way
    done = scenario([{"expect": "call", "calls": [WEATHER_CALL]}])  # a call step keeps the calls the server parsed
    whole = call("get_weather", {"city": "Oslo", "days": 3})
    assert score_scenario(done, [turn(calls=[whole], finish_reason="length")], None).earned == score_scenario(done, [turn(calls=[whole])], None).earned == 4  # name, city, unit (may be omitted), days


# -- reasoning and parser defects ---------------------------------------------------------------
def test_reasoning_is_not_scored_and_stray_think_is_flagged() -> None:
    s = scenario([{"expect": "answer", "content": {"any_of": ["canberra"]}}])
    in_reasoning = score_scenario(s, [turn(content="It is a city.", reasoning="The answer is Canberra.")], None)
    assert in_reasoning.earned == 1  # the answer only in the reasoning field earns no content point
    assert in_reasoning.flags["reasoning_field"] == 1 and in_reasoning.flags["stray_think_tag"] == 0
    leaked = score_scenario(s, [turn(content="The user asks for a capital. Think.</think>Canberra.")], None)
    assert leaked.earned == 2  # content is scored as returned ...
    assert leaked.flags["stray_think_tag"] == 1 and leaked.flags["reasoning_in_content"] == 1  # ... and the defect reported
    bare = score_scenario(s, [turn(content="</think>Canberra")], None)
    assert bare.flags["stray_think_tag"] == 1 and bare.flags["reasoning_in_content"] == 0


def test_tool_markup_left_in_content_is_a_parser_flag() -> None:
    s = scenario([{"expect": "call", "calls": [WEATHER_CALL]}])
    raw = "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Oslo</arg_value>"
    score = score_scenario(s, [turn(content=raw)], None)
    assert score.earned == 0 and score.flags["unparsed_tool_markup"] == 1


def test_request_failure_is_kept_apart_from_model_errors() -> None:
    s = scenario([{"expect": "call", "calls": [WEATHER_CALL]}])
    failed = score_scenario(s, [turn_from_message(None, error="http 400: context too long")], None)
    assert failed.request_failed and kinds(failed) == ["request_failed"] and failed.earned == 0


# -- multi-step with simulated tools ------------------------------------------------------------
def scripted(messages: list[dict[str, Any]]) -> Any:
    """A post() that answers each turn with the next scripted assistant message."""
    queue = list(messages)

    def post(body: dict[str, Any]) -> Reply:
        return Reply(queue.pop(0), "stop", None, 0.0, None)

    return post


def test_state_checks_reward_a_different_valid_route() -> None:
    s = load_suite().by_id()["plan-cancel-latest-order"]
    config = RunConfig(base_url="http://unused", model="m")
    detour = scripted([
        {"role": "assistant", "content": None, "tool_calls": [call("get_order", {"order_id": "A-1042"})]},
        {"role": "assistant", "content": None, "tool_calls": [call("cancel_order", {"order_id": "A-1042"})]},
        {"role": "assistant", "content": "Done: A-1042 is cancelled."},
    ])
    record = run_scenario(s, config, detour)
    score = record["score"]
    assert record["final_state"]["orders"]["A-1042"]["status"] == "cancelled"
    assert score["state_earned"] == score["state_max"] == 3  # the end state is right
    assert score["earned"] < score["max"]  # the step-by-step route differed (get_order for lookup_customer)
    assert any(e["kind"] == "wrong_function" for e in score["errors"])


def test_conversation_stops_when_the_model_answers_early() -> None:
    s = load_suite().by_id()["plan-conditional-transfer"]
    early = scripted([{"role": "assistant", "content": "I moved it."}])
    record = run_scenario(s, RunConfig(base_url="http://unused", model="m"), early)
    assert len(record["turns"]) == 1
    kinds_found = {e["kind"] for e in record["score"]["errors"]}
    assert {"missing_call", "ended_early", "state_mismatch"} <= kinds_found
    assert record["score"]["earned"] == 0
