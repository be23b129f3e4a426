"""The agentic tool-use scenario suite as data, its loader and its typed model.

The suite lives in ``scenarios/``: ``suite.json`` (name, version, the scenario and category counts
every load must find), ``tools.json`` (the tool catalogue, OpenAI function definitions) and one
``NN_<category>.json`` per category. ``load_suite()`` reads and structurally validates them into
frozen dataclasses; semantic checks that need the scorer's type rules (allowed values valid for
their schema, required arguments covered) are ``fp4forge.quality.scorer.lint_scenario``.
"""

from __future__ import annotations

import copy
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fp4forge.errors import SuiteError

SCENARIO_DIR = Path(__file__).resolve().parent / "scenarios"
MANIFEST_FILE = "suite.json"
CATALOGUE_FILE = "tools.json"

STEP_KINDS = ("call", "answer", "ask", "decline")
LEAF_KEYS = {"allowed", "contains_all", "contains_none", "contains_any", "any", "example"}
ARG_SPEC_KEYS = LEAF_KEYS | {"fields", "may_omit", "exact", "unordered", "tolerance", "as", "points"}
VALUE_FORMATS = (None, "date", "datetime")


# -- the model ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class ArgSpec:
    """What one argument may be. A leaf (allowed / contains / any) or an object spec (``fields``)."""

    allowed: tuple[Any, ...] | None = None
    contains_all: tuple[str, ...] = ()
    contains_none: tuple[str, ...] = ()
    contains_any: tuple[str, ...] = ()  # only in forbidden-call matchers
    any_value: bool = False
    fields: dict[str, ArgSpec] | None = None
    may_omit: bool = False
    exact: bool = False
    unordered: bool = False
    tolerance: float | None = None
    value_format: str | None = None  # "date" | "datetime": compared as parsed ISO values
    points: int = 1
    example: Any = None

    @property
    def max_points(self) -> int:
        if self.fields is not None:
            return sum(spec.max_points for spec in self.fields.values())
        return self.points


@dataclass(frozen=True)
class ExpectedCall:
    name: str
    arguments: dict[str, ArgSpec]

    @property
    def max_points(self) -> int:
        return 1 + sum(spec.max_points for spec in self.arguments.values())  # 1 for the name


@dataclass(frozen=True)
class ForbiddenCall:
    """A call that zeroes a ``decline`` step: this name, with arguments matching ``when`` (if any)."""

    name: str
    when: dict[str, ArgSpec] = field(default_factory=dict)


@dataclass(frozen=True)
class ContentCheck:
    """The assistant text must contain one of ``any_of`` (or, with ``refusal``, a refusal marker)."""

    any_of: tuple[str, ...] = ()
    refusal: bool = False
    points: int = 1


@dataclass(frozen=True)
class Step:
    """One expected assistant turn."""

    expect: str
    calls: tuple[ExpectedCall, ...] = ()
    user: str | None = None  # a follow-up user message sent before this turn
    points: int = 1  # answer / ask / decline: for making no (forbidden) call
    forbidden: tuple[ForbiddenCall, ...] = ()
    content: ContentCheck | None = None
    extra_call_penalty: int = 1

    @property
    def max_points(self) -> int:
        content = self.content.points if self.content else 0
        if self.expect == "call":
            return sum(call.max_points for call in self.calls) + content
        return self.points + content


@dataclass(frozen=True)
class StateCheck:
    """A condition on the simulated world's state after the conversation (tau-bench style)."""

    path: tuple[str, ...]
    equals: Any = None
    has_equals: bool = False
    contains_all: tuple[str, ...] = ()
    contains_none: tuple[str, ...] = ()
    absent: bool = False
    value_format: str | None = None
    points: int = 1
    only_if: int | None = None  # earns only when that earlier check passed ("nothing else was damaged")


@dataclass(frozen=True)
class Scenario:
    id: str
    category: str
    summary: str
    tool_names: tuple[str, ...]
    tools: tuple[dict[str, Any], ...]  # OpenAI function definitions, in offer order
    messages: tuple[dict[str, Any], ...]  # wire format, system prompt first when there is one
    steps: tuple[Step, ...]
    state_checks: tuple[StateCheck, ...] = ()
    world: dict[str, Any] = field(default_factory=dict)
    source: str = ""

    @property
    def max_points(self) -> int:
        return sum(step.max_points for step in self.steps) + sum(check.points for check in self.state_checks)

    def tool(self, name: str) -> dict[str, Any] | None:
        return next((tool for tool in self.tools if tool["name"] == name), None)

    def request_tools(self) -> list[dict[str, Any]]:
        return [{"type": "function", "function": copy.deepcopy(tool)} for tool in self.tools]

    def initial_messages(self) -> list[dict[str, Any]]:
        return copy.deepcopy(list(self.messages))


