"""Run the suite against any OpenAI-compatible chat endpoint with tools; transcripts as JSONL.

One run = one file ``<arm>-run<NN>.jsonl``: a ``header`` line (suite version and digest, endpoint,
every request parameter), one ``scenario`` line per scenario written the moment it finishes (the
full conversation, every raw assistant message, every simulated tool result, the score), and a
``footer`` line with the scenario count actually written. Defaults follow the measurement
protocol: temperature 0, concurrency 1, a fixed seed (sampled runs, temperature > 0, take seed,
seed + 1, ... run by run: ``config_for_run``). Request failures (transport, HTTP status,
unparseable body) are recorded in the transcript and counted, never raised; a run that writes
fewer scenarios than the suite holds is marked incomplete and raises ``IncompleteRunError`` after
its footer is written.

Multi-step scenarios: each expected step is one model turn. Tool calls are executed against the
scenario's simulated world and their results fed back; a follow-up user message is appended where
a step has one; a turn without calls ends the conversation unless the next step brings a user
message. Tool-call ids sent back are deterministic (``call_t<turn>_<k>``), so two runs send the same
bytes whenever the model's outputs agree.

How an answer is read: streamed (``stream: true``, the default), the deltas assembled into the
message a non-streamed answer would carry (``read_stream``). Why streaming and not
``chat_template_kwargs``: vLLM's streaming path asks the reasoning parser whether the *rendered
prompt* already closed the reasoning (the template's generation prompt ends ``<think>`` or
``</think>``), so reasoning, content and tool calls are split by what the template actually did.
Its non-streaming path (0.32) never looks at the prompt: the parser's own belief about the
template's default decides, and where the two disagree the whole answer, a well-formed
``<tool_call>`` included, lands in ``reasoning`` (every turn reasoning-only: the floor score).
Sending ``{"enable_thinking": true}`` would align them too, but only for templates and parsers
keyed on that name, and it measures a request that a default client does not send; agent
clients stream. ``stream=False`` keeps the non-streaming path, to compare the two. Whatever the
path, an arm whose turns are mostly cut at ``max_tokens`` or reasoning-only is refused when it
is scored (``quality.answers``).
"""

from __future__ import annotations

import datetime as dt
import json
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fp4forge.endpoint import ERROR_BODY_CHARS, Endpoint, server_root
from fp4forge.quality.answers import AnswerHealth
from fp4forge.errors import ConfigError, EndpointError, EndpointProtocolError, EndpointStatusError, EndpointTimeout, IncompleteRunError, QualityRunError
from fp4forge.quality.suite import Scenario, Suite
from fp4forge.quality.scorer import ModelTurn, ParsedCall, ScenarioScore, score_scenario, turn_from_message
from fp4forge.quality.simulated_tools import SimulatedWorld, replay

if TYPE_CHECKING:
    import httpx

TRANSCRIPT_FORMAT = "fp4forge-quality-transcript/1"
DEFAULT_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class RunConfig:
    base_url: str
    model: str
    arm: str = "A"
    runs: int = 1
    max_tokens: int = 512
    temperature: float = 0.0
    seed: int | None = 0
    concurrency: int = 1
    timeout_s: float = DEFAULT_TIMEOUT_S
    system_prefix: str | None = None  # a request variant: prepended to (or becomes) the system prompt
    chat_template_kwargs: dict[str, Any] | None = None
    extra_body: dict[str, Any] = field(default_factory=dict)
    stream: bool = True  # read answers as a streaming client does (module doc: why)

    def __post_init__(self) -> None:
        for option, value in (("runs", self.runs), ("max_tokens", self.max_tokens), ("concurrency", self.concurrency)):
            if value < 1:
                raise ConfigError(f"{option.replace('_', ' ')} must be >= 1, not {value}", option=option)
        if not (0.0 <= self.temperature <= 2.0):
            raise ConfigError(f"temperature must be in [0, 2], not {self.temperature}", option="temperature")
        if self.chat_template_kwargs is not None and not isinstance(self.chat_template_kwargs, dict):
            raise ConfigError("chat template kwargs must be a JSON object", option="chat_template_kwargs")

    @property
    def root_url(self) -> str:
        return server_root(self.base_url)

    def request_parameters(self) -> dict[str, Any]:
        return {
            "temperature": self.temperature,
            "max_tokens": self.max_tokens,
            "seed": self.seed,
            "tool_choice": "auto",
            "chat_template_kwargs": self.chat_template_kwargs,
            "system_prefix": self.system_prefix,
            "extra_body": self.extra_body,
            "stream": self.stream,
        }


