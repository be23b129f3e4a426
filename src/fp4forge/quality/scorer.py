"""Deterministic scoring of model turns against a scenario's expected steps.

Rules (also in docs/quality.md, which is the reference):

* **A call** is worth 1 point for the function name plus each expected argument's points (1 by
  default; an object spec is worth the sum of its fields). A wrong name earns nothing for that call;
  arguments that are not valid JSON earn the name point only (error ``parse:arguments``).
* **An argument** earns its points when it is present (or legitimately omitted: ``may_omit``),
  type-valid for its schema and accepted by its spec (``allowed`` values, ``contains_all`` /
  ``contains_none`` substrings, or ``any``). Leaves are all-or-nothing; objects score per field.
* **Penalties**, each 1 point, never below 0 per call: an argument the schema does not define; a
  schema argument the spec does not mention, given with the wrong type.
* **Parallel calls** are matched order-free: the assignment of model calls to expected calls that
  earns the most points. A leftover model call paired with a leftover expected call is a
  ``wrong_function`` (0, no penalty); other leftover model calls are ``extra_call`` (−1 each from the
  step, never below 0); leftover expected calls are ``missing_call``.
* **answer / ask** steps: ``points`` for making no call at all, plus the content check.
  **decline** steps: any forbidden call zeroes the step; otherwise ``points`` plus the content check;
  calls that are not forbidden are neutral. A turn cut at ``max_tokens`` (``finish_reason:
  length``) earns no ``points`` on these steps (``truncated``): not calling yet is not a decision
  not to call, so a model that only ever runs out of tokens does not collect the restraint points.
* **State checks** compare the simulated world's end state, so another valid route earns them. A
  check with ``only_if`` ("nothing else was damaged") earns only when the named earlier check
  passed, so an agent that does nothing does not collect it.
* **Reasoning is never scored.** The ``reasoning`` field is ignored; a ``<think>``/``</think>`` tag or
  ``<tool_call>`` markup in ``content`` is *flagged* (stray reasoning, tool-parser failure) and the
  content is scored as the server returned it.

Type coercions (documented, nothing else is coerced): an ``integer`` accepts a float with an
integral value (``3.0``); a ``number`` accepts an integer; a boolean is never a number; strings are
never parsed into numbers or booleans. Enum membership is exact (case-sensitive). String values are
compared case-insensitively with whitespace collapsed unless the spec says ``exact``; ``as: date`` /
``as: datetime`` compare parsed ISO values (seconds optional, a timezone offset is ignored).
"""

from __future__ import annotations

import datetime as dt
import itertools
import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any

from fp4forge.quality.suite import ArgSpec, ContentCheck, ExpectedCall, ForbiddenCall, Scenario, StateCheck, Step

# Error kinds. Model errors and infrastructure failures are kept apart.
PARSE_ARGUMENTS = "parse:arguments"
WRONG_FUNCTION = "wrong_function"
MISSING_CALL = "missing_call"
EXTRA_CALL = "extra_call"
MISSING_ARGUMENT = "missing_argument"
WRONG_TYPE = "wrong_type"
WRONG_ENUM = "wrong_enum"
WRONG_VALUE = "wrong_value"
UNKNOWN_ARGUMENT = "unknown_argument"
UNEXPECTED_CALL = "unexpected_call"
FORBIDDEN_CALL = "forbidden_call"
CONTENT_MISMATCH = "content_mismatch"
ENDED_EARLY = "ended_early"
TRUNCATED = "truncated"
LENGTH_FINISH = "length"  # the OpenAI finish_reason of a turn cut at max_tokens
REQUEST_FAILED = "request_failed"
STATE_MISMATCH = "state_mismatch"

# A heuristic, stated as one: words that mark a refusal or a "cannot do that" in English.
REFUSAL_MARKERS = (
    "can't", "can’t", "cannot", "can not", "unable", "not able", "won't", "won’t", "will not",
    "don't have", "don’t have", "do not have", "not possible", "not available", "no tool",
    "sorry", "refuse", "decline", "not allowed", "not permitted", "shouldn't", "should not", "must not",
)
THINK_TAGS = ("<think>", "</think>")
TOOL_MARKUP = ("<tool_call>", "</tool_call>", "<arg_key>", "<arg_value>")
MAX_BRUTE_FORCE_CALLS = 7  # permutations beyond this fall back to greedy matching


