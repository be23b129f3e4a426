"""Load generation, part 2: run cells (shape x load point) and write every request as it finishes.

Three modes, one cell per (load point, shape):

* ``sequential``: one request in flight at a time (concurrency 1, the protocol of the
  published Laguna card, docs/laguna-card.md#decode-and-ttft);
* ``concurrency``: a closed loop holding N requests in flight, for each N of a sweep;
* ``rate``: an open loop with Poisson arrivals at each mean rate of a sweep (seeded gaps), so a
  slow server builds a queue instead of slowing the client down.

Each load point first sends every shape's warmups (distinct prompts, discarded from statistics but
recorded with ``"warmup": true``), then its kept samples in ``repeats`` rounds: each round visits
every shape once, in a fresh seeded random order (``order_seed``), and sends its share of the
samples, so that context length and time are not confounded (``schedule``; docs/bench.md#order).
``/metrics`` is scraped before and after every block of one shape in one round. Every
finished request is one line of ``DIR/samples.jsonl``, flushed at once, so a crash or Ctrl-C loses
nothing that finished. A refused or broken connection is followed by a health check; when the
server no longer answers, the run stops with ``BenchAborted`` (exit 3) and keeps what it has.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
import tomllib
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Literal, TextIO

import numpy as np

from fp4forge.bench.client import (
    TRANSPORT_ERRORS,
    RequestResult,
    RequestSpec,
    StreamingClient,
    probe_stream_options,
)
from fp4forge.bench.host import host_facts, load_average, log_size, server_warnings
from fp4forge.bench.prompts import HfTokenizer, Prompt, PromptFactory, PromptTokenizer, ServerTokenizer
from fp4forge.checkpoint.atomic import write_text_atomic
from fp4forge.endpoint import METRICS_PATH, Endpoint, server_root
from fp4forge.errors import BenchAborted, ConfigError, EndpointError, EndpointStatusError, Fp4forgeError

SAMPLES_FILE = "samples.jsonl"
SERVER_METRICS_FILE = "server_metrics.jsonl"
RUN_FILE = "run.json"
SAMPLE_SCHEMA = "fp4forge.bench.sample/1"
HEALTH_TIMEOUT_S = 5.0
PROBE_PROMPT_TOKENS = 8
PROBE_OUTPUT_TOKENS = 2

Mode = Literal["sequential", "concurrency", "rate"]
OutputControl = Literal["ignore_eos", "min_tokens", "none"]


# -- workloads (shapes as data) -----------------------------------------------------------------
@dataclass(frozen=True)
class Shape:
    prompt_tokens: int
    output_tokens: int

    @property
    def name(self) -> str:
        return f"p{self.prompt_tokens}-o{self.output_tokens}"


@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    shapes: tuple[Shape, ...]
    warmups: int
    samples: int
    concurrency: tuple[int, ...]
    rates_rps: tuple[float, ...]


def load_workloads(path: Path | None = None) -> dict[str, Workload]:
    """Workloads from ``path``, or the packaged ``workloads.toml``."""
    if path is None:
        text = resources.files("fp4forge.bench").joinpath("workloads.toml").read_text(encoding="utf-8")
    else:
        text = Path(path).read_text(encoding="utf-8")
    try:
        tables = tomllib.loads(text).get("workload", {})
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"workloads file {path or 'workloads.toml'} is not valid TOML: {error}") from error
    return {name: _workload(name, table) for name, table in tables.items()}


def _workload(name: str, table: dict[str, Any]) -> Workload:
    try:
        output = int(table["output_tokens"])
        return Workload(
            name=name,
            description=str(table.get("description", "")),
            shapes=tuple(Shape(int(p), output) for p in table["prompt_tokens"]),
            warmups=int(table.get("warmups", 2)),
            samples=int(table.get("samples", 7)),
            concurrency=tuple(int(c) for c in table.get("concurrency", [1])),
            rates_rps=tuple(float(r) for r in table.get("rates_rps", [])),
        )
    except (KeyError, TypeError, ValueError) as error:
        raise ConfigError(f"workload {name!r}: {error!r} (needs prompt_tokens and output_tokens)") from error


# -- load points --------------------------------------------------------------------------------
@dataclass(frozen=True)
class LoadPoint:
    mode: Mode
    concurrency: int | None = None
    rate_rps: float | None = None

    @property
    def label(self) -> str:
        if self.mode == "rate":
            return f"r{self.rate_rps:g}"
        return f"c{self.concurrency}"


MODES: tuple[str, ...] = ("sequential", "concurrency", "rate")
ENDPOINT_KINDS: tuple[str, ...] = ("completions", "chat")
OUTPUT_CONTROLS: tuple[str, ...] = ("ignore_eos", "min_tokens", "none")


def load_points(mode: Mode, concurrency: Sequence[int], rates_rps: Sequence[float]) -> list[LoadPoint]:
    if mode == "sequential":
        return [LoadPoint("sequential", concurrency=1)]
    if mode == "concurrency":
        if not concurrency or min(concurrency) < 1:
            raise ConfigError("mode concurrency needs concurrency levels >= 1", option="concurrency")
        return [LoadPoint("concurrency", concurrency=c) for c in concurrency]
    if mode == "rate":
        if not rates_rps or min(rates_rps) <= 0:
            raise ConfigError("mode rate needs arrival rates > 0 requests/s", option="rate")
        return [LoadPoint("rate", rate_rps=r) for r in rates_rps]
    raise ConfigError(f"mode must be sequential, concurrency or rate, not {mode!r}", option="mode")


# -- configuration ------------------------------------------------------------------------------
@dataclass
class BenchConfig:
    base_url: str
    model: str
    out_dir: Path
    shapes: Sequence[Shape]
    points: Sequence[LoadPoint]
    warmups: int = 2
    samples: int = 7
    endpoint: Literal["completions", "chat"] = "completions"
    request_timeout_s: float = 600.0
    seed: int = 0
    prefix_cache_fraction: float = 0.0
    output_control: OutputControl = "ignore_eos"
    extra_body: dict[str, Any] = field(default_factory=dict)
    tokenizer_path: str | None = None
    max_in_flight: int = 256  # open-loop cap; waiting for it shows up as schedule_lag_s
    workload: str | None = None
    workloads_file: Path | None = None  # where ``workload`` came from (None: the built-in workloads.toml)
    repeats: int | None = None  # rounds over the shapes (None: one kept request per shape per round when sequential)
    order_seed: int = 0  # the shapes' random order in each round
    server_log: Path | None = None  # the server's log, when known: its warnings go into run.json

    def __post_init__(self) -> None:
        if self.endpoint not in ENDPOINT_KINDS:
            raise ConfigError(f"endpoint must be completions or chat, not {self.endpoint!r}", option="endpoint")
        if self.output_control not in OUTPUT_CONTROLS:
            raise ConfigError(f"output control must be ignore_eos, min_tokens or none, not {self.output_control!r}", option="output_control")
        if self.warmups < 0:
            raise ConfigError(f"warmups must be >= 0, not {self.warmups}", option="warmups")
        if self.samples < 1:
            raise ConfigError(f"samples must be >= 1, not {self.samples}", option="samples")
        if self.repeats is None:
            self.repeats = self.samples if all(p.mode == "sequential" for p in self.points) else 1
        if not 1 <= self.repeats <= self.samples:
            raise ConfigError(f"repeats must be between 1 and the samples per shape ({self.samples}), not {self.repeats}", option="repeats")
        if not 0.0 <= self.prefix_cache_fraction < 1.0:
            raise ConfigError(f"the shared prefix fraction must be in [0, 1), not {self.prefix_cache_fraction}", option="prefix_fraction")

    def to_json(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["out_dir"] = str(self.out_dir)
        doc["workloads_file"] = None if self.workloads_file is None else str(self.workloads_file)
        doc["server_log"] = None if self.server_log is None else str(self.server_log)
        doc["shapes"] = [{"name": s.name, "prompt_tokens": s.prompt_tokens, "output_tokens": s.output_tokens} for s in self.shapes]
        doc["points"] = [{"label": p.label, **asdict(p)} for p in self.points]
        return doc


def workloads_that_fit(max_model_len: int, path: Path | None = None) -> list[str]:
    """Names of the workloads every shape of which fits a server of ``max_model_len`` (prompt + output)."""
    return sorted(name for name, w in load_workloads(path).items()
                  if all(s.prompt_tokens + s.output_tokens <= max_model_len for s in w.shapes))


def shapes_do_not_fit_message(config: BenchConfig, too_long: Sequence[str], max_model_len: int) -> str:
    """Why the run cannot start, and what would fit: the workloads, or this ladder cut short."""
    fitting = workloads_that_fit(max_model_len, config.workloads_file)
    short = [s.prompt_tokens for s in config.shapes if s.prompt_tokens + s.output_tokens <= max_model_len]
    what = f"workload {config.workload!r}" if config.workload else "the requested shapes"
    text = (f"{what} does not fit this server: shapes {list(too_long)} need more than its max_model_len "
            f"{max_model_len} (prompt + output tokens). ")
    text += (f"Workloads that fit: {', '.join(fitting)}" if fitting else "No workload fits")
    if short:
        text += f"; or keep this ladder's shapes that fit (prompt tokens {','.join(str(p) for p in short)})"
    return text + "; or serve with a larger --max-model-len."


# -- the order of requests ----------------------------------------------------------------------
@dataclass(frozen=True)
class Block:
    """``count`` kept requests of one shape at one load point, in round ``round`` (1-based)."""

    point: LoadPoint
    shape: Shape
    round: int
    count: int


def schedule(shapes: Sequence[Shape], points: Sequence[LoadPoint], samples: int, repeats: int, seed: int) -> list[Block]:
    """The kept requests in the order they are sent: per load point, ``repeats`` rounds, each
    visiting every shape once in a fresh permutation drawn from ``default_rng(seed)``, with the
    samples split over the rounds as evenly as they divide (the first rounds take the remainder)."""
    rng = np.random.default_rng(seed)
    blocks = []
    for point in points:
        for index in range(repeats):
            share = samples // repeats + (1 if index < samples % repeats else 0)
            blocks += [Block(point, shapes[i], index + 1, share) for i in rng.permutation(len(shapes))]
    return blocks


# -- events for a live display ------------------------------------------------------------------
@dataclass(frozen=True)
class CellEvent:
    shape: str
    load: str
    phase: Literal["warmup", "measure", "done"]
    done: int
    total: int
    failed: int
    sample: dict[str, Any] | None = None


EventCallback = Callable[[CellEvent], None]


# -- output -------------------------------------------------------------------------------------
class SampleSink:
    """Appends one JSON object per line and flushes it: a killed run keeps every finished line."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file: TextIO = path.open("a", encoding="utf-8")
        self.written = 0

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record, separators=(",", ":")) + "\n")
        self._file.flush()
        self.written += 1

    def close(self) -> None:
        self._file.close()


