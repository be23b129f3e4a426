"""`fp4forge.endpoint` against a real loopback HTTP server (Starlette under uvicorn in a thread).

The fake speaks just enough of vLLM's OpenAI surface to pin the client's contract: URL
normalisation (root, trailing slash, ``/v1``: one server), every failure mapped to its named
``EndpointError`` kind (a status with its body, a non-JSON body, a refused connection, a timeout,
a connection cut mid-stream), and streamed chunks arriving as lines in the order sent.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from fp4forge.endpoint import Endpoint, api_url, loopback_url, server_root
from fp4forge.errors import (
    EndpointDisconnected,
    EndpointError,
    EndpointProtocolError,
    EndpointStatusError,
    EndpointTimeout,
    EndpointUnreachable,
    Fp4forgeError,
)

MODEL = "tiny"
CHUNKS = ["a", "b", "c"]


# -- the fake server ----------------------------------------------------------------------------
class Recorder:
    """What the server saw: (method, path, JSON body) per request."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str, Any]] = []


def make_app(recorder: Recorder) -> Starlette:
    async def record(request: Request) -> Any:
        body = await request.body()
        doc = json.loads(body) if body else None
        recorder.requests.append((request.method, request.url.path, doc))
        return doc

    async def models(request: Request) -> Response:
        await record(request)
        return JSONResponse({"object": "list", "data": [{"id": MODEL, "max_model_len": 2048, "root": "/m"}]})

    async def version(request: Request) -> Response:
        return JSONResponse({"version": "0.0-fake"})

    async def tokenize(request: Request) -> Response:
        doc = await record(request)
        if doc.get("model") != MODEL:
            return JSONResponse({"error": f"model {doc.get('model')} not found"}, status_code=404)
        return JSONResponse({"tokens": [len(word) for word in doc["prompt"].split()], "count": len(doc["prompt"].split())})

    async def completions(request: Request) -> Response:
        doc = await record(request)
        behaviour = doc["model"]
        if behaviour == "boom":
            return PlainTextResponse("boom: the engine is dead", status_code=500)
        if behaviour == "html":
            return PlainTextResponse("<html>not json</html>")
        if behaviour == "slow":
            await asyncio.sleep(2.0)
        if doc.get("stream"):
            return StreamingResponse(stream(behaviour), media_type="text/event-stream")
        return JSONResponse({"choices": [{"text": "".join(CHUNKS), "finish_reason": "length"}]})

    async def chat(request: Request) -> Response:
        doc = await record(request)
        if doc.get("stream"):
            return StreamingResponse(stream("chat"), media_type="text/event-stream")
        return JSONResponse({"choices": [{"message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}]})

    async def stream(behaviour: str) -> AsyncIterator[bytes]:
        for index, text in enumerate(CHUNKS):
            if behaviour == "cut" and index == 1:
                raise RuntimeError("the fake server dies mid-stream")
            field = {"delta": {"content": text}} if behaviour == "chat" else {"text": text}
            yield f"data: {json.dumps({'choices': [field]})}\n\n".encode()
            await asyncio.sleep(0.01)
        yield b"data: [DONE]\n\n"

    return Starlette(routes=[
        Route("/v1/models", models),
        Route("/version", version),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat, methods=["POST"]),
    ])


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, Recorder]]:
    recorder = Recorder()
    port = free_port()
    uv = uvicorn.Server(uvicorn.Config(make_app(recorder), host="127.0.0.1", port=port, log_level="critical"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not uv.started:
        assert time.monotonic() < deadline, "loopback server did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}", recorder
    uv.should_exit = True
    thread.join(timeout=10)


# -- URLs ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("typed", ["http://h:8000", "http://h:8000/", "http://h:8000/v1", "http://h:8000/v1/", "http://h:8000//"])
def test_every_spelling_of_a_server_is_one_root(typed: str) -> None:
    assert server_root(typed) == "http://h:8000"
    endpoint = Endpoint(typed, MODEL)
    assert endpoint.root == "http://h:8000"
    assert endpoint.url_of("/v1/models") == "http://h:8000/v1/models"
    assert api_url(typed) == "http://h:8000/v1"
    assert endpoint.describe() == {"base_url": typed, "model": MODEL, "label": "A"}  # reports keep what the user typed


def test_a_path_that_merely_ends_in_v1_letters_is_kept() -> None:
    assert server_root("http://h:8000/apiv1") == "http://h:8000/apiv1"  # only a whole /v1 segment is the API prefix
    assert server_root("http://h:8000/proxy/v1") == "http://h:8000/proxy"
    assert loopback_url(8123) == "http://127.0.0.1:8123"


def test_the_v1_spelling_reaches_the_same_server(server: tuple[str, Recorder]) -> None:
    url, recorder = server
    with Endpoint(f"{url}/v1/", MODEL) as endpoint:
        cards = endpoint.models()
        assert [c["id"] for c in cards] == [MODEL]
        assert endpoint.model_card()["max_model_len"] == 2048
        assert endpoint.lists_model() and not endpoint.lists_model("other")
        assert endpoint.version() == "0.0-fake"
        assert endpoint.metrics_text() is None  # no /metrics on this server: None, not an error
    assert ("GET", "/v1/models", None) in recorder.requests


# -- plain calls --------------------------------------------------------------------------------
def test_tokenize_sends_the_endpoint_model(server: tuple[str, Recorder]) -> None:
    url, recorder = server
    with Endpoint(url, MODEL) as endpoint:
        doc = endpoint.tokenize({"prompt": "one three seven", "add_special_tokens": False})
    assert doc["tokens"] == [3, 5, 5] and doc["count"] == 3
    method, path, body = recorder.requests[-1]
    assert (method, path) == ("POST", "/tokenize")
    assert body == {"model": MODEL, "prompt": "one three seven", "add_special_tokens": False}


def test_completion_and_chat_answers(server: tuple[str, Recorder]) -> None:
    url, _ = server
    with Endpoint(url, MODEL) as endpoint:
        assert endpoint.complete({"model": MODEL, "prompt": [1, 2]})["choices"][0]["text"] == "abc"
        assert endpoint.chat({"model": MODEL, "messages": []})["choices"][0]["message"]["content"] == "hi"


def test_http_status_is_a_status_error_with_the_body(server: tuple[str, Recorder]) -> None:
    url, _ = server
    with Endpoint(url, "boom") as endpoint, pytest.raises(EndpointStatusError) as caught:
        endpoint.complete({"model": "boom", "prompt": [1]})
    error = caught.value
    assert error.kind == "http" and error.status == 500 and error.body == "boom: the engine is dead"
    assert error.url == f"{url}/v1/completions"
    assert str(error) == f"{url}/v1/completions: HTTP 500: boom: the engine is dead"
    assert isinstance(error, Fp4forgeError)  # the CLI shows it as one line with an exit code


def test_a_404_on_tokenize_is_a_status_error(server: tuple[str, Recorder]) -> None:
    url, _ = server
    with Endpoint(url, "unknown-model") as endpoint, pytest.raises(EndpointStatusError) as caught:
        endpoint.tokenize({"prompt": "x"})
    assert caught.value.status == 404 and "not found" in caught.value.body


def test_a_body_that_is_not_json_is_a_protocol_error(server: tuple[str, Recorder]) -> None:
    url, _ = server
    with Endpoint(url, "html") as endpoint, pytest.raises(EndpointProtocolError) as caught:
        endpoint.complete({"model": "html", "prompt": [1]})
    assert caught.value.kind == "protocol" and caught.value.body == "<html>not json</html>"
    assert isinstance(caught.value.cause, ValueError)


def test_nothing_listening_is_unreachable() -> None:
    url = loopback_url(free_port())
    with Endpoint(url, MODEL) as endpoint:
        with pytest.raises(EndpointUnreachable) as caught:
            endpoint.models()
        assert caught.value.kind == "connect" and caught.value.url == f"{url}/v1/models"
        assert not endpoint.lists_model()  # a readiness poll reads "not yet", never raises
        assert endpoint.version() is None
        assert endpoint.unreachable_reason(timeout_s=2.0) is not None


def test_a_slow_answer_is_a_timeout(server: tuple[str, Recorder]) -> None:
    url, _ = server
    with Endpoint(url, "slow", timeout_s=0.3) as endpoint, pytest.raises(EndpointTimeout) as caught:
        endpoint.complete({"model": "slow", "prompt": [1]})
    assert caught.value.kind == "timeout"


def test_every_failure_is_one_endpoint_error_kind() -> None:
    kinds = {cls.kind for cls in (EndpointUnreachable, EndpointTimeout, EndpointDisconnected, EndpointStatusError, EndpointProtocolError)}
    assert kinds == {"connect", "timeout", "disconnect", "http", "protocol"}
    assert all(issubclass(cls, EndpointError) for cls in (EndpointUnreachable, EndpointTimeout, EndpointDisconnected,
                                                         EndpointStatusError, EndpointProtocolError))


# -- streamed calls -----------------------------------------------------------------------------
async def _stream_lines(url: str, kind: str, model: str) -> list[str]:
    endpoint = Endpoint(url, model)
    async with endpoint.session(max_connections=4) as session:
        async with session.stream(kind, {"model": model, "stream": True, "prompt": [1], "messages": []}) as lines:  # type: ignore[arg-type]
            return [line async for line in lines if line]


def _data(lines: list[str]) -> list[Any]:
    return [line[len("data: "):] if line.endswith("[DONE]") else json.loads(line[len("data: "):]) for line in lines]


def test_streamed_completion_chunks_arrive_in_order(server: tuple[str, Recorder]) -> None:
    url, _ = server
    data = _data(asyncio.run(_stream_lines(f"{url}/v1", "completions", MODEL)))
    assert [d["choices"][0]["text"] for d in data[:-1]] == CHUNKS and data[-1] == "[DONE]"


def test_streamed_chat_chunks_arrive_in_order(server: tuple[str, Recorder]) -> None:
    url, recorder = server
    data = _data(asyncio.run(_stream_lines(url, "chat", MODEL)))
    assert [d["choices"][0]["delta"]["content"] for d in data[:-1]] == CHUNKS and data[-1] == "[DONE]"
    assert recorder.requests[-1][1] == "/v1/chat/completions"


def test_a_streamed_status_error_carries_the_body(server: tuple[str, Recorder]) -> None:
    url, _ = server
    with pytest.raises(EndpointStatusError) as caught:
        asyncio.run(_stream_lines(url, "completions", "boom"))
    assert caught.value.status == 500 and caught.value.body == "boom: the engine is dead"


def test_a_stream_cut_mid_way_is_a_disconnect(server: tuple[str, Recorder]) -> None:
    url, _ = server
    received: list[str] = []

    async def go() -> None:
        async with Endpoint(url, "cut").session() as session:
            async with session.stream("completions", {"model": "cut", "stream": True, "prompt": [1]}) as lines:
                async for line in lines:
                    if line:
                        received.append(line)

    with pytest.raises(EndpointDisconnected) as caught:
        asyncio.run(go())
    assert caught.value.kind == "disconnect"
    assert len(received) == 1  # the chunk before the cut arrived, and was handed over


def test_a_streamed_call_to_nothing_is_unreachable() -> None:
    with pytest.raises(EndpointUnreachable):
        asyncio.run(_stream_lines(loopback_url(free_port()), "completions", MODEL))


def test_an_error_raised_by_the_caller_inside_the_stream_passes_through(server: tuple[str, Recorder]) -> None:
    url, _ = server

    class Mine(Exception):
        pass

    async def go() -> None:
        async with Endpoint(url, MODEL).session() as session:
            async with session.stream("completions", {"model": MODEL, "stream": True, "prompt": [1]}) as lines:
                async for _ in lines:
                    raise Mine

    with pytest.raises(Mine):
        asyncio.run(go())
