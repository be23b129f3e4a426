"""The bench streaming client and runner against a small fake OpenAI-compatible SSE server.

The fake server (``FakeOpenAIServer``, plain asyncio on loopback, chunked HTTP/1.1 like vLLM's)
plays the edge cases a real server produces only by accident: a role-only first chat chunk, a
stream cut mid-way, HTTP 500, a server that never answers, a server without continuous usage
stats. The model name picks the scenario. ``python tests/test_bench_client.py --serve`` runs it as
a separate process (tests/test_bench_vllm.py kills one mid-run).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fp4forge.bench.client import (
    ERROR_CONNECT,
    ERROR_DISCONNECT,
    ERROR_HTTP,
    ERROR_TIMEOUT,
    RequestSpec,
    StreamingClient,
    StreamOptions,
    StreamTimer,
    probe_stream_options,
)
from fp4forge.bench.runner import BenchConfig, LoadPoint, Shape, metrics_delta, parse_prometheus, run_bench
from fp4forge.serve import pick_free_port

SCENARIOS = ("normal", "role-first", "disconnect", "http-500", "hang", "no-usage", "reject-continuous", "flaky-500", "context-slow")
FAKE_TTFT_S = 0.06
FAKE_TOKEN_GAP_S = 0.01
DISCONNECT_AFTER_TOKENS = 3
CONTEXT_SLOW_TOKENS = 64  # "context-slow": the token gap grows by FAKE_TOKEN_GAP_S every 64 prompt tokens


# -- the fake server ----------------------------------------------------------------------------
class FakeOpenAIServer:
    """Just enough of vLLM's OpenAI surface for the bench client: models, tokenize, metrics, SSE."""

    def __init__(self, *, ttft_s: float = FAKE_TTFT_S, token_gap_s: float = FAKE_TOKEN_GAP_S) -> None:
        self.ttft_s = ttft_s
        self.token_gap_s = token_gap_s
        self.requests = 0
        self.prompt_tokens_total = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:  # keep-alive: many requests per connection, like httpx uses it
                request = await read_request(reader)
                if request is None:
                    return
                method, path, body = request
                keep_open = await self.route(method, path, body, writer)
                if not keep_open:
                    return
        except (ConnectionError, asyncio.IncompleteReadError):
            return
        finally:
            writer.close()

    async def route(self, method: str, path: str, body: dict[str, Any], writer: asyncio.StreamWriter) -> bool:
        if method == "GET" and path == "/v1/models":
            cards = [{"id": name, "object": "model", "max_model_len": 4096} for name in SCENARIOS]
            return await send_json(writer, 200, {"object": "list", "data": cards})
        if method == "GET" and path in ("/health", "/version"):
            return await send_json(writer, 200, {"version": "fake"})
        if method == "GET" and path == "/metrics":
            text = (
                f'vllm:prefix_cache_queries_total{{engine="0"}} {float(self.prompt_tokens_total)}\n'
                'vllm:prefix_cache_hits_total{engine="0"} 0.0\n'
                f"vllm:request_queue_time_seconds_sum 0.0\nvllm:request_queue_time_seconds_count {float(self.requests)}\n"
            )
            return await send_raw(writer, 200, "text/plain", text.encode())
        if method == "POST" and path == "/tokenize":
            return await send_json(writer, 200, fake_tokenize(body))
        if method == "POST" and path in ("/v1/completions", "/v1/chat/completions"):
            return await self.stream(path.endswith("chat/completions"), body, writer)
        return await send_json(writer, 404, {"error": f"no route {method} {path}"})

    async def stream(self, chat: bool, body: dict[str, Any], writer: asyncio.StreamWriter) -> bool:
        scenario = body.get("model")
        self.requests += 1
        options = body.get("stream_options") or {}
        if scenario == "http-500" or (scenario == "flaky-500" and self.requests % 3 == 0):
            return await send_json(writer, 500, {"error": {"message": "boom", "type": "InternalServerError"}})
        if scenario == "reject-continuous" and options.get("continuous_usage_stats"):
            return await send_json(writer, 400, {"error": {"message": "continuous_usage_stats not supported"}})
        if scenario == "hang":
            await asyncio.sleep(3600)
        prompt_tokens = len(body["prompt"]) if not chat else fake_tokenize({"messages": body["messages"]})["count"]
        self.prompt_tokens_total += prompt_tokens
        max_tokens = int(body.get("max_tokens", 16))
        per_chunk_usage = options.get("continuous_usage_stats") and scenario != "no-usage"
        final_usage = options.get("include_usage") and scenario != "no-usage"
        await start_chunked(writer)
        if chat:  # vLLM's first chat chunk: the role, no token yet
            await self.event(writer, chat_chunk({"role": "assistant", "content": ""}), prompt_tokens, 0, per_chunk_usage)
        await asyncio.sleep(self.ttft_s)
        for i in range(1, max_tokens + 1):
            if scenario == "disconnect" and i > DISCONNECT_AFTER_TOKENS:
                writer.close()  # mid-stream, without the terminating chunk
                return False
            finish = "length" if i == max_tokens else None
            chunk = chat_chunk({"content": f" t{i}"}, finish) if chat else completion_chunk(f" t{i}", finish)
            await self.event(writer, chunk, prompt_tokens, i, per_chunk_usage)
            if i < max_tokens:
                slower = 1 + prompt_tokens / CONTEXT_SLOW_TOKENS if scenario == "context-slow" else 1
                await asyncio.sleep(self.token_gap_s * slower)
        if final_usage:
            await send_event(writer, {"choices": [], "usage": usage(prompt_tokens, max_tokens)})
        await send_event_text(writer, "[DONE]")
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        return True

    async def event(self, writer: asyncio.StreamWriter, chunk: dict[str, Any], prompt_tokens: int, done_tokens: int, per_chunk_usage: bool) -> None:
        if per_chunk_usage:
            chunk["usage"] = usage(prompt_tokens, done_tokens)
        await send_event(writer, chunk)