@dataclass(frozen=True)
class Suite:
    name: str
    version: str
    digest: str  # sha256 over every suite file: recorded with runs, checked when re-scoring
    scenarios: tuple[Scenario, ...]
    category_titles: dict[str, str]

    @property
    def categories(self) -> list[str]:
        return list(self.category_titles)

    def by_id(self) -> dict[str, Scenario]:
        return {scenario.id: scenario for scenario in self.scenarios}

    def select(self, ids: list[str] | None = None, categories: list[str] | None = None) -> list[Scenario]:
        chosen = list(self.scenarios)
        if ids:
            unknown = sorted(set(ids) - {s.id for s in chosen})
            if unknown:
                raise SuiteError(f"unknown scenario id(s): {', '.join(unknown)}")
            chosen = [s for s in chosen if s.id in ids]
        if categories:
            unknown = sorted(set(categories) - set(self.category_titles))
            if unknown:
                raise SuiteError(f"unknown categor(y/ies): {', '.join(unknown)}")
            chosen = [s for s in chosen if s.category in categories]
        return chosen

    def listing(self) -> list[dict[str, Any]]:
        """What ``quality list --json`` prints: one object per scenario."""
        return [
            {"id": s.id, "category": s.category, "max_points": s.max_points, "steps": len(s.steps), "summary": s.summary}
            for s in self.scenarios
        ]


# -- loading ------------------------------------------------------------------------------------
def load_suite(directory: Path | None = None) -> Suite:
    """Read and validate the suite; the counts in ``suite.json`` must match what the files hold."""
    directory = Path(directory) if directory is not None else SCENARIO_DIR
    manifest = _read_json(directory / MANIFEST_FILE)
    catalogue = load_catalogue(directory / CATALOGUE_FILE)
    category_files = sorted(p for p in directory.glob("*.json") if p.name not in (MANIFEST_FILE, CATALOGUE_FILE))
    scenarios: list[Scenario] = []
    titles: dict[str, str] = {}
    for path in category_files:
        doc = _read_json(path)
        category = _require(doc, "category", str, path.name)
        if category in titles:
            raise SuiteError(f"category {category!r} is defined twice", file=str(path))
        titles[category] = _require(doc, "title", str, path.name)
        for raw in _require(doc, "scenarios", list, path.name):
            scenarios.append(parse_scenario(raw, category, catalogue, source=path.name))
    ids = [s.id for s in scenarios]
    duplicates = sorted({i for i in ids if ids.count(i) > 1})
    if duplicates:
        raise SuiteError(f"duplicate scenario ids: {', '.join(duplicates)}", file=str(directory))
    expected_count = manifest.get("scenario_count")
    if expected_count != len(scenarios):
        raise SuiteError(f"{MANIFEST_FILE} declares {expected_count} scenarios, the files hold {len(scenarios)}", file=str(directory))
    expected_categories = manifest.get("category_count")
    if expected_categories != len(titles):
        raise SuiteError(f"{MANIFEST_FILE} declares {expected_categories} categories, the files hold {len(titles)}", file=str(directory))
    return Suite(
        name=str(manifest.get("name", "unnamed")),
        version=str(manifest.get("version", "0")),
        digest=suite_digest([directory / MANIFEST_FILE, directory / CATALOGUE_FILE, *category_files]),
        scenarios=tuple(scenarios),
        category_titles=titles,
    )


def load_catalogue(path: Path) -> dict[str, dict[str, Any]]:
    tools = _require(_read_json(path), "tools", list, path.name)
    catalogue: dict[str, dict[str, Any]] = {}
    for tool in tools:
        name = _require(tool, "name", str, path.name)
        parameters = _require(tool, "parameters", dict, f"{path.name}:{name}")
        if parameters.get("type") != "object":
            raise SuiteError(f"tool {name}: parameters must be a JSON-schema object", file=str(path))
        undefined = set(parameters.get("required", [])) - set(parameters.get("properties", {}))
        if undefined:
            raise SuiteError(f"tool {name}: required but undefined properties {sorted(undefined)}", file=str(path))
        if name in catalogue:
            raise SuiteError(f"tool {name} is defined twice", file=str(path))
        catalogue[name] = tool
    return catalogue


