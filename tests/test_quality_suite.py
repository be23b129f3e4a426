"""The suite as data, the simulated tools, and the whole pipeline against a fake endpoint.

The fake endpoint (``httpx.MockTransport``) plays an *oracle agent* that answers every step with
what the scenario expects, so every scenario is proven solvable to its maximum and the simulated
tools, state checks, runner, transcripts, re-scoring, CLI and compare report are exercised without
a model. Degraded and flaky variants of the agent make two arms with a known difference and a
known noise floor.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest
import typer
from typer.testing import CliRunner

from fp4forge.errors import ConfigError
from fp4forge.cli.quality import register
from fp4forge.quality.suite import Scenario, Suite, load_suite
from fp4forge.quality.report import ReportError, compare_document
from fp4forge.quality.runner import RunConfig, read_transcript, rescore_transcript, run_suite
from fp4forge.quality.scorer import ParsedCall, example_value, lint_scenario
from fp4forge.quality.simulated_tools import SimulatedWorld, replay

REQUIRED_CATEGORIES = {
    "tool_selection", "argument_construction", "optional_arguments", "parallel_calls", "multi_step_planning",
    "tool_result_use", "restraint", "ask_missing_info", "unsafe_refusal", "error_recovery", "long_catalogue",
    "multi_turn_followup",
}


@pytest.fixture(scope="module")
def suite() -> Suite:
    return load_suite()


# -- the suite as data --------------------------------------------------------------------------
def test_suite_size_and_categories(suite: Suite) -> None:
    assert len(suite.scenarios) >= 69
    assert len(suite.categories) >= 15
    assert REQUIRED_CATEGORIES <= set(suite.categories)
    per_category = Counter(s.category for s in suite.scenarios)
    assert min(per_category.values()) >= 4, per_category
    assert all(s.max_points > 0 for s in suite.scenarios)
    assert len({s.id for s in suite.scenarios}) == len(suite.scenarios)


def test_every_scenario_validates(suite: Suite) -> None:
    problems = {s.id: lint_scenario(s) for s in suite.scenarios}
    assert {k: v for k, v in problems.items() if v} == {}


def test_multi_step_scenarios_have_simulated_tools(suite: Suite) -> None:
    """Every tool a multi-step scenario expects mid-conversation answers with data, not 'not available'."""
    for scenario in suite.scenarios:
        for step in scenario.steps[:-1]:
            for expected in step.calls:
                world = SimulatedWorld.for_scenario(scenario)
                arguments = {k: example_value(spec) for k, spec in expected.arguments.items() if not spec.may_omit}
                result = world.call(ParsedCall(expected.name, json.dumps(arguments), arguments))
                assert "not available" not in str(result.get("error", "")), (scenario.id, expected.name, result)


def test_an_agent_that_does_nothing_earns_no_state_points(suite: Suite) -> None:
    """State checks reward outcomes; "nothing else was damaged" checks are only_if the main one passed."""
    from fp4forge.quality.runner import Reply, run_scenario

    idle = lambda body: Reply({"role": "assistant", "content": "Okay."}, "stop", None, 0.0, None)  # noqa: E731
    for scenario in suite.scenarios:
        if scenario.state_checks:
            score = run_scenario(scenario, RunConfig(base_url="http://unused", model="m"), idle)["score"]
            assert score["state_earned"] == 0, scenario.id


def test_manifest_count_is_enforced(tmp_path: Path, suite: Suite) -> None:
    from fp4forge.quality.suite import SCENARIO_DIR, SuiteError

    for path in SCENARIO_DIR.glob("*.json"):
        (tmp_path / path.name).write_bytes(path.read_bytes())
    (tmp_path / "16_instruction_following.json").unlink()
    with pytest.raises(SuiteError, match="declares 72 scenarios"):
        load_suite(tmp_path)


# -- simulated tools ----------------------------------------------------------------------------
def parsed(name: str, **arguments: Any) -> ParsedCall:
    return ParsedCall(name, json.dumps(arguments), arguments)


def test_simulated_world_is_stateful_and_deterministic(suite: Suite) -> None:
    scenario = suite.by_id()["mt-correct-event-time"]
    calls = [
        [parsed("create_calendar_event", title="Dentist", start="2026-03-13T10:00", duration_minutes=30)],
        [parsed("delete_calendar_event", event_id="evt-1"),
         parsed("create_calendar_event", title="Dentist", start="2026-03-13T11:00", duration_minutes=30)],
    ]
    state, results = replay(scenario, calls)
    assert results[0][0] == {"event_id": "evt-1", "created": True}
    assert results[1][1]["event_id"] == "evt-2"  # ids never repeat, even after a deletion
    assert list(state["events"]) == ["evt-2"]
    assert replay(scenario, calls) == (state, results)


def test_simulated_tools_validate_arguments_like_an_api(suite: Suite) -> None:
    world = SimulatedWorld.for_scenario(suite.by_id()["plan-conditional-transfer"])
    assert world.call(parsed("get_account_balance"))["error"] == "missing required argument 'account_id'"
    assert "invalid value for 'amount'" in world.call(parsed("transfer_funds", from_account="ACC-SAV-01", to_account="ACC-CHK-01", amount="300", currency="EUR"))["error"]
    assert world.call(parsed("send_email", to=["x"]))["error"] == "unknown tool 'send_email'"  # not offered here
    assert "balance is 1450.0" in world.call(parsed("transfer_funds", from_account="ACC-SAV-01", to_account="ACC-CHK-01", amount=5000, currency="EUR"))["error"]
    assert world.state["accounts"]["ACC-SAV-01"]["balance"] == 1450.0  # a failed transfer changes nothing
    malformed = ParsedCall("get_account_balance", "{oops", None, "not JSON")
    assert "JSON object" in world.call(malformed)["error"]


def test_transient_fixture_fires_once_then_the_handler_answers(suite: Suite) -> None:
    world = SimulatedWorld.for_scenario(suite.by_id()["err-retry-transient"])
    first = world.call(parsed("get_account_balance", account_id="ACC-CHK-01"))
    second = world.call(parsed("get_account_balance", account_id="ACC-CHK-01"))
    assert "503" in first["error"] and second["balance"] == 2310.55


# -- a fake OpenAI-compatible endpoint ----------------------------------------------------------
class FakeAgent:
    """Answers like the scenario expects, except: ``degrade`` ids always badly, ``flaky`` ids badly
    from their second run on, ``fail`` ids with HTTP 500, ``garbage`` ids with a non-JSON body."""

    def __init__(self, suite: Suite, *, degrade: set[str] = frozenset(), flaky: set[str] = frozenset(),
                 fail: set[str] = frozenset(), garbage: set[str] = frozenset()) -> None:
        self.scenarios = list(suite.scenarios)
        self.degrade, self.flaky, self.fail, self.garbage = set(degrade), set(flaky), set(fail), set(garbage)
        self.visits: Counter[str] = Counter()
        self.requests = 0
        self.seeds: list[tuple[Any, Any]] = []  # (temperature, seed) of every chat request, in order

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)

    def handle(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "fake", "max_model_len": 4096}]})
        if request.url.path == "/version":
            return httpx.Response(200, json={"version": "fake-1"})
        body = json.loads(request.content)
        self.requests += 1
        self.seeds.append((body.get("temperature"), body.get("seed")))
        scenario = self.scenario_of(body["messages"])
        opening = sum(1 for m in scenario.messages if m["role"] == "assistant")
        step_index = sum(1 for m in body["messages"] if m["role"] == "assistant") - opening
        if step_index == 0:
            self.visits[scenario.id] += 1
        if scenario.id in self.fail:
            return httpx.Response(500, text="internal error")
        if scenario.id in self.garbage:
            return httpx.Response(200, text="<html>not json</html>")
        bad = scenario.id in self.degrade or (scenario.id in self.flaky and self.visits[scenario.id] > 1)
        message = self.bad_message(scenario, step_index) if bad else self.good_message(scenario, step_index)
        usage = {"prompt_tokens": 1, "completion_tokens": 1}
        if body.get("stream"):
            return httpx.Response(200, text=sse_body(message, "stop", usage), headers={"content-type": "text/event-stream"})
        return httpx.Response(200, json={"choices": [{"message": message, "finish_reason": "stop"}], "usage": usage})

    def scenario_of(self, messages: list[dict[str, Any]]) -> Scenario:
        candidates = [s for s in self.scenarios if messages[: len(s.messages)] == list(s.messages)]
        return max(candidates, key=lambda s: len(s.messages))

    @staticmethod
    def good_message(scenario: Scenario, step_index: int) -> dict[str, Any]:
        step = scenario.steps[step_index]
        if step.expect == "call":
            calls = [{"id": f"c{k}", "type": "function", "function": {"name": c.name, "arguments": json.dumps(
                {key: example_value(spec) for key, spec in c.arguments.items() if not spec.may_omit})}} for k, c in enumerate(step.calls)]
            return {"role": "assistant", "content": None, "tool_calls": calls}
        text = "Sorry, I cannot do that." if step.content and step.content.refusal else "Here you go."
        if step.content and step.content.any_of:
            text += f" {step.content.any_of[0]}"
        return {"role": "assistant", "content": text, "reasoning": "thinking is never scored"}

    @staticmethod
    def bad_message(scenario: Scenario, step_index: int) -> dict[str, Any]:
        step = scenario.steps[step_index]
        if step.expect == "call":
            return {"role": "assistant", "content": "I am not sure.</think>"}
        tool = scenario.tool_names[0]
        forbidden = step.forbidden[0].name if step.forbidden else tool
        return {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c0", "type": "function", "function": {"name": forbidden, "arguments": "{\"broken\": "}}]}


def sse_body(message: dict[str, Any], finish_reason: str, usage: dict[str, Any]) -> str:
    """``message`` as vLLM streams it: a role delta, reasoning and content in pieces, each tool call
    as its id and name then its arguments in fragments, the finish reason, a usage chunk, [DONE]."""
    def piece(text: str) -> list[str]:
        return [text[i:i + 5] for i in range(0, len(text), 5)]

    deltas: list[dict[str, Any]] = [{"role": "assistant", "content": ""}]
    deltas += [{"reasoning": part} for part in piece(message.get("reasoning") or "")]
    deltas += [{"content": part} for part in piece(message.get("content") or "")]
    for index, call in enumerate(message.get("tool_calls") or []):
        deltas.append({"tool_calls": [{"index": index, "id": call["id"], "type": "function",
                                       "function": {"name": call["function"]["name"], "arguments": ""}}]})
        deltas += [{"tool_calls": [{"index": index, "function": {"arguments": part}}]} for part in piece(call["function"]["arguments"])]
    chunks = [{"choices": [{"index": 0, "delta": delta, "finish_reason": None}]} for delta in deltas]
    chunks[-1]["choices"][0]["finish_reason"] = finish_reason
    chunks.append({"choices": [], "usage": usage})
    return "".join(f"data: {json.dumps(chunk)}\n\n" for chunk in chunks) + "data: [DONE]\n\n"


def run_arm(suite: Suite, agent: FakeAgent, out: Path, arm: str, runs: int, **config: Any) -> list[Path]:
    with httpx.Client(transport=agent.transport()) as client:
        return run_suite(RunConfig(base_url="http://fake/v1", model="fake", arm=arm, runs=runs, **config), suite, out, client=client)


# -- pipeline -----------------------------------------------------------------------------------
def test_oracle_agent_earns_every_point_and_transcripts_rescore_identically(suite: Suite, tmp_path: Path) -> None:
    agent = FakeAgent(suite)
    [path] = run_arm(suite, agent, tmp_path, "oracle", 1)
    header, records, footer = read_transcript(path)
    assert header["suite"]["scenario_count"] == len(suite.scenarios) == header["expected_count"]
    assert header["request"]["temperature"] == 0.0 and header["concurrency"] == 1
    assert header["endpoint"] == {"base_url": "http://fake", "model": "fake", "server_version": "fake-1", "max_model_len": 4096}
    assert footer["complete"] and footer["scenario_count"] == len(records) == len(suite.scenarios)
    assert footer["failed_requests"] == 0 and footer["earned"] == footer["max"] == sum(s.max_points for s in suite.scenarios)
    not_full = [r["id"] for r in records if r["score"]["earned"] != r["score"]["max"]]
    assert not_full == []
    assert agent.requests == sum(len(s.steps) for s in suite.scenarios)
    result = rescore_transcript(path, suite)
    assert result.complete and result.warnings == []
    assert {sid: s.to_dict() for sid, s in result.scores.items()} == {r["id"]: r["score"] for r in records}
    # Multi-step scenarios really fed tool results back.
    transfer = next(r for r in records if r["id"] == "plan-conditional-transfer")
    assert transfer["turns"][0]["tool_results"][0]["result"]["balance"] == 1450.0
    assert transfer["final_state"]["accounts"]["ACC-CHK-01"]["balance"] == 520.0
    assert [m["role"] for m in transfer["messages"]] == ["user", "assistant", "tool", "assistant", "tool", "assistant"]


def test_sampled_runs_each_send_their_own_seed_greedy_runs_one(suite: Suite, tmp_path: Path) -> None:
    # With one seed for every sampled run, a server honouring per-request seeds replays the same
    # samples and the A/A floor reads zero: each sampled run must send its own seed.
    only = list(suite.scenarios[:3])
    per_run = sum(len(s.steps) for s in only)
    sampled = FakeAgent(suite)
    with httpx.Client(transport=sampled.transport()) as client:
        paths = run_suite(RunConfig(base_url="http://fake/v1", model="fake", runs=3, temperature=0.7, seed=10), suite, tmp_path / "t07",
                          scenarios=only, client=client)
    assert [sorted(set(sampled.seeds[k * per_run:(k + 1) * per_run])) for k in range(3)] == [[(0.7, 10)], [(0.7, 11)], [(0.7, 12)]]
    assert [read_transcript(p)[0]["request"]["seed"] for p in paths] == [10, 11, 12]
    greedy = FakeAgent(suite)
    with httpx.Client(transport=greedy.transport()) as client:
        run_suite(RunConfig(base_url="http://fake/v1", model="fake", runs=2, seed=10), suite, tmp_path / "t0", scenarios=only, client=client)
    assert set(greedy.seeds) == {(0.0, 10)} and len(greedy.seeds) == 2 * per_run
    with pytest.raises(ConfigError, match="temperature"):
        RunConfig(base_url="http://fake/v1", model="fake", temperature=-0.1)


def test_concurrency_does_not_change_scores(suite: Suite, tmp_path: Path) -> None:
    flaky = {s.id for s in suite.scenarios[::9]}
    sequential = rescore_transcript(run_arm(suite, FakeAgent(suite, degrade=flaky), tmp_path / "c1", "A", 1)[0], suite)
    parallel = rescore_transcript(run_arm(suite, FakeAgent(suite, degrade=flaky), tmp_path / "c3", "A", 1, concurrency=3)[0], suite)
    assert {k: v.earned for k, v in sequential.scores.items()} == {k: v.earned for k, v in parallel.scores.items()}
    assert parallel.complete


def test_failures_are_recorded_not_raised(suite: Suite, tmp_path: Path) -> None:
    fail, garbage = {"sel-stock-quote", "plan-book-cheapest-flight"}, {"rest-closing-thanks"}
    [path] = run_arm(suite, FakeAgent(suite, fail=fail, garbage=garbage), tmp_path, "A", 1)
    _, records, footer = read_transcript(path)
    assert footer["complete"] and footer["failed_requests"] == 3 and footer["scenarios_with_failures"] == 3
    by_id = {r["id"]: r for r in records}
    assert by_id["sel-stock-quote"]["turns"][0]["error"].startswith("http 500")
    assert by_id["rest-closing-thanks"]["turns"][0]["error"].startswith("protocol")
    assert len(by_id["plan-book-cheapest-flight"]["turns"]) == 1  # the conversation stops at the failure
    result = rescore_transcript(path, suite)
    assert result.failed_requests == 3
    assert {sid for sid, s in result.scores.items() if s.request_failed} == fail | garbage


def test_unreachable_server_is_an_error_before_any_transcript(suite: Suite, tmp_path: Path) -> None:
    from fp4forge.quality.runner import QualityRunError

    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    with httpx.Client(transport=httpx.MockTransport(refuse)) as client, pytest.raises(QualityRunError, match="no OpenAI-compatible server"):
        run_suite(RunConfig(base_url="http://nowhere", model="fake"), suite, tmp_path, client=client)
    assert list(tmp_path.iterdir()) == []


# -- CLI ----------------------------------------------------------------------------------------
def cli() -> typer.Typer:
    app = typer.Typer()
    register(app)
    return app


def invoke(*args: str) -> Any:
    return CliRunner().invoke(cli(), ["quality", *args], catch_exceptions=False)


def test_cli_list_json(suite: Suite) -> None:
    result = invoke("list", "--json")
    assert result.exit_code == 0, result.output
    listing = json.loads(result.output)
    assert len(listing) == len(suite.scenarios)
    assert all({"id", "category", "max_points"} <= set(item) for item in listing)
    assert sum(item["max_points"] for item in listing) == sum(s.max_points for s in suite.scenarios)
    assert invoke("list", "--category", "nope").exit_code == 2


@pytest.fixture(scope="module")
def two_arms(suite: Suite, tmp_path_factory: pytest.TempPathFactory) -> tuple[list[Path], list[Path]]:
    """Arm A: oracle with 2 flaky scenarios (its noise floor); arm B: 14 scenarios always degraded."""
    out = tmp_path_factory.mktemp("arms")
    ids = [s.id for s in suite.scenarios]
    runs_a = run_arm(suite, FakeAgent(suite, flaky={ids[3], ids[40]}), out / "a", "A", 2)
    runs_b = run_arm(suite, FakeAgent(suite, degrade=set(ids[5::5])), out / "b", "B", 2)
    return runs_a, runs_b


def test_cli_score_rescores_offline(two_arms: tuple[list[Path], list[Path]]) -> None:
    runs_a, _ = two_arms
    result = invoke("score", str(runs_a[0].parent), "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert [r["run"] for r in doc["runs"]] == [1, 2]
    floor = doc["noise_floor"]["A"]
    assert len(floor["flipping_scenarios"]) == 2 and floor["spread_points"] > 0
    assert doc["runs"][0]["flags"]["reasoning_field"] > 0 and doc["runs"][0]["flags"]["stray_think_tag"] == 0
    assert doc["runs"][1]["flags"]["stray_think_tag"] >= 1  # the flaky call step answers with a stray </think>


def test_cli_compare_orders_a_clear_gap_with_dash_dash(two_arms: tuple[list[Path], list[Path]], tmp_path: Path) -> None:
    runs_a, runs_b = two_arms
    out = tmp_path / "report"
    result = invoke("compare", *map(str, runs_a), "--out", str(out), "--", *map(str, runs_b), "--bootstrap", "2000", "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert doc["runs"] == {"A": 2, "B": 2}
    assert doc["arms"]["A"]["label"] == "A" and doc["arms"]["B"]["label"] == "B"
    assert doc["sign_test"]["favours_a"] >= 14 and doc["verdict"]["ordering"] == "A>B", doc["verdict"]
    assert doc["noise_floor"]["A"]["band_points"] > 0 and doc["noise_floor"]["B"]["measured"]
    assert {"compare.json", "compare.md", "category_scores.png"} <= {p.name for p in out.iterdir()}
    markdown = (out / "compare.md").read_text()
    assert "Verdict: A scores higher than B" in markdown and "| category |" in markdown and "Flip list" in markdown
    band = doc["power"]["floor"]["applied_band"]
    assert markdown.count(band["why"]) == 1 and f"A/A band: {band['why']}." in markdown  # said once, in the power lines


def test_compare_refuses_runs_of_one_arm_grouped_with_the_other(suite: Suite, two_arms: tuple[list[Path], list[Path]]) -> None:
    runs_a, runs_b = two_arms
    # `--b` takes one path: the second run of arm B lands among arm A's positionals
    misgrouped = invoke("compare", *map(str, runs_a), "--b", str(runs_b[0]), str(runs_b[1]), "--json")
    assert misgrouped.exit_code == 2 and "grouped with the other" in misgrouped.output, misgrouped.output
    with pytest.raises(ReportError, match="arm A holds runs labelled 'A', 'B' and arm B runs labelled 'B'"):
        compare_document([rescore_transcript(p, suite) for p in [*runs_a, runs_b[1]]], [rescore_transcript(runs_b[0], suite)], suite)
    repeated = invoke("compare", *map(str, runs_a), "--b", str(runs_b[0]), "--b", str(runs_b[1]), "--bootstrap", "2000", "--json")
    assert repeated.exit_code == 0 and json.loads(repeated.output)["runs"] == {"A": 2, "B": 2}
    # one label on both sides and no other (both arms left at the default label) is not refused
    same = compare_document([rescore_transcript(p, suite) for p in runs_a], [rescore_transcript(runs_a[0], suite)], suite, n_boot=200)
    assert same["runs"] == {"A": 2, "B": 1}


def test_compare_within_the_noise_floor_refuses_to_order(suite: Suite, two_arms: tuple[list[Path], list[Path]], tmp_path: Path) -> None:
    runs_a, _ = two_arms
    ids = [s.id for s in suite.scenarios]
    near = run_arm(suite, FakeAgent(suite, flaky={ids[3]}, degrade={ids[10]}), tmp_path, "A2", 2)
    doc = compare_document([rescore_transcript(p, suite) for p in runs_a], [rescore_transcript(p, suite) for p in near], suite, n_boot=2000)
    assert doc["verdict"]["ordering"] == "none"
    assert doc["verdict"]["text"].startswith("cannot order the arms")


def test_compare_refuses_incomplete_runs(suite: Suite, two_arms: tuple[list[Path], list[Path]], tmp_path: Path) -> None:
    runs_a, runs_b = two_arms
    cut = tmp_path / "A-run01.jsonl"
    lines = runs_a[0].read_text().splitlines()
    cut.write_text("\n".join(lines[:30]) + "\n")  # header + 29 scenarios, no footer: a crashed run
    result = rescore_transcript(cut, suite)
    assert not result.complete and any("incomplete run" in w for w in result.warnings)
    with pytest.raises(ReportError, match="incomplete"):
        compare_document([result], [rescore_transcript(runs_b[0], suite)], suite)
    cli_result = invoke("compare", str(cut), "--", str(runs_b[0]))
    assert cli_result.exit_code == 2
    assert invoke("compare", str(runs_a[0])).exit_code == 2  # no arm B