def fake_tokenize(body: dict[str, Any]) -> dict[str, Any]:
    """One token per whitespace-separated word; a chat request adds 5 template tokens."""
    if "messages" in body:
        words = sum(len(str(m.get("content", "")).split()) for m in body["messages"])
        return {"count": words + 5, "tokens": list(range(words + 5)), "max_model_len": 4096}
    tokens = [abs(hash(word)) % 50_000 for word in str(body.get("prompt", "")).split()]
    return {"count": len(tokens), "tokens": tokens, "max_model_len": 4096}


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens}


def chat_chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


def completion_chunk(text: str, finish: str | None = None) -> dict[str, Any]:
    return {"object": "text_completion", "choices": [{"index": 0, "text": text, "finish_reason": finish}]}


async def read_request(reader: asyncio.StreamReader) -> tuple[str, str, dict[str, Any]] | None:
    head = await reader.readuntil(b"\r\n\r\n") if not reader.at_eof() else b""
    if not head:
        return None
    lines = head.decode("latin-1").split("\r\n")
    method, path, _ = lines[0].split(" ", 2)
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
    length = int(headers.get("content-length", "0"))
    raw = await reader.readexactly(length) if length else b""
    return method, path, json.loads(raw) if raw else {}


async def send_raw(writer: asyncio.StreamWriter, status: int, content_type: str, payload: bytes) -> bool:
    writer.write(
        f"HTTP/1.1 {status} X\r\ncontent-type: {content_type}\r\ncontent-length: {len(payload)}\r\n\r\n".encode() + payload
    )
    await writer.drain()
    return True


async def send_json(writer: asyncio.StreamWriter, status: int, doc: Any) -> bool:
    return await send_raw(writer, status, "application/json", json.dumps(doc).encode())


async def start_chunked(writer: asyncio.StreamWriter) -> None:
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
    await writer.drain()


async def send_event_text(writer: asyncio.StreamWriter, data: str) -> None:
    payload = f"data: {data}\n\n".encode()
    writer.write(f"{len(payload):x}\r\n".encode() + payload + b"\r\n")
    await writer.drain()


async def send_event(writer: asyncio.StreamWriter, doc: dict[str, Any]) -> None:
    await send_event_text(writer, json.dumps(doc))


async def serve_forever(port: int, ttft_s: float, token_gap_s: float, ready: threading.Event | None = None) -> None:
    server = FakeOpenAIServer(ttft_s=ttft_s, token_gap_s=token_gap_s)
    listener = await asyncio.start_server(server.handle, "127.0.0.1", port)
    if ready is not None:
        ready.set()
    print(f"READY {port}", flush=True)
    async with listener:
        await listener.serve_forever()


@pytest.fixture(scope="module")
def fake_url() -> Iterator[str]:
    """The fake server in a daemon thread with its own event loop."""
    port = pick_free_port()
    ready = threading.Event()
    thread = threading.Thread(target=lambda: asyncio.run(serve_forever(port, FAKE_TTFT_S, FAKE_TOKEN_GAP_S, ready)), daemon=True)
    thread.start()
    assert ready.wait(10), "fake server did not start"
    yield f"http://127.0.0.1:{port}"