# -- server metrics (/metrics, Prometheus text) -------------------------------------------------
# Counter and histogram families summed over their label sets; names without the _total suffix.
METRIC_FAMILIES: dict[str, str] = {
    "prefix_cache_queries": "vllm:prefix_cache_queries",
    "prefix_cache_hits": "vllm:prefix_cache_hits",
    "prompt_tokens": "vllm:prompt_tokens",
    "prompt_tokens_cached": "vllm:prompt_tokens_cached",
    "preemptions": "vllm:num_preemptions",
    "queue_time_s_sum": "vllm:request_queue_time_seconds_sum",
    "queue_time_count": "vllm:request_queue_time_seconds_count",
    "prefill_time_s_sum": "vllm:request_prefill_time_seconds_sum",
    "prefill_time_count": "vllm:request_prefill_time_seconds_count",
    "server_ttft_s_sum": "vllm:time_to_first_token_seconds_sum",
    "server_ttft_count": "vllm:time_to_first_token_seconds_count",
}


def parse_prometheus(text: str) -> dict[str, float]:
    """Sum of every sample per wanted family (label sets added up; ``_total`` suffix ignored)."""
    wanted = {family: key for key, family in METRIC_FAMILIES.items()}
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        # "name{labels} value [timestamp]"; label values may contain spaces.
        if "}" in line:
            name, rest = line.split("{", 1)[0], line[line.rindex("}") + 1 :].split()
        else:
            name, *rest = line.split()
        if not rest:
            continue
        value_part = rest[0]
        if name.endswith("_total"):
            name = name[: -len("_total")]
        key = wanted.get(name)
        if key is None:
            continue
        try:
            values[key] = values.get(key, 0.0) + float(value_part)
        except ValueError:
            continue
    return values