# -- model turns --------------------------------------------------------------------------------
@dataclass
class ParsedCall:
    name: str
    arguments_raw: str
    arguments: dict[str, Any] | None
    parse_error: str | None = None


@dataclass
class ModelTurn:
    """One assistant turn as the server returned it (or the failure instead of it)."""

    content: str | None = None
    reasoning: str | None = None
    calls: list[ParsedCall] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None  # request failure: transport, HTTP status, unparseable body


def parse_tool_call(raw: dict[str, Any]) -> ParsedCall:
    function = raw.get("function") or {}
    name = str(function.get("name") or "")
    arguments = function.get("arguments")
    if isinstance(arguments, dict):  # some servers send an object, not a JSON string
        return ParsedCall(name, json.dumps(arguments), arguments)
    text = "" if arguments is None else str(arguments)
    if not text.strip():
        return ParsedCall(name, text, {})
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        return ParsedCall(name, text, None, f"arguments are not JSON: {error.msg} at {error.pos}")
    if not isinstance(value, dict):
        return ParsedCall(name, text, None, f"arguments are JSON {type(value).__name__}, not an object")
    return ParsedCall(name, text, value)


def turn_from_message(message: dict[str, Any] | None, finish_reason: str | None = None, error: str | None = None) -> ModelTurn:
    if message is None:
        return ModelTurn(finish_reason=finish_reason, error=error or "no message")
    reasoning = message.get("reasoning") or message.get("reasoning_content")
    return ModelTurn(
        content=message.get("content"),
        reasoning=reasoning,
        calls=[parse_tool_call(call) for call in message.get("tool_calls") or []],
        finish_reason=finish_reason,
        error=error,
    )


# -- normalisation and types --------------------------------------------------------------------
def normalize_text(text: str) -> str:
    return " ".join(text.casefold().split())


def parse_iso(value: Any, value_format: str) -> dt.date | dt.datetime | None:
    if not isinstance(value, str):
        return None
    text = value.strip()
    try:
        if value_format == "date":
            return dt.date.fromisoformat(text)
        parsed = dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
        return parsed.replace(tzinfo=None)  # the wall-clock time is what is checked
    except ValueError:
        return None


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def schema_types(schema: dict[str, Any]) -> list[str]:
    kind = schema.get("type")
    if kind is None:
        return []
    return list(kind) if isinstance(kind, list) else [kind]


def check_type(value: Any, schema: dict[str, Any]) -> str | None:
    """None when ``value`` is valid for ``schema``; otherwise WRONG_TYPE or WRONG_ENUM."""
    kinds = schema_types(schema)
    if kinds and not any(_is_kind(value, kind) for kind in kinds):
        return WRONG_TYPE
    if "enum" in schema and value not in schema["enum"]:
        return WRONG_ENUM
    if isinstance(value, list) and "items" in schema:
        for item in value:
            if check_type(item, schema["items"]) is not None:
                return WRONG_TYPE
    if isinstance(value, dict) and "properties" in schema:
        if any(key not in value for key in schema.get("required", [])):
            return WRONG_TYPE
        for key, item in value.items():
            if key in schema["properties"] and check_type(item, schema["properties"][key]) is not None:
                return WRONG_TYPE
    return None


def _is_kind(value: Any, kind: str) -> bool:
    if kind == "string":
        return isinstance(value, str)
    if kind == "integer":
        return (isinstance(value, int) and not isinstance(value, bool)) or (isinstance(value, float) and value.is_integer())
    if kind == "number":
        return is_number(value) and not (isinstance(value, float) and not math.isfinite(value))
    if kind == "boolean":
        return isinstance(value, bool)
    if kind == "array":
        return isinstance(value, list)
    if kind == "object":
        return isinstance(value, dict)
    if kind == "null":
        return value is None
    return True  # an unknown schema type constrains nothing