def send(url: str, spec: RequestSpec, **client_options: Any):
    async def go():
        async with StreamingClient(url, **client_options) as client:
            return await client.send(spec)

    return asyncio.run(go())


def chat_spec(model: str = "role-first", max_tokens: int = 8) -> RequestSpec:
    return RequestSpec("chat", model, messages=[{"role": "user", "content": "hello there"}], max_tokens=max_tokens)


def completion_spec(model: str = "normal", max_tokens: int = 8) -> RequestSpec:
    return RequestSpec("completions", model, prompt=[1, 2, 3, 4], max_tokens=max_tokens)


# -- client edge cases --------------------------------------------------------------------------
def test_role_only_first_chunk_is_not_the_first_token(fake_url: str) -> None:
    result = send(fake_url, chat_spec())
    assert result.ok
    # the role chunk comes at once, the first token only after the fake prefill: measured as the gap
    # between the two (a sleep is a lower bound, so this holds however loaded the machine is)
    assert result.ttft_s - result.first_chunk_s >= FAKE_TTFT_S * 0.9
    assert result.ttft_s >= FAKE_TTFT_S * 0.9  # the first token only after the fake prefill
    assert result.output_tokens == 8 and result.counted_tokens == 8
    assert len(result.chunk_gaps_s) == 7 and result.chunk_tokens == [1] * 7


def test_completion_timings_and_decode_rate(fake_url: str) -> None:
    result = send(fake_url, completion_spec(max_tokens=11))
    assert result.ok and result.token_count_source == "continuous_usage"
    assert result.usage_prompt_tokens == 4 and result.output_tokens == 11
    # 10 gaps of >= 10 ms: decode <= 100 tok/s and (n_out - 1) / (t_last - t_first) exactly.
    span = result.t_last_token - result.t_first_token
    assert result.decode_tok_s == pytest.approx(10 / span)
    # a late first chunk under load shortens the span it is measured over: bounded loosely, not timed
    assert result.decode_tok_s <= 1 / FAKE_TOKEN_GAP_S * 1.5
    assert result.tpot_s == pytest.approx((result.e2e_s - result.ttft_s) / 10)
    assert sum(result.chunk_gaps_s) == pytest.approx(span)


def test_disconnect_mid_stream_is_a_failed_sample(fake_url: str) -> None:
    result = send(fake_url, completion_spec("disconnect"))
    assert not result.ok and result.error_kind == ERROR_DISCONNECT
    assert result.ttft_s is not None  # what was measured before the cut is kept
    assert result.counted_tokens == DISCONNECT_AFTER_TOKENS


def test_http_500_is_a_failed_sample(fake_url: str) -> None:
    result = send(fake_url, completion_spec("http-500"))
    assert not result.ok and result.error_kind == ERROR_HTTP and result.http_status == 500
    assert "boom" in result.error


def test_timeout_is_a_failed_sample(fake_url: str) -> None:
    started = time.perf_counter()
    result = send(fake_url, completion_spec("hang"), request_timeout_s=0.3)
    assert not result.ok and result.error_kind == ERROR_TIMEOUT
    assert time.perf_counter() - started < 5


def test_refused_connection_is_a_failed_sample() -> None:
    result = send(f"http://127.0.0.1:{pick_free_port()}", completion_spec())
    assert not result.ok and result.error_kind == ERROR_CONNECT


def test_probe_falls_back_when_continuous_usage_is_rejected(fake_url: str) -> None:
    async def go() -> StreamOptions:
        async with StreamingClient(fake_url) as client:
            return await probe_stream_options(client, completion_spec("reject-continuous", 2))

    assert asyncio.run(go()) == StreamOptions(include_usage=True, continuous_usage_stats=False)


def test_without_usage_tokens_are_counted_per_chunk(fake_url: str) -> None:
    result = send(fake_url, completion_spec("no-usage", 6))
    assert result.ok and result.token_count_source == "chunks"
    assert result.usage_completion_tokens is None and result.output_tokens == 6