# The server-side means a block's counters imply: name -> (numerator, denominator).
METRIC_MEANS: dict[str, tuple[str, str]] = {
    "prefix_cache_hit_rate": ("prefix_cache_hits", "prefix_cache_queries"),
    "mean_queue_time_s": ("queue_time_s_sum", "queue_time_count"),
    "mean_prefill_time_s": ("prefill_time_s_sum", "prefill_time_count"),
    "mean_server_ttft_s": ("server_ttft_s_sum", "server_ttft_count"),
}


def with_means(delta: dict[str, float]) -> dict[str, float | None]:
    """Counter differences and the server-side means they imply."""
    def ratio(num: str, den: str) -> float | None:
        d = delta.get(den)
        return delta[num] / d if d and num in delta else None

    return {**delta, **{name: ratio(num, den) for name, (num, den) in METRIC_MEANS.items()}}


def counters_of(delta: dict[str, float | None]) -> dict[str, float]:
    """The counter differences of a ``metrics_delta`` (its means left out: they do not add up)."""
    return {key: value for key, value in delta.items() if key not in METRIC_MEANS and value is not None}


def metrics_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float | None]:
    """Counter differences over one block of requests and the server-side means they imply."""
    return with_means({key: after[key] - before.get(key, 0.0) for key in after})


