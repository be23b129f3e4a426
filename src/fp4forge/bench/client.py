"""Measurement: a streaming timer on top of ``fp4forge.endpoint``'s streamed calls.

Per request it records when the request was sent, when the first chunk carrying generated text,
reasoning or a tool call arrived (a chat role-only chunk does not count: vLLM sends one before
any token exists), every later token-bearing chunk's arrival and token count, and the server's
usage. ``send`` never raises for anything the server or the network does: timeouts, HTTP errors,
refused connections and streams cut mid-way come back as a failed ``RequestResult`` with an
``error_kind`` (the ``kind`` of the endpoint's named error), so a benchmark counts them instead
of crashing. The HTTP itself (URLs, pooling, the error mapping) is the endpoint's.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from fp4forge.endpoint import ERROR_BODY_CHARS, Endpoint, GenerationKind
from fp4forge.errors import EndpointError, EndpointStatusError, EndpointTimeout

# Error kinds, in the order a request can fail; the first five are ``EndpointError.kind``s.
ERROR_CONNECT = "connect"  # nothing listening / connection refused: the server is gone
ERROR_TIMEOUT = "timeout"
ERROR_HTTP = "http"  # status >= 400
ERROR_DISCONNECT = "disconnect"  # the stream ended or broke before [DONE]
ERROR_PROTOCOL = "protocol"  # a chunk that is not the JSON we expect
ERROR_NO_TOKENS = "no_tokens"  # a complete stream without one generated token
TRANSPORT_ERRORS = frozenset({ERROR_CONNECT, ERROR_DISCONNECT})

# Chat delta fields that carry generated tokens; "role" alone does not.
CHAT_TOKEN_FIELDS = ("content", "reasoning_content", "reasoning", "tool_calls")


@dataclass(frozen=True)
class StreamOptions:
    """What the server supports, found by ``probe_stream_options``."""

    include_usage: bool = True
    continuous_usage_stats: bool = True

    def payload(self) -> dict[str, bool] | None:
        if not self.include_usage:
            return None
        options = {"include_usage": True}
        if self.continuous_usage_stats:
            options["continuous_usage_stats"] = True
        return options


@dataclass
class RequestSpec:
    """One request: a prompt (token IDs or text for completions, messages for chat) and its limits."""

    endpoint: GenerationKind
    model: str
    prompt: list[int] | str | None = None
    messages: list[dict[str, Any]] | None = None
    max_tokens: int = 128
    extra_body: Mapping[str, Any] = field(default_factory=dict)
    request_id: str | None = None

    def payload(self, stream_options: StreamOptions) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "max_tokens": self.max_tokens, "stream": True, "temperature": 0.0}
        if self.endpoint == "chat":
            body["messages"] = self.messages
        else:
            body["prompt"] = self.prompt
        options = stream_options.payload()
        if options:
            body["stream_options"] = options
        body.update(self.extra_body)
        return body


@dataclass
class RequestResult:
    """Timings of one request. Times are ``time.perf_counter()`` seconds; durations in seconds."""

    ok: bool
    error_kind: str | None = None
    error: str | None = None
    http_status: int | None = None
    t_send: float = 0.0
    t_first_chunk: float | None = None  # first SSE chunk with choices, token or not (vLLM bench's TTFT)
    t_first_token: float | None = None
    t_last_token: float | None = None
    t_end: float | None = None
    first_chunk_tokens: int = 0
    chunk_gaps_s: list[float] = field(default_factory=list)  # between consecutive token-bearing chunks
    chunk_tokens: list[int] = field(default_factory=list)  # tokens in each chunk after the first
    token_count_source: str = "chunks"  # "continuous_usage" when the server counted per chunk
    usage_prompt_tokens: int | None = None
    usage_completion_tokens: int | None = None
    cached_tokens: int | None = None
    finish_reason: str | None = None
    server_metrics: dict[str, Any] | None = None  # vLLM --enable-per-request-metrics

    @property
    def counted_tokens(self) -> int:
        return self.first_chunk_tokens + sum(self.chunk_tokens)

    @property
    def output_tokens(self) -> int:
        """Server usage when it was reported, else the tokens counted chunk by chunk."""
        if self.usage_completion_tokens is not None:
            return self.usage_completion_tokens
        return self.counted_tokens

    @property
    def ttft_s(self) -> float | None:
        return None if self.t_first_token is None else self.t_first_token - self.t_send

    @property
    def first_chunk_s(self) -> float | None:
        return None if self.t_first_chunk is None else self.t_first_chunk - self.t_send

    @property
    def e2e_s(self) -> float | None:
        end = self.t_last_token if self.ok else self.t_end
        return None if end is None else end - self.t_send

    @property
    def decode_tok_s(self) -> float | None:
        """Tokens after the first chunk over the time after it: (n_out - 1) / (t_last - t_first)
        when the first chunk holds one token, as it does without speculative decoding."""
        if self.t_first_token is None or self.t_last_token is None:
            return None
        span = self.t_last_token - self.t_first_token
        after_first = self.output_tokens - self.first_chunk_tokens
        if span <= 0 or after_first <= 0:
            return None
        return after_first / span

    @property
    def tpot_s(self) -> float | None:
        """vLLM's TPOT, (e2e - TTFT) / (n_out - 1), for comparisons with ``vllm bench serve``."""
        ttft, e2e, n_out = self.ttft_s, self.e2e_s, self.output_tokens
        if ttft is None or e2e is None or n_out <= 1:
            return None
        return (e2e - ttft) / (n_out - 1)