def suite_digest(paths: list[Path]) -> str:
    digest = hashlib.sha256()
    for path in paths:
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def parse_scenario(raw: dict[str, Any], category: str, catalogue: dict[str, dict[str, Any]], source: str = "") -> Scenario:
    where = f"{source}:{raw.get('id', '?')}"
    scenario_id = _require(raw, "id", str, where)
    tool_names = tuple(_require(raw, "tools", list, where))
    unknown = [name for name in tool_names if name not in catalogue]
    if unknown:
        raise SuiteError(f"{where}: tools not in the catalogue: {unknown}")
    tools = tuple(copy.deepcopy(catalogue[name]) for name in tool_names)
    offered = set(tool_names)
    steps = tuple(parse_step(step, offered, f"{where} step {i}") for i, step in enumerate(_require(raw, "steps", list, where)))
    if not steps:
        raise SuiteError(f"{where}: a scenario needs at least one step")
    world = raw.get("world", {})
    for tool_name in world.get("fixtures", {}):
        if tool_name not in offered:
            raise SuiteError(f"{where}: fixture for {tool_name}, which the scenario does not offer")
    state_checks = tuple(parse_state_check(check, i, f"{where} state check {i}") for i, check in enumerate(raw.get("state_checks", [])))
    if state_checks and "state" not in world:
        raise SuiteError(f"{where}: state checks need a world state")
    messages = to_wire_messages(raw.get("system"), _require(raw, "messages", list, where), scenario_id)
    if steps[0].user is None and messages[-1]["role"] not in ("user", "tool"):
        raise SuiteError(f"{where}: the conversation must end with a user or tool message before the first step")
    return Scenario(
        id=scenario_id,
        category=category,
        summary=str(raw.get("summary", "")),
        tool_names=tool_names,
        tools=tools,
        messages=tuple(messages),
        steps=steps,
        state_checks=state_checks,
        world=copy.deepcopy(world),
        source=source,
    )


def parse_step(raw: dict[str, Any], offered: set[str], where: str) -> Step:
    expect = _require(raw, "expect", str, where)
    if expect not in STEP_KINDS:
        raise SuiteError(f"{where}: expect must be one of {STEP_KINDS}, got {expect!r}")
    calls = tuple(parse_expected_call(call, offered, f"{where} call {i}") for i, call in enumerate(raw.get("calls", [])))
    if expect == "call" and not calls:
        raise SuiteError(f"{where}: a call step needs calls")
    if expect != "call" and calls:
        raise SuiteError(f"{where}: only call steps list calls")
    forbidden = tuple(parse_forbidden(item, offered, where) for item in raw.get("forbidden", []))
    if expect == "decline" and not forbidden:
        raise SuiteError(f"{where}: a decline step names its forbidden calls")
    content = raw.get("content")
    check = None
    if content is not None:
        check = ContentCheck(any_of=tuple(content.get("any_of", ())), refusal=bool(content.get("refusal", False)), points=int(content.get("points", 1)))
        if not check.any_of and not check.refusal:
            raise SuiteError(f"{where}: a content check needs any_of or refusal")
    return Step(
        expect=expect,
        calls=calls,
        user=raw.get("user"),
        points=int(raw.get("points", 1)),
        forbidden=forbidden,
        content=check,
        extra_call_penalty=int(raw.get("extra_call_penalty", 1)),
    )


def parse_expected_call(raw: dict[str, Any], offered: set[str], where: str) -> ExpectedCall:
    name = _require(raw, "name", str, where)
    if name not in offered:
        raise SuiteError(f"{where}: expected call {name} is not offered")
    arguments = {key: parse_arg_spec(spec, f"{where} {name}.{key}") for key, spec in raw.get("arguments", {}).items()}
    return ExpectedCall(name=name, arguments=arguments)


def parse_forbidden(raw: str | dict[str, Any], offered: set[str], where: str) -> ForbiddenCall:
    if isinstance(raw, str):
        name, when = raw, {}
    else:
        name = _require(raw, "name", str, where)
        when = {key: parse_arg_spec(spec, f"{where} forbidden {name}.{key}") for key, spec in raw.get("when", {}).items()}
    if name not in offered:
        raise SuiteError(f"{where}: forbidden call {name} is not offered (forbidding it tests nothing)")
    return ForbiddenCall(name=name, when=when)