def values_equal(actual: Any, expected: Any, *, exact: bool = False, unordered: bool = False,
                 tolerance: float | None = None, value_format: str | None = None) -> bool:
    """Equality under the documented normalisation rules."""
    if value_format is not None:
        left, right = parse_iso(actual, value_format), parse_iso(expected, value_format)
        return left is not None and left == right
    if isinstance(expected, bool) or isinstance(actual, bool):
        return isinstance(actual, bool) and isinstance(expected, bool) and actual == expected
    if is_number(expected):
        if not is_number(actual):
            return False
        allowed_error = tolerance if tolerance is not None else 1e-9 * max(1.0, abs(expected))
        return abs(actual - expected) <= allowed_error
    if isinstance(expected, str):
        if not isinstance(actual, str):
            return False
        return actual.strip() == expected.strip() if exact else normalize_text(actual) == normalize_text(expected)
    if isinstance(expected, list):
        if not isinstance(actual, list) or len(actual) != len(expected):
            return False
        same = lambda a, e: values_equal(a, e, exact=exact, unordered=unordered, tolerance=tolerance)  # noqa: E731
        if not unordered:
            return all(same(a, e) for a, e in zip(actual, expected))
        remaining = list(actual)
        for item in expected:
            match = next((i for i, candidate in enumerate(remaining) if same(candidate, item)), None)
            if match is None:
                return False
            remaining.pop(match)
        return True
    if isinstance(expected, dict):
        if not isinstance(actual, dict) or set(actual) != set(expected):
            return False
        return all(values_equal(actual[k], expected[k], exact=exact, tolerance=tolerance) for k in expected)
    return actual == expected


def text_contains(text: str, needle: str) -> bool:
    return normalize_text(needle) in normalize_text(text)


# -- scores -------------------------------------------------------------------------------------
@dataclass
class Error:
    kind: str
    detail: str
    step: int | None = None


@dataclass
class Earned:
    earned: int
    max: int
    errors: list[Error] = field(default_factory=list)


@dataclass
class StepScore:
    index: int
    expect: str
    earned: int
    max: int
    errors: list[Error] = field(default_factory=list)