def run_config(**given: Any) -> RunConfig:
    """A quality run's options, from `fp4forge quality run` or the pipeline: the one place either
    makes them (``given``: the fields by name)."""
    return RunConfig(**given)


@dataclass
class Reply:
    message: dict[str, Any] | None
    finish_reason: str | None
    usage: dict[str, Any] | None
    latency_s: float
    error: str | None


Post = Callable[[dict[str, Any]], Reply]


# -- one scenario -------------------------------------------------------------------------------
def request_body(config: RunConfig, scenario: Scenario, messages: list[dict[str, Any]]) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": config.model,
        "messages": messages,
        "tools": scenario.request_tools(),
        "tool_choice": "auto",
        "temperature": config.temperature,
        "max_tokens": config.max_tokens,
    }
    if config.seed is not None:
        body["seed"] = config.seed
    if config.chat_template_kwargs is not None:
        body["chat_template_kwargs"] = config.chat_template_kwargs
    if config.stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}  # the token counts arrive in a last chunk
    body.update(config.extra_body)
    return body


def with_system_prefix(messages: list[dict[str, Any]], prefix: str | None) -> list[dict[str, Any]]:
    if not prefix:
        return messages
    if messages and messages[0]["role"] == "system":
        return [{"role": "system", "content": f"{prefix}\n\n{messages[0]['content']}"}, *messages[1:]]
    return [{"role": "system", "content": prefix}, *messages]


def echo_assistant(turn: ModelTurn, turn_index: int) -> tuple[dict[str, Any], list[str]]:
    """The assistant message sent back, and the ids of its calls (deterministic, see module doc)."""
    message: dict[str, Any] = {"role": "assistant", "content": turn.content}
    ids = [f"call_t{turn_index}_{k}" for k in range(len(turn.calls))]
    if turn.calls:
        message["tool_calls"] = [
            # Unparseable arguments go back as {} so the server can render the history at all.
            {"id": call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments_raw if call.arguments is not None else "{}"}}
            for call_id, call in zip(ids, turn.calls)
        ]
    return message, ids


def run_scenario(scenario: Scenario, config: RunConfig, post: Post) -> dict[str, Any]:
    """Play one scenario; returns its transcript record (with its score)."""
    started = time.monotonic()
    world = SimulatedWorld.for_scenario(scenario)
    messages = with_system_prefix(scenario.initial_messages(), config.system_prefix)
    turns: list[ModelTurn] = []
    records: list[dict[str, Any]] = []
    for index, step in enumerate(scenario.steps):
        if step.user is not None:
            messages.append({"role": "user", "content": step.user})
        elif index > 0 and not turns[-1].calls:
            break  # the model answered in text and nobody spoke since: the conversation is over
        reply = post(request_body(config, scenario, messages))
        turn = turn_from_message(reply.message, reply.finish_reason, reply.error)
        turns.append(turn)
        record: dict[str, Any] = {
            "step": index,
            "user": step.user,
            "request_message_count": len(messages),
            "message": reply.message,
            "finish_reason": reply.finish_reason,
            "usage": reply.usage,
            "latency_s": round(reply.latency_s, 4),
            "error": reply.error,
            "tool_results": [],
        }
        records.append(record)
        if turn.error is not None:
            break
        assistant, ids = echo_assistant(turn, index)
        messages.append(assistant)
        for call_id, call in zip(ids, turn.calls):
            result = world.call(call)
            record["tool_results"].append({"name": call.name, "result": result})
            messages.append({"role": "tool", "tool_call_id": call_id, "content": json.dumps(result)})
    score = score_scenario(scenario, turns, world.state)
    return {
        "type": "scenario",
        "id": scenario.id,
        "category": scenario.category,
        "turns": records,
        "messages": messages,
        "final_state": world.state,
        "score": score.to_dict(),
        "elapsed_s": round(time.monotonic() - started, 3),
    }