def failed(kind: str, message: str, t_send: float, **fields: Any) -> RequestResult:
    return RequestResult(ok=False, error_kind=kind, error=message[:ERROR_BODY_CHARS], t_send=t_send, t_end=time.perf_counter(), **fields)


class StreamingClient:
    """One pooled connection set to one server; ``send`` many requests through it concurrently."""

    def __init__(
        self,
        base_url: str,
        *,
        request_timeout_s: float = 600.0,
        connect_timeout_s: float = 10.0,
        max_connections: int = 256,
        stream_options: StreamOptions | None = None,
        api_key: str | None = None,
    ) -> None:
        self.endpoint = Endpoint(base_url, timeout_s=request_timeout_s, api_key=api_key)
        self.base_url = self.endpoint.root
        self.request_timeout_s = request_timeout_s
        self.stream_options = stream_options or StreamOptions()
        # The overall deadline is enforced in send(); the session's timeouts bound each phase.
        self.session = self.endpoint.session(
            max_connections=max_connections, request_timeout_s=request_timeout_s, connect_timeout_s=connect_timeout_s
        )

    async def __aenter__(self) -> StreamingClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self.session.aclose()

    async def send(self, spec: RequestSpec) -> RequestResult:
        """Stream one request and time it; failures come back as ``ok=False``, never as exceptions."""
        t_send = time.perf_counter()
        headers = {"x-request-id": spec.request_id} if spec.request_id else None
        stream = StreamTimer(spec.endpoint, t_send)
        try:
            async with asyncio.timeout(self.request_timeout_s):
                async with self.session.stream(spec.endpoint, spec.payload(self.stream_options), headers=headers) as lines:
                    # Read to the end of the body even after [DONE]: leaving early would drop the
                    # connection, and every request would pay a new TCP connect.
                    async for line in lines:
                        if not stream.done:
                            stream.feed_line(line, time.perf_counter())
        except (TimeoutError, EndpointTimeout):
            return stream.fail(ERROR_TIMEOUT, f"no complete answer within {self.request_timeout_s:g} s")
        except EndpointStatusError as error:
            return failed(ERROR_HTTP, f"HTTP {error.status}: {(error.body or '').strip()}", t_send, http_status=error.status)
        except EndpointError as error:
            return stream.fail(error.kind, self._failure_text(error))
        except ProtocolViolation as error:
            return stream.fail(ERROR_PROTOCOL, str(error))
        return stream.finish()

    def _failure_text(self, error: EndpointError) -> str:
        cause = error.cause
        if error.kind == ERROR_CONNECT:
            return f"cannot connect to {self.base_url}: {cause}"
        return f"connection broke mid-stream: {str(cause) or type(cause).__name__}"


class ProtocolViolation(Exception):
    """A server-sent event that is not an OpenAI-style JSON chunk."""