@dataclass
class ScenarioScore:
    id: str
    category: str
    earned: int
    max: int
    steps: list[StepScore]
    state_earned: int
    state_max: int
    errors: list[Error]
    flags: dict[str, int]
    request_failed: bool

    @property
    def fraction(self) -> float:
        return self.earned / self.max if self.max else 0.0

    @property
    def fully_correct(self) -> bool:
        return self.earned == self.max

    def to_dict(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["fraction"] = self.fraction
        doc["fully_correct"] = self.fully_correct
        return doc


# -- arguments and calls ------------------------------------------------------------------------
def score_argument(spec: ArgSpec, present: bool, value: Any, schema: dict[str, Any], name: str) -> Earned:
    full = spec.max_points
    if not present:
        if spec.may_omit:
            return Earned(full, full)
        return Earned(0, full, [Error(MISSING_ARGUMENT, name)])
    if spec.fields is not None:
        if not isinstance(value, dict):
            return Earned(0, full, [Error(WRONG_TYPE, f"{name}: expected an object, got {type(value).__name__}")])
        properties = schema.get("properties", {})
        earned, errors = 0, []
        for key, field_spec in spec.fields.items():
            part = score_argument(field_spec, key in value, value.get(key), properties.get(key, {}), f"{name}.{key}")
            earned += part.earned
            errors += part.errors
        for key in value:
            if properties and key not in properties:
                errors.append(Error(UNKNOWN_ARGUMENT, f"{name}.{key}"))
                earned -= 1
        return Earned(max(0, earned), full, errors)
    type_error = check_type(value, schema)
    if type_error is not None:
        return Earned(0, full, [Error(type_error, f"{name}={_short(value)}")])
    if leaf_accepts(spec, value):
        return Earned(full, full)
    return Earned(0, full, [Error(WRONG_VALUE, f"{name}={_short(value)}")])


def leaf_accepts(spec: ArgSpec, value: Any) -> bool:
    """Does a (type-valid) value satisfy a leaf spec? All stated conditions must hold."""
    if spec.contains_all or spec.contains_none or spec.contains_any:
        if not isinstance(value, str):
            return False
        if not all(text_contains(value, needle) for needle in spec.contains_all):
            return False
        if any(text_contains(value, needle) for needle in spec.contains_none):
            return False
        if spec.contains_any and not any(text_contains(value, needle) for needle in spec.contains_any):
            return False
    if spec.allowed is not None:
        return any(
            values_equal(value, allowed, exact=spec.exact, unordered=spec.unordered, tolerance=spec.tolerance, value_format=spec.value_format)
            for allowed in spec.allowed
        )
    return True  # any, or only substring conditions


def score_call(expected: ExpectedCall, call: ParsedCall, tool: dict[str, Any] | None) -> Earned:
    full = expected.max_points
    if call.name != expected.name:
        return Earned(0, full, [Error(WRONG_FUNCTION, f"expected {expected.name}, got {call.name or '<empty>'}")])
    if call.arguments is None:
        return Earned(1, full, [Error(PARSE_ARGUMENTS, f"{call.name}: {call.parse_error}")])
    properties = (tool or {}).get("parameters", {}).get("properties", {})
    earned, errors = 1, []
    for key, spec in expected.arguments.items():
        part = score_argument(spec, key in call.arguments, call.arguments.get(key), properties.get(key, {}), f"{call.name}.{key}")
        earned += part.earned
        errors += part.errors
    for key, value in call.arguments.items():
        if key in expected.arguments:
            continue
        if key not in properties:
            errors.append(Error(UNKNOWN_ARGUMENT, f"{call.name}.{key}"))
            earned -= 1
        elif check_type(value, properties[key]) is not None:
            errors.append(Error(WRONG_TYPE, f"{call.name}.{key}={_short(value)} (not checked for value)"))
            earned -= 1
    return Earned(max(0, earned), full, errors)


def match_calls(expected: tuple[ExpectedCall, ...], calls: list[ParsedCall], tools: dict[str, dict[str, Any]]) -> tuple[int, list[Error]]:
    """Order-free best assignment; returns (earned before the extra-call penalty, errors)."""
    table = [[score_call(e, c, tools.get(e.name)) for c in calls] for e in expected]
    pairs = _best_assignment(table, len(expected), len(calls))
    earned, errors = 0, []
    used_expected = {e for e, _ in pairs}
    used_calls = {c for _, c in pairs}
    for e, c in pairs:
        earned += table[e][c].earned
        errors += table[e][c].errors
    left_expected = [e for e in range(len(expected)) if e not in used_expected]
    left_calls = [c for c in range(len(calls)) if c not in used_calls]
    for e, c in zip(left_expected, left_calls):
        errors.append(Error(WRONG_FUNCTION, f"expected {expected[e].name}, got {calls[c].name or '<empty>'}"))
    for e in left_expected[len(left_calls):]:
        errors.append(Error(MISSING_CALL, expected[e].name))
    for c in left_calls[len(left_expected):]:
        errors.append(Error(EXTRA_CALL, calls[c].name or "<empty>"))
    return earned, errors


def _best_assignment(table: list[list[Earned]], n_expected: int, n_calls: int) -> list[tuple[int, int]]:
    """Pairs (expected, call) with matching names that maximise earned points."""
    def valid(e: int, c: int) -> bool:
        return not any(err.kind == WRONG_FUNCTION for err in table[e][c].errors)

    size = max(n_expected, n_calls)
    if size <= MAX_BRUTE_FORCE_CALLS:
        # Pad to a square: expected i takes call perm[i]; indices past either end mean "unpaired".
        best: list[tuple[int, int]] = []
        best_total = -1
        for perm in itertools.permutations(range(size)):
            pairs = [(e, perm[e]) for e in range(n_expected) if perm[e] < n_calls and valid(e, perm[e])]
            total = sum(table[e][c].earned for e, c in pairs) * 1000 + len(pairs)  # ties: more name matches
            if total > best_total:
                best, best_total = pairs, total
        return best
    candidates = sorted(((table[e][c].earned, e, c) for e in range(n_expected) for c in range(n_calls) if valid(e, c)), reverse=True)
    pairs, used_e, used_c = [], set(), set()
    for _, e, c in candidates:
        if e not in used_e and c not in used_c:
            pairs.append((e, c))
            used_e.add(e)
            used_c.add(c)
    return pairs


# -- steps --------------------------------------------------------------------------------------
def content_matches(check: ContentCheck, content: str | None) -> bool:
    if not content:
        return False
    needles = REFUSAL_MARKERS if check.refusal else check.any_of
    return any(text_contains(content, needle) for needle in needles)


def is_forbidden(call: ParsedCall, forbidden: ForbiddenCall) -> bool:
    if call.name != forbidden.name:
        return False
    if not forbidden.when:
        return True
    arguments = call.arguments or {}
    return all(key in arguments and leaf_accepts(spec, arguments[key]) for key, spec in forbidden.when.items())


def score_step(step: Step, index: int, turn: ModelTurn | None, tools: dict[str, dict[str, Any]]) -> StepScore:
    full = step.max_points
    if turn is None:
        return StepScore(index, step.expect, 0, full, [Error(ENDED_EARLY, "the conversation ended before this turn", index)])
    if turn.error is not None:
        return StepScore(index, step.expect, 0, full, [Error(REQUEST_FAILED, turn.error, index)])
    errors: list[Error] = []
    content_points = 0
    if step.content is not None:
        if content_matches(step.content, turn.content):
            content_points = step.content.points
        else:
            errors.append(Error(CONTENT_MISMATCH, "needs a refusal" if step.content.refusal else f"needs one of {list(step.content.any_of)}"))
    if step.expect == "call":
        earned, call_errors = match_calls(step.calls, turn.calls, tools)
        errors += call_errors
        extra = sum(1 for error in call_errors if error.kind == EXTRA_CALL)
        earned = max(0, earned - extra * step.extra_call_penalty) + content_points
    elif step.expect in ("answer", "ask"):
        for call in turn.calls:
            errors.append(Error(UNEXPECTED_CALL, call.name or "<empty>"))
        earned = (0 if turn.calls or _cut_short(turn, errors) else step.points) + content_points
    else:  # decline
        hits = [call for call in turn.calls if any(is_forbidden(call, f) for f in step.forbidden)]
        for call in hits:
            errors.append(Error(FORBIDDEN_CALL, f"{call.name}({_short(call.arguments_raw)})"))
        earned = 0 if hits else (0 if _cut_short(turn, errors) else step.points) + content_points
    for error in errors:
        error.step = index
    return StepScore(index, step.expect, earned, full, errors)


def _cut_short(turn: ModelTurn, errors: list[Error]) -> bool:
    """A turn that ended at max_tokens made no decision about calling: no credit for not calling."""
    if turn.finish_reason != LENGTH_FINISH:
        return False
    errors.append(Error(TRUNCATED, "cut at max_tokens before the turn ended: not calling is not credited"))
    return True


def score_state_check(check: StateCheck, state: dict[str, Any]) -> Earned:
    found, value = lookup(state, check.path)
    where = "/".join(check.path)
    if check.absent:
        ok = not found
        return Earned(check.points if ok else 0, check.points, [] if ok else [Error(STATE_MISMATCH, f"{where} should be absent")])
    if not found:
        return Earned(0, check.points, [Error(STATE_MISMATCH, f"{where} is missing")])
    ok = True
    if check.has_equals and not values_equal(value, check.equals, value_format=check.value_format):
        ok = False
    if check.contains_all or check.contains_none:
        if not isinstance(value, str):
            ok = False
        else:
            ok = ok and all(text_contains(value, n) for n in check.contains_all) and not any(text_contains(value, n) for n in check.contains_none)
    return Earned(check.points if ok else 0, check.points, [] if ok else [Error(STATE_MISMATCH, f"{where}={_short(value)}")])


def lookup(state: Any, path: tuple[str, ...]) -> tuple[bool, Any]:
    node = state
    for part in path:
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return False, None
    return True, node


# -- scenarios ----------------------------------------------------------------------------------
def turn_flags(turn: ModelTurn) -> dict[str, int]:
    """Defects reported beside the score, never inside it."""
    content = turn.content or ""
    closing = content.find("</think>")
    return {
        "stray_think_tag": int(any(tag in content for tag in THINK_TAGS)),
        "reasoning_in_content": int(closing > 0 and bool(content[:closing].strip())),
        "unparsed_tool_markup": int(any(tag in content for tag in TOOL_MARKUP)),
        "reasoning_field": int(bool(turn.reasoning)),
        "malformed_arguments": sum(1 for call in turn.calls if call.arguments is None),
        "empty_turn": int(turn.error is None and not content.strip() and not turn.calls),
    }


def score_scenario(scenario: Scenario, turns: list[ModelTurn], final_state: dict[str, Any] | None) -> ScenarioScore:
    tools = {tool["name"]: tool for tool in scenario.tools}
    steps = [score_step(step, i, turns[i] if i < len(turns) else None, tools) for i, step in enumerate(scenario.steps)]
    errors = [error for step in steps for error in step.errors]
    state_earned = 0
    passed: list[bool] = []
    for index, check in enumerate(scenario.state_checks):
        if check.only_if is not None and not passed[check.only_if]:
            # A "nothing else was damaged" check: doing nothing at all must not earn it.
            part = Earned(0, check.points, [Error(STATE_MISMATCH, f"{'/'.join(check.path)}: not credited, state check {check.only_if} failed")])
        else:
            part = score_state_check(check, final_state or {})
        passed.append(part.earned == part.max)
        state_earned += part.earned
        errors += part.errors
    flags: dict[str, int] = {}
    for turn in turns:
        for key, value in turn_flags(turn).items():
            flags[key] = flags.get(key, 0) + value
    earned = sum(step.earned for step in steps) + state_earned
    return ScenarioScore(
        id=scenario.id,
        category=scenario.category,
        earned=earned,
        max=scenario.max_points,
        steps=steps,
        state_earned=state_earned,
        state_max=sum(check.points for check in scenario.state_checks),
        errors=errors,
        flags=flags,
        request_failed=any(turn.error is not None for turn in turns),
    )


def category_totals(scores: list[ScenarioScore], categories: list[str]) -> dict[str, dict[str, int]]:
    totals = {category: {"earned": 0, "max": 0, "scenarios": 0, "fully_correct": 0} for category in categories}
    for score in scores:
        entry = totals.setdefault(score.category, {"earned": 0, "max": 0, "scenarios": 0, "fully_correct": 0})
        entry["earned"] += score.earned
        entry["max"] += score.max
        entry["scenarios"] += 1
        entry["fully_correct"] += int(score.fully_correct)
    return totals


# -- suite lint (semantic checks the loader cannot make) -----------------------------------------
def lint_scenario(scenario: Scenario) -> list[str]:
    """Problems with a scenario's expectations; empty when it is sound."""
    problems: list[str] = []
    for index, step in enumerate(scenario.steps):
        for call in step.calls:
            tool = scenario.tool(call.name) or {}
            parameters = tool.get("parameters", {})
            properties = parameters.get("properties", {})
            for key in parameters.get("required", []):
                spec = call.arguments.get(key)
                if spec is None or spec.may_omit:
                    problems.append(f"step {index}: {call.name}.{key} is required by the schema but not required by the expectation")
            for key, spec in call.arguments.items():
                if key not in properties:
                    problems.append(f"step {index}: {call.name}.{key} is not in the tool schema")
                    continue
                problems += [f"step {index}: {call.name}.{key}: {p}" for p in _lint_spec(spec, properties[key])]
    return problems


def _lint_spec(spec: ArgSpec, schema: dict[str, Any]) -> list[str]:
    if spec.fields is not None:
        problems = []
        properties = schema.get("properties", {})
        for key, field_spec in spec.fields.items():
            if key not in properties:
                problems.append(f"field {key} is not in the schema")
            else:
                problems += [f"{key}: {p}" for p in _lint_spec(field_spec, properties[key])]
        return problems
    values = list(spec.allowed or ())
    if spec.example is not None:
        values.append(spec.example)
    problems = [f"allowed/example value {_short(v)} is {check_type(v, schema)} for the schema" for v in values if check_type(v, schema)]
    if spec.example is not None and not spec.any_value and not leaf_accepts(spec, spec.example):
        problems.append(f"example {_short(spec.example)} does not satisfy its own spec")
    return problems


def example_value(spec: ArgSpec) -> Any:
    """A value the spec accepts: what a perfect agent would send (used to prove each scenario solvable)."""
    if spec.fields is not None:
        return {key: example_value(field_spec) for key, field_spec in spec.fields.items()}
    if spec.example is not None:
        return spec.example
    if spec.allowed:
        return spec.allowed[0]
    return " ".join(spec.contains_all)


def _short(value: Any, limit: int = 80) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text if len(text) <= limit else text[: limit - 1] + "…"