# -- the endpoint -------------------------------------------------------------------------------
def make_post(endpoint: Endpoint, config: RunConfig) -> Post:
    def post(body: dict[str, Any]) -> Reply:
        started = time.monotonic()
        try:
            if body.get("stream"):
                with endpoint.stream_lines("chat", body, timeout_s=config.timeout_s) as lines:
                    message, finish_reason, usage, error = read_stream(lines)
                return Reply(message, finish_reason, usage, time.monotonic() - started, error)
            doc = endpoint.chat(body, timeout_s=config.timeout_s)
        except EndpointError as error:
            return Reply(None, None, None, time.monotonic() - started, failure_text(error))
        latency = time.monotonic() - started
        try:
            choice = doc["choices"][0]
            return Reply(choice["message"], choice.get("finish_reason"), doc.get("usage"), latency, None)
        except (KeyError, IndexError, TypeError) as error:
            return Reply(None, None, None, latency, f"protocol: {type(error).__name__}: {json.dumps(doc)[:ERROR_BODY_CHARS]}")

    return post


def read_stream(lines: Iterable[str]) -> tuple[dict[str, Any] | None, str | None, dict[str, Any] | None, str | None]:
    """One streamed chat answer (its server-sent-event lines) as ``(message, finish_reason, usage,
    error)``; the message has the keys of a non-streamed one (content, reasoning, tool_calls, the
    calls' argument fragments joined). A stream without ``[DONE]``, an unparseable line or an error
    event is a failed request (error set, message None)."""
    content: list[str] = []
    reasoning: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    for line in lines:
        if not line.startswith("data:"):
            continue  # blank separators, comments, event names
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            message = {
                "role": "assistant",
                "content": "".join(content) or None,
                "reasoning": "".join(reasoning) or None,
                "tool_calls": [calls[index] for index in sorted(calls)],
            }
            return message, finish_reason, usage, None
        try:
            chunk = json.loads(data)
        except json.JSONDecodeError:
            return None, finish_reason, usage, f"protocol: unparseable stream line: {data[:ERROR_BODY_CHARS]}"
        if not isinstance(chunk, dict):
            return None, finish_reason, usage, f"protocol: stream chunk is not an object: {data[:ERROR_BODY_CHARS]}"
        if chunk.get("error"):
            return None, finish_reason, usage, f"stream error: {json.dumps(chunk['error'])[:ERROR_BODY_CHARS]}"
        usage = chunk.get("usage") or usage
        for choice in chunk.get("choices") or []:
            if choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            content.append(delta.get("content") or "")
            reasoning.append(delta.get("reasoning") or delta.get("reasoning_content") or "")
            for part in delta.get("tool_calls") or []:
                call = calls.setdefault(part.get("index", len(calls)),
                                        {"id": None, "type": "function", "function": {"name": "", "arguments": ""}})
                call["id"] = part.get("id") or call["id"]
                function = part.get("function") or {}
                call["function"]["name"] += function.get("name") or ""
                call["function"]["arguments"] += function.get("arguments") or ""
            finish_reason = choice.get("finish_reason") or finish_reason
    return None, finish_reason, usage, "protocol: the stream ended without [DONE]"


def failure_text(error: EndpointError) -> str:
    """How a failed request is recorded in a transcript (``http 500: …``, ``timeout: …``, …)."""
    cause = error.cause
    if isinstance(error, EndpointStatusError):
        return f"http {error.status}: {(error.body or '')[:ERROR_BODY_CHARS]}"
    if isinstance(error, EndpointProtocolError):
        return f"protocol: {type(cause).__name__}: {(error.body or '')[:ERROR_BODY_CHARS]}"
    if isinstance(error, EndpointTimeout):
        return f"timeout: {cause}"
    return f"transport: {type(cause).__name__}: {cause}"


def describe_endpoint(endpoint: Endpoint, config: RunConfig) -> dict[str, Any]:
    """Check that the model is served; record what the server says about itself."""
    try:
        models = endpoint.models()
    except EndpointError as error:
        raise QualityRunError(f"no OpenAI-compatible server at {config.root_url}: {error.message}") from error
    entry = next((m for m in models if m.get("id") == config.model), None)
    if entry is None:
        served = ", ".join(str(m.get("id")) for m in models)
        raise QualityRunError(f"model {config.model!r} is not served at {config.root_url} (serves: {served or 'nothing'})")
    version = endpoint.version()  # None where the server has no /version
    return {"base_url": config.root_url, "model": config.model, "server_version": version, "max_model_len": entry.get("max_model_len")}


# -- whole runs ---------------------------------------------------------------------------------
def transcript_path(out_dir: Path, arm: str, run: int) -> Path:
    return Path(out_dir) / f"{arm}-run{run:02d}.jsonl"