def test_stream_timer_with_multi_token_chunks() -> None:
    """Continuous usage with 1, then 3, then 2 tokens per chunk (speculative-decoding style)."""
    timer = StreamTimer("completions", t_send=0.0)
    for now, text, total in ((0.5, "a", 1), (0.7, "bcd", 4), (0.9, "ef", 6)):
        chunk = completion_chunk(text) | {"usage": usage(10, total)}
        timer.feed_line("data: " + json.dumps(chunk), now)
    timer.feed_line("data: [DONE]", 1.0)
    result = timer.finish()
    assert result.ttft_s == 0.5 and result.first_chunk_tokens == 1
    assert result.chunk_tokens == [3, 2]
    assert result.chunk_gaps_s == pytest.approx([0.2, 0.2])
    assert result.decode_tok_s == pytest.approx(5 / 0.4)  # (n_out - 1) / (t_last - t_first)


def test_stream_timer_counts_an_empty_text_token_under_continuous_usage() -> None:
    """A token that decodes to no text yet (half a UTF-8 character) is still generated output."""
    timer = StreamTimer("completions", t_send=0.0)
    timer.feed_line("data: " + json.dumps(completion_chunk("") | {"usage": usage(3, 1)}), 0.3)
    timer.feed_line("data: [DONE]", 0.4)
    assert timer.finish().ttft_s == 0.3


# -- runner against the fake server -------------------------------------------------------------
def test_prometheus_parsing_and_deltas() -> None:
    text = (
        "# HELP x\n"
        'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 5.0\n'
        'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 20.0\n'
        'vllm:prefix_cache_queries_created{engine="0"} 1.7e9\n'
        'vllm:request_queue_time_seconds_sum{engine="0"} 0.5\n'
        'vllm:request_queue_time_seconds_count{engine="0"} 2.0\n'
    )
    after = parse_prometheus(text)
    assert after == {"prefix_cache_hits": 5.0, "prefix_cache_queries": 20.0, "queue_time_s_sum": 0.5, "queue_time_count": 2.0}
    delta = metrics_delta({"prefix_cache_hits": 1.0, "prefix_cache_queries": 4.0, "queue_time_s_sum": 0.1, "queue_time_count": 1.0}, after)
    assert delta["prefix_cache_hit_rate"] == pytest.approx(4 / 16)
    assert delta["mean_queue_time_s"] == pytest.approx(0.4)


def read_lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_run_counts_http_errors_and_keeps_going(fake_url: str, tmp_path: Path) -> None:
    """flaky-500 fails every third request: the run finishes, and failures are samples too."""
    config = BenchConfig(
        base_url=fake_url,
        model="flaky-500",
        out_dir=tmp_path / "run",
        shapes=[Shape(12, 4), Shape(40, 4)],
        points=[LoadPoint("sequential", concurrency=1)],
        warmups=1,
        samples=4,
    )
    outcome = asyncio.run(run_bench(config))
    lines = read_lines(tmp_path / "run" / "samples.jsonl")
    assert len(lines) == outcome.requests == 10
    assert outcome.failed == sum(not s["ok"] for s in lines) > 0
    assert {s["error_kind"] for s in lines if not s["ok"]} == {"http"}
    assert all(s["prompt_tokens"] == int(s["shape"][1:].split("-")[0]) for s in lines)
    assert len({s["prompt_fingerprint"] for s in lines}) == len(lines)  # every prompt unique
    assert sum(s["warmup"] for s in lines) == 2


def test_chat_prompts_hit_the_exact_token_count(fake_url: str, tmp_path: Path) -> None:
    config = BenchConfig(
        base_url=fake_url,
        model="role-first",
        out_dir=tmp_path / "chat",
        shapes=[Shape(50, 3), Shape(300, 3)],
        points=[LoadPoint("concurrency", concurrency=2)],
        warmups=0,
        samples=3,
        endpoint="chat",
    )
    asyncio.run(run_bench(config))
    lines = read_lines(tmp_path / "chat" / "samples.jsonl")
    assert all(s["ok"] for s in lines)
    assert sorted(s["prompt_tokens"] for s in lines if not s["warmup"]) == [50] * 3 + [300] * 3
    assert all(s["server_prompt_tokens"] == s["prompt_tokens"] for s in lines)
    assert all(s["ttft_s"] > s["first_chunk_s"] for s in lines)


# -- standalone fake server, for tests that must kill it ----------------------------------------
def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description="Fake OpenAI-compatible SSE server for fp4forge bench tests")
    parser.add_argument("--serve", action="store_true", required=True)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--ttft", type=float, default=FAKE_TTFT_S)
    parser.add_argument("--token-gap", type=float, default=FAKE_TOKEN_GAP_S)
    args = parser.parse_args(argv)
    asyncio.run(serve_forever(args.port or pick_free_port(), args.ttft, args.token_gap))


if __name__ == "__main__":
    main(sys.argv[1:])