# -- the run ------------------------------------------------------------------------------------
@dataclass
class RunOutcome:
    out_dir: Path
    requests: int = 0
    kept: int = 0
    failed: int = 0
    client_cpu_s: float = 0.0  # process CPU spent while requests were in flight
    aborted: str | None = None


class BenchRun:
    """One benchmark run against one server; ``await run()`` executes every cell."""

    def __init__(self, config: BenchConfig, on_event: EventCallback | None = None) -> None:
        self.config = config
        self.root = server_root(config.base_url)
        self.on_event = on_event or (lambda event: None)
        self.outcome = RunOutcome(Path(config.out_dir))
        self.run_id = f"{time.strftime('%Y%m%dT%H%M%S')}-{np.random.default_rng().integers(1 << 24):06x}"
        self._serial = 0
        self._perf0 = time.perf_counter()
        self._wall0 = time.time()
        self._client: StreamingClient | None = None
        self._sink: SampleSink | None = None
        self._metrics_sink: SampleSink | None = None
        self._prompts: PromptFactory | None = None
        self._tokenizer: PromptTokenizer | None = None
        self._server_gone: str | None = None
        self._round: int | None = None  # the round of the kept block in flight (None while warming up)
        self.host: dict[str, Any] = {}  # host_facts() of the run, load_after and the server's warnings at its end
        self._log_start: int | None = None
        self.server_info: dict[str, Any] = {}

    # -- setup ----------------------------------------------------------------------------------
    def check_out_dir(self) -> Path:
        out = Path(self.config.out_dir)
        samples = out / SAMPLES_FILE
        if samples.exists() and samples.stat().st_size > 0:
            raise ConfigError(f"{samples} already holds samples; choose a new output directory (runs are never mixed)", option="out")
        return out

    def prepare_out_dir(self) -> Path:
        out = self.check_out_dir()
        out.mkdir(parents=True, exist_ok=True)
        return out

    def probe_server(self) -> dict[str, Any]:
        """Model list, version and max_model_len; ConfigError when the model is not served."""
        info: dict[str, Any] = {"url": self.root}
        with Endpoint(self.root, self.config.model, timeout_s=30.0) as endpoint:
            try:
                cards = endpoint.models()
            except EndpointStatusError as error:
                raise ConfigError(f"{error.url} answered HTTP {error.status}") from error
            except EndpointError as error:
                raise ConfigError(f"no OpenAI-compatible server at {self.root}: {error.message}") from error
            names = [card.get("id") for card in cards]
            if self.config.model not in names:
                raise ConfigError(f"model {self.config.model!r} is not served at {self.root}; it serves {names}")
            card = next(c for c in cards if c.get("id") == self.config.model)
            info["max_model_len"] = card.get("max_model_len")
            info["model_root"] = card.get("root")
            info["version"] = endpoint.version(timeout_s=30.0)
            metrics = endpoint.metrics_text()
            info["metrics_available"] = metrics is not None and "vllm:" in metrics
        self.check_shapes_fit(info.get("max_model_len"))
        return info

    def check_shapes_fit(self, max_model_len: int | None) -> None:
        if not max_model_len:
            return
        too_long = [s.name for s in self.config.shapes if s.prompt_tokens + s.output_tokens > max_model_len]
        if too_long:
            raise ConfigError(shapes_do_not_fit_message(self.config, too_long, max_model_len), option="workload")

    def make_tokenizer(self) -> PromptTokenizer:
        if self.config.tokenizer_path:
            return HfTokenizer(self.config.tokenizer_path)
        return ServerTokenizer(self.root, self.config.model)

    # -- main -----------------------------------------------------------------------------------
    async def run(self) -> RunOutcome:
        self.check_out_dir()
        self.server_info = self.probe_server()  # a server that cannot run the shapes: refused before --out exists
        out = self.prepare_out_dir()
        self._tokenizer = self.make_tokenizer()
        self._prompts = PromptFactory(
            self._tokenizer,
            endpoint=self.config.endpoint,
            seed=self.config.seed,
            prefix_cache_fraction=self.config.prefix_cache_fraction,
        )
        self._sink = SampleSink(out / SAMPLES_FILE)
        self._metrics_sink = SampleSink(out / SERVER_METRICS_FILE)
        self.host = host_facts()
        self._log_start = log_size(self.config.server_log)
        started = time.time()
        self._write_run_file(started=started, finished=None, status="running")
        try:
            async with StreamingClient(self.root, request_timeout_s=self.config.request_timeout_s, max_connections=self.config.max_in_flight + 8) as client:
                self._client = client
                client.stream_options = await probe_stream_options(client, self._probe_spec())
                self.server_info["stream_options"] = asdict(client.stream_options)
                await self._run_schedule()
        except BenchAborted as error:
            self.outcome.aborted = error.message
            raise
        finally:
            status = "aborted" if self.outcome.aborted else ("complete" if not self._interrupted() else "interrupted")
            self.host["load_after"] = load_average()
            self.host["server_warnings"] = server_warnings(self.config.server_log, self._log_start)
            self._write_run_file(started=started, finished=time.time(), status=status)
            self._sink.close()
            self._metrics_sink.close()
            close = getattr(self._tokenizer, "close", None)
            if close:
                close()
        return self.outcome

    def _interrupted(self) -> bool:
        task = asyncio.current_task()
        return bool(task and task.cancelling())

    def _probe_spec(self) -> RequestSpec:
        prompt = self._prompts.build("probe", PROBE_PROMPT_TOKENS, self._next_serial())
        return self._spec(prompt, Shape(PROBE_PROMPT_TOKENS, PROBE_OUTPUT_TOKENS))

    def _write_run_file(self, *, started: float, finished: float | None, status: str) -> None:
        doc = {
            "run_id": self.run_id,
            "status": status,
            "started_unix": started,
            "finished_unix": finished,
            "config": self.config.to_json(),
            "server": self.server_info,
            "tokenizer": getattr(self._tokenizer, "name", None),
            "prompt_salt": self._prompts.run_salt if self._prompts else None,
            "client": {
                "requests": self.outcome.requests,
                "cpu_s_in_flight": self.outcome.client_cpu_s,
                "cpu_s_per_request": self.outcome.client_cpu_s / self.outcome.requests if self.outcome.requests else None,
            },
            "aborted": self.outcome.aborted,
            "host": self.host,
            "order": {"repeats": self.config.repeats, "order_seed": self.config.order_seed},
        }
        path = Path(self.config.out_dir) / RUN_FILE
        write_text_atomic(path, json.dumps(doc, indent=2) + "\n")

    # -- the cells, interleaved ---------------------------------------------------------------------
    async def _run_schedule(self) -> None:
        """Every load point: every shape's warmups, then the kept blocks in the scheduled order."""
        config = self.config
        blocks = schedule(config.shapes, config.points, config.samples, config.repeats or 1, config.order_seed)
        for point in config.points:
            mine = [b for b in blocks if b.point == point]
            counters = {b.shape.name: CellCounter(b.shape.name, point.label, self.on_event) for b in mine}
            for block in mine[: len(config.shapes)]:  # the first round's order
                await self._warm(block.shape, point, counters[block.shape.name])
            last = {b.shape.name: i for i, b in enumerate(mine)}
            for index, block in enumerate(mine):
                counter = counters[block.shape.name]
                if block.round == 1:
                    counter.start("measure", config.samples)
                await self._measure(block, counter)
                if last[block.shape.name] == index:
                    counter.finish()

    async def _prompts_for(self, shape: Shape, count: int) -> list[Prompt]:
        try:
            return self._build_prompts(shape, count)
        except Fp4forgeError as error:  # chat prompts call /tokenize: the server may be gone
            reason = await self._unreachable_reason()
            if reason is not None:
                self._abort(f"building prompts for {shape.name}: {error}; health check: {reason}")
            raise

    async def _warm(self, shape: Shape, point: LoadPoint, cell: CellCounter) -> None:
        warmups = self.config.warmups
        if point.mode == "concurrency":
            warmups = max(warmups, point.concurrency or 1)  # fill every slot once before measuring
        warm_prompts = await self._prompts_for(shape, warmups)
        cell.start("warmup", len(warm_prompts))
        cpu_before = time.process_time()  # client CPU is counted per phase: concurrent requests overlap
        if point.mode == "concurrency":
            await self._closed_loop(warm_prompts, shape, point, cell, warmup=True)
        else:
            await self._closed_loop(warm_prompts, shape, LoadPoint("sequential", concurrency=1), cell, warmup=True, label=point)
        self.outcome.client_cpu_s += time.process_time() - cpu_before

    async def _measure(self, block: Block, cell: CellCounter) -> None:
        shape, point = block.shape, block.point
        kept_prompts = await self._prompts_for(shape, block.count)
        before = await self._scrape_metrics()
        cpu_before = time.process_time()
        self._round = block.round
        if point.mode == "rate":
            await self._open_loop(kept_prompts, shape, point, cell)
        else:
            await self._closed_loop(kept_prompts, shape, point, cell, warmup=False)
        self.outcome.client_cpu_s += time.process_time() - cpu_before
        after = await self._scrape_metrics()
        self._metrics_sink.write(
            {
                "shape": shape.name,
                "load": point.label,
                "round": block.round,
                "available": before is not None and after is not None,
                "delta": metrics_delta(before, after) if before is not None and after is not None else None,
            }
        )

    async def _closed_loop(
        self,
        prompts: list[Prompt],
        shape: Shape,
        point: LoadPoint,
        cell: CellCounter,
        *,
        warmup: bool,
        label: LoadPoint | None = None,
    ) -> None:
        """``point.concurrency`` workers, each sending its next prompt as soon as its last one finished."""
        queue = list(reversed(prompts))
        recorded_as = label or point

        async def worker() -> None:
            while queue and self._server_gone is None:
                prompt = queue.pop()
                scheduled = time.perf_counter()
                await self._one_request(prompt, shape, recorded_as, cell, warmup=warmup, scheduled=scheduled)

        await self._gather([worker() for _ in range(min(point.concurrency or 1, len(prompts)))])

    async def _open_loop(self, prompts: list[Prompt], shape: Shape, point: LoadPoint, cell: CellCounter) -> None:
        """Poisson arrivals: exponential gaps at the mean rate, independent of how the server keeps up."""
        rng = np.random.default_rng([self.config.seed, shape.prompt_tokens, int(point.rate_rps * 1000), self._round or 0])
        arrivals = np.cumsum(rng.exponential(1.0 / point.rate_rps, len(prompts)))
        slots = asyncio.Semaphore(self.config.max_in_flight)
        start = time.perf_counter()

        async def arrive(prompt: Prompt, at: float) -> None:
            async with slots:
                await self._one_request(prompt, shape, point, cell, warmup=False, scheduled=at)

        tasks = []
        for prompt, offset in zip(prompts, arrivals):
            if self._server_gone is not None:
                break
            due = start + float(offset)
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
            tasks.append(asyncio.ensure_future(arrive(prompt, due)))
        await self._gather(tasks)

    async def _gather(self, aws: Sequence[Any]) -> None:
        """Run request tasks together; on abort cancel the rest (they cannot finish) and re-raise."""
        tasks = [asyncio.ensure_future(a) for a in aws]
        try:
            await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    async def _one_request(
        self,
        prompt: Prompt,
        shape: Shape,
        point: LoadPoint,
        cell: CellCounter,
        *,
        warmup: bool,
        scheduled: float,
    ) -> None:
        result = await self._client.send(self._spec(prompt, shape))
        record = self.sample_record(prompt, shape, point, result, warmup=warmup, scheduled=scheduled)
        self._sink.write(record)
        self.outcome.requests += 1
        if not warmup:
            self.outcome.kept += int(result.ok)
        self.outcome.failed += int(not result.ok)
        cell.add(record)
        if not result.ok and result.error_kind in TRANSPORT_ERRORS:
            await self._check_server_alive(result)

    def _spec(self, prompt: Prompt, shape: Shape) -> RequestSpec:
        extra: dict[str, Any] = {}
        if self.config.output_control == "ignore_eos":
            extra["ignore_eos"] = True
        elif self.config.output_control == "min_tokens":
            extra["min_tokens"] = shape.output_tokens
        extra.update(self.config.extra_body)
        return RequestSpec(
            endpoint=self.config.endpoint,
            model=self.config.model,
            prompt=prompt.token_ids,
            messages=prompt.messages,
            max_tokens=shape.output_tokens,
            extra_body=extra,
            request_id=f"fp4forge-{self.run_id}-{prompt.fingerprint}",  # joins server logs to samples
        )

    def _next_serial(self) -> int:
        serial = self._serial
        self._serial += 1
        return serial

    async def _check_server_alive(self, result: RequestResult) -> None:
        """After a refused or broken connection: abort the run when nothing answers any more."""
        if self._server_gone is not None:
            raise BenchAborted(self._server_gone)
        reason = await self._unreachable_reason()
        if reason is not None:
            self._abort(f"{result.error_kind}: {result.error}; health check: {reason}")

    async def _unreachable_reason(self) -> str | None:
        """None when the server root answers HTTP at all (even 404), else why it does not."""
        return await self._client.session.unreachable_reason(timeout_s=HEALTH_TIMEOUT_S)

    def _abort(self, cause: str) -> None:
        self._server_gone = (
            f"the server at {self.root} stopped answering ({cause}). Stopped after {self.outcome.requests} "
            f"finished requests ({self.outcome.kept} kept); every one of them is in "
            f"{Path(self.config.out_dir) / SAMPLES_FILE}"
        )
        raise BenchAborted(self._server_gone)

    def _build_prompts(self, shape: Shape, count: int) -> list[Prompt]:
        return [self._prompts.build(shape.name, shape.prompt_tokens, self._next_serial()) for _ in range(count)]

    async def _scrape_metrics(self) -> dict[str, float] | None:
        if not self.server_info.get("metrics_available"):
            return None
        text = await self._client.session.get_text(METRICS_PATH)
        return parse_prometheus(text) if text is not None else None

    def sample_record(
        self,
        prompt: Prompt,
        shape: Shape,
        point: LoadPoint,
        result: RequestResult,
        *,
        warmup: bool,
        scheduled: float,
    ) -> dict[str, Any]:
        """One line of samples.jsonl (keys documented in docs/bench.md)."""
        ttft = result.ttft_s
        return {
            "schema": SAMPLE_SCHEMA,
            "run_id": self.run_id,
            "seq": self.outcome.requests,
            "shape": shape.name,
            "load": point.label,
            "mode": point.mode,
            "concurrency": point.concurrency,
            "rate_rps": point.rate_rps,
            "warmup": warmup,
            "round": None if warmup else self._round,
            "ok": result.ok,
            "error_kind": result.error_kind,
            "error": result.error,
            "http_status": result.http_status,
            "endpoint": self.config.endpoint,
            "prompt_tokens": prompt.prompt_tokens,
            "target_prompt_tokens": prompt.target_tokens,
            "shared_prefix_tokens": prompt.shared_prefix_tokens,
            "server_prompt_tokens": result.usage_prompt_tokens,
            "cached_tokens": result.cached_tokens,
            "output_tokens": result.output_tokens,
            "target_output_tokens": shape.output_tokens,
            "token_count_source": result.token_count_source,
            "ttft_s": _round(ttft),
            "first_chunk_s": _round(result.first_chunk_s),
            "decode_tok_s": _round(result.decode_tok_s),
            "tpot_s": _round(result.tpot_s),
            "e2e_s": _round(result.e2e_s),
            "ttft_from_schedule_s": _round(None if result.t_first_token is None else result.t_first_token - scheduled),
            "schedule_lag_s": _round(result.t_send - scheduled),
            "t_send_unix": round(self._wall0 + (result.t_send - self._perf0), 6),
            "finish_reason": result.finish_reason,
            "chunk_gaps_s": [round(g, 6) for g in result.chunk_gaps_s],
            "chunk_tokens": result.chunk_tokens,
            "first_chunk_tokens": result.first_chunk_tokens,
            "prompt_fingerprint": prompt.fingerprint,
            "server_metrics": result.server_metrics,
        }


class CellCounter:
    """Progress of one cell, reported through the event callback."""

    def __init__(self, shape: str, load: str, on_event: EventCallback) -> None:
        self.shape, self.load, self.on_event = shape, load, on_event
        self.phase: Literal["warmup", "measure", "done"] = "warmup"
        self.total = self.done = self.failed = 0

    def start(self, phase: Literal["warmup", "measure"], total: int) -> None:
        self.phase, self.total, self.done, self.failed = phase, total, 0, 0
        self.on_event(CellEvent(self.shape, self.load, phase, 0, total, 0))

    def add(self, record: dict[str, Any]) -> None:
        self.done += 1
        self.failed += int(not record["ok"])
        self.on_event(CellEvent(self.shape, self.load, self.phase, self.done, self.total, self.failed, record))

    def finish(self) -> None:
        self.on_event(CellEvent(self.shape, self.load, "done", self.done, self.total, self.failed))


def _round(value: float | None, digits: int = 6) -> float | None:
    if value is None or not math.isfinite(value):
        return None
    return round(value, digits)


async def run_bench(config: BenchConfig, on_event: EventCallback | None = None) -> RunOutcome:
    return await BenchRun(config, on_event).run()