def run_suite(
    config: RunConfig,
    suite: Suite,
    out_dir: Path,
    *,
    scenarios: list[Scenario] | None = None,
    client: httpx.Client | None = None,
    on_scenario: Callable[[int, dict[str, Any]], None] | None = None,
) -> list[Path]:
    """``config.runs`` runs of the (selected) suite; returns the transcript paths, one per run."""
    chosen = list(scenarios) if scenarios is not None else list(suite.scenarios)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with Endpoint(config.base_url, config.model, timeout_s=config.timeout_s, http=client) as endpoint:
        described = describe_endpoint(endpoint, config)
        post = make_post(endpoint, config)
        paths = []
        for run in range(1, config.runs + 1):
            path = transcript_path(out_dir, config.arm, run)
            paths.append(path)
            _run_once(config_for_run(config, run), suite, chosen, described, post, run, path, on_scenario)
        return paths


def config_for_run(config: RunConfig, run: int) -> RunConfig:
    """The request parameters of run ``run`` (1-based). Sampled runs (temperature > 0) get seed
    ``seed + run - 1``: with one seed for every run, a server that honours per-request seeds would
    replay the same samples, and the A/A noise floor would read zero for a model that is not stable
    at all. Greedy runs keep the one seed (it does not change a greedy answer)."""
    if config.temperature > 0 and config.seed is not None:
        return replace(config, seed=config.seed + run - 1)
    return config


def _run_once(
    config: RunConfig,
    suite: Suite,
    scenarios: list[Scenario],
    endpoint: dict[str, Any],
    post: Post,
    run: int,
    path: Path,
    on_scenario: Callable[[int, dict[str, Any]], None] | None,
) -> None:
    started = time.monotonic()
    header = {
        "type": "header",
        "format": TRANSCRIPT_FORMAT,
        "suite": {"name": suite.name, "version": suite.version, "digest": suite.digest, "scenario_count": len(suite.scenarios)},
        "partial": len(scenarios) != len(suite.scenarios),
        "expected_count": len(scenarios),
        "scenario_ids": [s.id for s in scenarios],
        "arm": config.arm,
        "run": run,
        "runs": config.runs,
        "endpoint": endpoint,
        "request": config.request_parameters(),
        "concurrency": config.concurrency,
        "started_at": _now(),
    }
    lock = threading.Lock()
    written: list[dict[str, Any]] = []
    with path.open("w", encoding="utf-8") as sink:
        _write_line(sink, header)

        def play(scenario: Scenario) -> None:
            try:
                record = run_scenario(scenario, config, post)
            except Exception as error:  # a bug in scoring or simulation must not lose the run
                record = {"type": "scenario", "id": scenario.id, "category": scenario.category, "turns": [], "messages": [],
                          "final_state": {}, "score": None, "harness_error": f"{type(error).__name__}: {error}"}
            record["run"], record["arm"] = run, config.arm
            with lock:
                _write_line(sink, record)
                written.append(record)
                if on_scenario is not None:
                    on_scenario(run, record)

        if config.concurrency <= 1:
            for scenario in scenarios:
                play(scenario)
        else:
            with ThreadPoolExecutor(max_workers=config.concurrency) as pool:
                list(pool.map(play, scenarios))
        footer = run_footer(written, len(scenarios), time.monotonic() - started)
        _write_line(sink, footer)
    if not footer["complete"]:
        raise IncompleteRunError(f"run {run} wrote {footer['scenario_count']} of {footer['expected_count']} scenarios", file=str(path))


def run_footer(records: list[dict[str, Any]], expected: int, elapsed_s: float) -> dict[str, Any]:
    scores = [r["score"] for r in records if r.get("score")]
    failed_turns = sum(1 for r in records for t in r["turns"] if t.get("error"))
    unique_ids = {r["id"] for r in records}
    return {
        "type": "footer",
        "scenario_count": len(unique_ids),
        "expected_count": expected,
        "complete": len(unique_ids) == expected == len(records),
        "failed_requests": failed_turns,
        "scenarios_with_failures": sum(1 for r in records if any(t.get("error") for t in r["turns"])),
        "harness_errors": sum(1 for r in records if r.get("harness_error")),
        "earned": sum(s["earned"] for s in scores),
        "max": sum(s["max"] for s in scores),
        "elapsed_s": round(elapsed_s, 3),
        "finished_at": _now(),
    }


def _write_line(sink: Any, doc: dict[str, Any]) -> None:
    sink.write(json.dumps(doc, ensure_ascii=False) + "\n")
    sink.flush()  # a transcript is readable up to the last finished scenario, even after a crash


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