def parse_arg_spec(raw: dict[str, Any], where: str) -> ArgSpec:
    if not isinstance(raw, dict):
        raise SuiteError(f"{where}: an argument spec is an object, got {raw!r}")
    unknown = set(raw) - ARG_SPEC_KEYS
    if unknown:
        raise SuiteError(f"{where}: unknown keys {sorted(unknown)}")
    if raw.get("as") not in VALUE_FORMATS:
        raise SuiteError(f"{where}: 'as' must be date or datetime")
    fields = None
    if "fields" in raw:
        if set(raw) & LEAF_KEYS:
            raise SuiteError(f"{where}: an object spec ('fields') cannot also be a leaf")
        fields = {key: parse_arg_spec(spec, f"{where}.{key}") for key, spec in raw["fields"].items()}
    elif not set(raw) & {"allowed", "contains_all", "contains_none", "contains_any", "any"}:
        raise SuiteError(f"{where}: say what is accepted (allowed, contains_all, contains_any, any or fields)")
    if raw.get("any") and "example" not in raw:
        raise SuiteError(f"{where}: an 'any' argument needs an example (the oracle agent sends it)")
    allowed = raw.get("allowed")
    if allowed is not None and (not isinstance(allowed, list) or not allowed):
        raise SuiteError(f"{where}: allowed is a non-empty list")
    return ArgSpec(
        allowed=tuple(allowed) if allowed is not None else None,
        contains_all=tuple(raw.get("contains_all", ())),
        contains_none=tuple(raw.get("contains_none", ())),
        contains_any=tuple(raw.get("contains_any", ())),
        any_value=bool(raw.get("any", False)),
        fields=fields,
        may_omit=bool(raw.get("may_omit", False)),
        exact=bool(raw.get("exact", False)),
        unordered=bool(raw.get("unordered", False)),
        tolerance=raw.get("tolerance"),
        value_format=raw.get("as"),
        points=int(raw.get("points", 1)),
        example=raw.get("example"),
    )


def parse_state_check(raw: dict[str, Any], index: int, where: str) -> StateCheck:
    path = _require(raw, "path", list, where)
    kinds = [key for key in ("equals", "contains_all", "absent") if key in raw]
    if not kinds and "contains_none" not in raw:
        raise SuiteError(f"{where}: a state check needs equals, contains_all/contains_none or absent")
    only_if = raw.get("only_if")
    if only_if is not None and not (isinstance(only_if, int) and 0 <= only_if < index):
        raise SuiteError(f"{where}: only_if must name an earlier check by its index")
    return StateCheck(
        path=tuple(str(part) for part in path),
        equals=raw.get("equals"),
        has_equals="equals" in raw,
        contains_all=tuple(raw.get("contains_all", ())),
        contains_none=tuple(raw.get("contains_none", ())),
        absent=bool(raw.get("absent", False)),
        value_format=raw.get("as"),
        points=int(raw.get("points", 1)),
        only_if=only_if,
    )


def to_wire_messages(system: str | None, compact: list[dict[str, Any]], scenario_id: str) -> list[dict[str, Any]]:
    """Compact scenario messages -> OpenAI chat messages, with deterministic tool-call ids.

    Compact assistant calls are ``{"name", "arguments": {...}}``; a following ``tool`` message
    answers the next unanswered call of the latest assistant turn, in order.
    """
    wire: list[dict[str, Any]] = []
    if system:
        wire.append({"role": "system", "content": system})
    pending_ids: list[str] = []
    call_number = 0
    for index, message in enumerate(compact):
        role = message.get("role")
        if role in ("user", "system"):
            wire.append({"role": role, "content": str(message["content"])})
        elif role == "assistant":
            entry: dict[str, Any] = {"role": "assistant", "content": message.get("content")}
            calls = []
            for call in message.get("tool_calls", []):
                call_number += 1
                call_id = f"call_{call_number}"
                calls.append({"id": call_id, "type": "function",
                              "function": {"name": call["name"], "arguments": json.dumps(call.get("arguments", {}))}})
            if calls:
                entry["tool_calls"] = calls
            pending_ids = [call["id"] for call in calls]
            wire.append(entry)
        elif role == "tool":
            if not pending_ids:
                raise SuiteError(f"{scenario_id}: message {index} is a tool result with no call to answer")
            content = message["content"]
            wire.append({"role": "tool", "tool_call_id": pending_ids.pop(0),
                         "content": content if isinstance(content, str) else json.dumps(content)})
        else:
            raise SuiteError(f"{scenario_id}: message {index} has role {role!r}")
    return wire


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as error:
        raise SuiteError("suite file missing", file=str(path)) from error
    except json.JSONDecodeError as error:
        raise SuiteError(f"not valid JSON: {error}", file=str(path)) from error


def _require(doc: dict[str, Any], key: str, kind: type, where: str) -> Any:
    value = doc.get(key) if isinstance(doc, dict) else None
    if not isinstance(value, kind):
        raise SuiteError(f"{where}: '{key}' must be a {kind.__name__}")
    return value


__all__ = [
    "ArgSpec",
    "ContentCheck",
    "ExpectedCall",
    "ForbiddenCall",
    "Scenario",
    "StateCheck",
    "Step",
    "Suite",
    "SuiteError",
    "load_suite",
]