class StreamTimer:
    """Turns timed SSE lines into a ``RequestResult``; separated from I/O so it is testable alone."""

    def __init__(self, endpoint: GenerationKind, t_send: float) -> None:
        self.endpoint = endpoint
        self.result = RequestResult(ok=False, t_send=t_send)
        self.done = False
        self._last_token_time: float | None = None
        self._usage_tokens_seen = 0

    def feed_line(self, line: str, now: float) -> bool:
        """Consume one SSE line received at ``now``; True once ``[DONE]`` arrived."""
        if not line.startswith("data:"):
            return False  # blank separators, comments (":"), event/id fields
        data = line[5:].strip()
        if data == "[DONE]":
            self.done = True
            return True
        try:
            chunk = json.loads(data)
        except json.JSONDecodeError as error:
            raise ProtocolViolation(f"chunk is not JSON: {data[:80]!r}") from error
        if not isinstance(chunk, dict):
            raise ProtocolViolation(f"chunk is not a JSON object: {data[:80]!r}")
        if "error" in chunk and not chunk.get("choices"):
            raise ProtocolViolation(f"server error inside the stream: {json.dumps(chunk['error'])[:200]}")
        self._feed_chunk(chunk, now)
        return False

    def _feed_chunk(self, chunk: dict[str, Any], now: float) -> None:
        result = self.result
        choices = chunk.get("choices") or []
        new_usage_tokens = self._read_usage(chunk.get("usage"), per_chunk=bool(choices))
        if chunk.get("metrics"):
            result.server_metrics = chunk["metrics"]
        if not choices:
            return  # the closing usage-only chunk
        choice = choices[0]
        if result.t_first_chunk is None:
            result.t_first_chunk = now
        if choice.get("finish_reason"):
            result.finish_reason = choice["finish_reason"]
        carries_text = self._carries_generated_text(choice)
        if new_usage_tokens is not None:
            tokens = new_usage_tokens
        else:
            tokens = 1 if carries_text else 0
        if tokens <= 0 and not carries_text:
            return  # role-only or empty chunk: no token yet
        tokens = max(tokens, 1)
        if result.t_first_token is None:
            result.t_first_token = now
            result.first_chunk_tokens = tokens
        else:
            result.chunk_gaps_s.append(now - self._last_token_time)
            result.chunk_tokens.append(tokens)
        self._last_token_time = now
        result.t_last_token = now

    def _carries_generated_text(self, choice: dict[str, Any]) -> bool:
        if self.endpoint == "completions":
            return bool(choice.get("text"))
        delta = choice.get("delta") or {}
        return any(delta.get(name) for name in CHAT_TOKEN_FIELDS)

    def _read_usage(self, usage: dict[str, Any] | None, *, per_chunk: bool) -> int | None:
        """Record usage; return the tokens this chunk added under continuous usage stats, else None.

        ``per_chunk``: the usage rides on a chunk with choices (continuous usage stats), not on
        the closing usage-only chunk.
        """
        if not usage:
            return None
        result = self.result
        completion = usage.get("completion_tokens")
        if usage.get("prompt_tokens") is not None:
            result.usage_prompt_tokens = usage["prompt_tokens"]
        details = usage.get("prompt_tokens_details") or {}
        if details.get("cached_tokens") is not None:
            result.cached_tokens = details["cached_tokens"]
        if completion is None:
            return None
        result.usage_completion_tokens = completion
        if not per_chunk:
            return None
        result.token_count_source = "continuous_usage"
        added = completion - self._usage_tokens_seen
        self._usage_tokens_seen = completion
        return added

    def fail(self, kind: str, message: str) -> RequestResult:
        result = self.result
        result.ok = False
        result.error_kind = kind
        result.error = message[:ERROR_BODY_CHARS]
        result.t_end = time.perf_counter()
        return result

    def finish(self) -> RequestResult:
        if not self.done:
            return self.fail(ERROR_DISCONNECT, "stream ended without [DONE]")
        if self.result.t_first_token is None:
            return self.fail(ERROR_NO_TOKENS, "stream completed without a generated token")
        self.result.ok = True
        self.result.t_end = time.perf_counter()
        return self.result


# (include_usage, continuous_usage_stats): continuous usage, then the final usage chunk, then none
STREAM_OPTIONS_RICHEST_FIRST = tuple(StreamOptions(*flags) for flags in ((True, True), (True, False), (False, False)))


async def probe_stream_options(client: StreamingClient, spec: RequestSpec) -> StreamOptions:
    """The richest ``stream_options`` the server accepts: continuous usage, then usage, then none."""
    for candidate in STREAM_OPTIONS_RICHEST_FIRST:
        client.stream_options = candidate
        result = await client.send(spec)
        if result.ok:
            if candidate.continuous_usage_stats and result.token_count_source != "continuous_usage":
                continue  # accepted but ignored: fall back to the final usage chunk
            return candidate
        if result.error_kind != ERROR_HTTP or result.http_status not in (400, 422):
            return candidate  # not about stream_options; the run itself will report it
    return client.stream_options