# -- reading and re-scoring ---------------------------------------------------------------------
@dataclass
class RunResult:
    """One transcript, re-scored offline against the current suite."""

    path: str
    arm: str
    run: int
    header: dict[str, Any]
    scores: dict[str, ScenarioScore]
    complete: bool
    warnings: list[str] = field(default_factory=list)
    failed_requests: int = 0
    answers: AnswerHealth = field(default_factory=AnswerHealth)

    @property
    def earned(self) -> int:
        return sum(s.earned for s in self.scores.values())

    @property
    def max(self) -> int:
        return sum(s.max for s in self.scores.values())

    def summary(self) -> dict[str, Any]:
        return {"path": self.path, "arm": self.arm, "run": self.run, "complete": self.complete, "earned": self.earned,
                "max": self.max, "scenarios": len(self.scores), "failed_requests": self.failed_requests, "warnings": self.warnings,
                "answers": self.answers.to_dict()}


def read_transcript(path: Path) -> tuple[dict[str, Any], list[dict[str, Any]], dict[str, Any] | None]:
    header, records, footer = None, [], None
    with Path(path).open(encoding="utf-8") as source:
        for number, line in enumerate(source, 1):
            if not line.strip():
                continue
            try:
                doc = json.loads(line)
            except json.JSONDecodeError as error:
                raise QualityRunError(f"line {number} is not JSON ({error.msg}); a run cut mid-line?", file=str(path)) from error
            kind = doc.get("type")
            if kind == "header":
                header = doc
            elif kind == "scenario":
                records.append(doc)
            elif kind == "footer":
                footer = doc
    if header is None or header.get("format") != TRANSCRIPT_FORMAT:
        raise QualityRunError(f"not a {TRANSCRIPT_FORMAT} transcript (no header)", file=str(path))
    return header, records, footer


def turns_of(record: dict[str, Any]) -> list[ModelTurn]:
    return [turn_from_message(t.get("message"), t.get("finish_reason"), t.get("error")) for t in record.get("turns", [])]


def rescore_record(scenario: Scenario, record: dict[str, Any]) -> tuple[ScenarioScore, bool]:
    """Score a saved record; the world is rebuilt by replaying its calls. Returns (score, replay matched)."""
    turns = turns_of(record)
    calls: list[list[ParsedCall]] = [turn.calls if turn.error is None else [] for turn in turns]
    state, results = replay(scenario, calls)
    recorded = [[r["result"] for r in t.get("tool_results", [])] for t in record.get("turns", [])]
    return score_scenario(scenario, turns, state), recorded == results


def rescore_transcript(path: Path, suite: Suite) -> RunResult:
    header, records, footer = read_transcript(path)
    warnings = []
    if header["suite"]["digest"] != suite.digest:
        warnings.append(f"recorded with suite {header['suite']['version']} ({header['suite']['digest'][:12]}), "
                        f"re-scored with {suite.version} ({suite.digest[:12]})")
    by_id = suite.by_id()
    scores: dict[str, ScenarioScore] = {}
    for record in records:
        scenario = by_id.get(record["id"])
        if scenario is None:
            warnings.append(f"scenario {record['id']} is no longer in the suite")
            continue
        if record.get("harness_error"):
            warnings.append(f"{record['id']}: harness error during the run: {record['harness_error']}")
        score, replay_matched = rescore_record(scenario, record)
        if not replay_matched:
            warnings.append(f"{record['id']}: replaying the calls gave different tool results than recorded")
        scores[record["id"]] = score
    expected = header.get("expected_count", len(suite.scenarios))
    complete = footer is not None and bool(footer.get("complete")) and len(scores) == expected
    if not complete:
        warnings.append(f"incomplete run: {len(scores)} of {expected} scenarios scored" + ("" if footer else ", no footer"))
    failed = sum(1 for r in records for t in r.get("turns", []) if t.get("error"))
    answers = AnswerHealth.of_turns(turn for record in records for turn in turns_of(record))
    return RunResult(str(path), str(header.get("arm")), int(header.get("run", 0)), header, scores, complete, warnings, failed,
                     answers)


def expand_transcripts(paths: Iterable[Path]) -> list[Path]:
    """Files as given; a directory stands for its ``*.jsonl`` transcripts, sorted."""
    expanded: list[Path] = []
    for path in map(Path, paths):
        expanded.extend(sorted(path.glob("*.jsonl")) if path.is_dir() else [path])
    return expanded

