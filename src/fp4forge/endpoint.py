"""The one client of OpenAI-compatible servers (vLLM and anything that speaks its API).

Every URL fp4forge sends a request to is built here: ``Endpoint`` normalises what a user typed
(``http://host:8000``, ``…/`` or ``…/v1`` are the same server), knows the paths (``/v1/models``,
``/v1/completions``, ``/v1/chat/completions``, vLLM's ``/tokenize``, ``/version``, ``/metrics``,
``/health``), and turns every failure into one of the named ``EndpointError`` kinds of
``fp4forge.errors`` through one mapping (``transport_error`` for the network, ``status_error``
for an HTTP status, ``EndpointProtocolError`` for a body that is not JSON). Callers decide what a
failure means for them (bench counts it in a sample, quality records it in a transcript, serve
keeps polling); none of them sees an ``httpx`` exception.

Plain calls are synchronous (``Endpoint``); so is ``Endpoint.stream_lines``, the quality
runner's streamed chat (its scenario threads read each answer whole). The benchmark's streamed
calls are asynchronous (``AsyncSession``, one pooled connection set for many concurrent
requests), because it holds many requests in flight and times each chunk's arrival itself.

Connections never go through a proxy from the environment (``trust_env=False``): the servers
measured here are on loopback or a lab network, and a proxy would sit inside every timing.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import AsyncIterator, Iterator, Mapping
from typing import Any, Literal

import httpx

from fp4forge.errors import (
    EndpointDisconnected,
    EndpointError,
    EndpointProtocolError,
    EndpointStatusError,
    EndpointTimeout,
    EndpointUnreachable,
)

API_PREFIX = "/v1"
MODELS_PATH = "/v1/models"
COMPLETIONS_PATH = "/v1/completions"
CHAT_PATH = "/v1/chat/completions"
TOKENIZE_PATH = "/tokenize"  # vLLM's, at the server root (not under /v1)
VERSION_PATH = "/version"
METRICS_PATH = "/metrics"
HEALTH_PATH = "/health"
LOOPBACK_HOST = "127.0.0.1"
# The base URL of a run played without any server (a scripted agent answers): never contacted;
# ".invalid" cannot resolve (RFC 6761).
NO_SERVER_URL = "http://no-server.invalid"

GenerationKind = Literal["completions", "chat"]
GENERATION_PATHS: dict[str, str] = {"completions": COMPLETIONS_PATH, "chat": CHAT_PATH}
ERROR_BODY_CHARS = 300  # of an error body kept in messages, samples and transcripts
DEFAULT_TIMEOUT_S = 600.0


# -- URLs ---------------------------------------------------------------------------------------
def server_root(url: str) -> str:
    """``http://host:8000`` from ``http://host:8000``, ``…/`` or ``…/v1`` (what users paste)."""
    root = url.rstrip("/")
    if root.endswith(API_PREFIX):
        root = root[: -len(API_PREFIX)].rstrip("/")
    return root


def loopback_url(port: int, host: str = LOOPBACK_HOST) -> str:
    """The root of a server this machine started on ``port``."""
    return f"http://{host}:{port}"


def api_url(url: str) -> str:
    """The OpenAI API root (``…/v1``), what OpenAI clients call ``base_url``."""
    return f"{server_root(url)}{API_PREFIX}"


# -- the one error mapping ----------------------------------------------------------------------
def transport_error(error: httpx.HTTPError, url: str) -> EndpointError:
    """The named error for an ``httpx`` failure on ``url`` (status errors: ``status_error``)."""
    message = f"{url}: {type(error).__name__}: {error}"
    if isinstance(error, httpx.TimeoutException):  # connect timeouts included: nothing answered in time
        return EndpointTimeout(message, url=url, cause=error)
    if isinstance(error, httpx.ConnectError):
        return EndpointUnreachable(message, url=url, cause=error)
    return EndpointDisconnected(message, url=url, cause=error)


def status_error(url: str, status: int, body: str) -> EndpointStatusError:
    return EndpointStatusError(f"{url}: HTTP {status}: {body[:ERROR_BODY_CHARS]}", url=url, status=status, body=body)


def _json_of(response: httpx.Response, url: str) -> Any:
    if response.status_code >= 400:
        raise status_error(url, response.status_code, response.text)
    try:
        return response.json()
    except ValueError as error:
        text = response.text
        raise EndpointProtocolError(f"{url}: the answer is not JSON: {text[:120]!r}", url=url, status=response.status_code,
                                    body=text, cause=error) from error


# -- plain (synchronous) calls ------------------------------------------------------------------
class Endpoint:
    """One OpenAI-compatible server (and, optionally, the model asked for on it).

    ``http``: an ``httpx.Client`` to send through (shared by several endpoints, or a test's mock
    transport); without one the endpoint opens its own on first use and ``close()`` closes it.
    """

    def __init__(self, url: str, model: str | None = None, label: str = "A", *, timeout_s: float = DEFAULT_TIMEOUT_S,
                 http: httpx.Client | None = None, api_key: str | None = None) -> None:
        self.url = url  # as given, for reports
        self.root = server_root(url)
        self.model = model
        self.label = label
        self.timeout_s = timeout_s
        self.api_key = api_key
        self._http = http
        self._owns_http = http is None
        self._opening = threading.Lock()  # quality runs scenarios on threads that share one pool

    def __repr__(self) -> str:
        return f"Endpoint({self.root!r}, model={self.model!r}, label={self.label!r})"

    def describe(self) -> dict[str, Any]:
        """What a report records about the endpoint."""
        return {"base_url": self.url, "model": self.model, "label": self.label}

    def via(self, http: httpx.Client | None) -> Endpoint:
        """The same endpoint sending through ``http`` (a pool shared by several endpoints); self for None."""
        if http is None or http is self._http:
            return self
        return Endpoint(self.url, self.model, self.label, timeout_s=self.timeout_s, http=http, api_key=self.api_key)

    def url_of(self, path: str) -> str:
        return f"{self.root}{path}"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    # -- connection -------------------------------------------------------------------------------
    @property
    def http(self) -> httpx.Client:
        with self._opening:
            if self._http is None:
                self._http = httpx.Client(timeout=self.timeout_s, trust_env=False, headers=self.headers)
            return self._http

    def close(self) -> None:
        if self._owns_http and self._http is not None:
            self._http.close()
            self._http = None

    def __enter__(self) -> Endpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- requests ---------------------------------------------------------------------------------
    def get(self, path: str, *, timeout_s: float | None = None) -> httpx.Response:
        """The raw answer to ``GET path`` (any status); network failures raise ``EndpointError``."""
        url = self.url_of(path)
        try:
            return self.http.get(url, timeout=timeout_s or self.timeout_s)
        except httpx.HTTPError as error:
            raise transport_error(error, url) from error

    def get_json(self, path: str, *, timeout_s: float | None = None) -> Any:
        return _json_of(self.get(path, timeout_s=timeout_s), self.url_of(path))

    def post_json(self, path: str, body: Mapping[str, Any], *, timeout_s: float | None = None) -> Any:
        """``POST path`` with a JSON body; the parsed JSON answer, or an ``EndpointError``."""
        url = self.url_of(path)
        try:
            response = self.http.post(url, json=dict(body), timeout=timeout_s or self.timeout_s)
        except httpx.HTTPError as error:
            raise transport_error(error, url) from error
        return _json_of(response, url)

    # -- what the server says about itself --------------------------------------------------------
    def models(self, *, timeout_s: float = 30.0) -> list[dict[str, Any]]:
        """The model cards of ``/v1/models`` (``EndpointProtocolError`` when it is not a model list)."""
        doc = self.get_json(MODELS_PATH, timeout_s=timeout_s)
        cards = doc.get("data", []) if isinstance(doc, dict) else None
        if not isinstance(cards, list):
            url = self.url_of(MODELS_PATH)
            raise EndpointProtocolError(f"{url}: not a model list", url=url, body=json.dumps(doc)[:ERROR_BODY_CHARS])
        return [card for card in cards if isinstance(card, dict)]

    def model_card(self, name: str | None = None, *, timeout_s: float = 30.0) -> dict[str, Any] | None:
        """The card of ``name`` (default: this endpoint's model), None when it is not served."""
        name = name or self.model
        return next((card for card in self.models(timeout_s=timeout_s) if card.get("id") == name), None)

    def lists_model(self, name: str | None = None, *, timeout_s: float | None = None) -> bool:
        """Whether ``/v1/models`` lists ``name`` right now; False for anything else (a readiness poll)."""
        try:
            return self.model_card(name, timeout_s=timeout_s or self.timeout_s) is not None
        except EndpointError:
            return False

    def version(self, *, timeout_s: float = 10.0) -> str | None:
        """vLLM's ``/version``; None where the server has none (not every server does)."""
        try:
            doc = self.get_json(VERSION_PATH, timeout_s=timeout_s)
        except EndpointError:
            return None
        return doc.get("version") if isinstance(doc, dict) else None

    def metrics_text(self, *, timeout_s: float | None = None) -> str | None:
        """Prometheus text of ``/metrics``; None when the server does not offer it."""
        try:
            response = self.get(METRICS_PATH, timeout_s=timeout_s)
        except EndpointError:
            return None
        return response.text if response.status_code == 200 else None

    def tokenize(self, body: Mapping[str, Any], *, timeout_s: float | None = None) -> dict[str, Any]:
        """vLLM's ``POST /tokenize`` (``prompt`` or ``messages``); the model is this endpoint's."""
        doc = self.post_json(TOKENIZE_PATH, {"model": self.model, **body}, timeout_s=timeout_s)
        if not isinstance(doc, dict):
            url = self.url_of(TOKENIZE_PATH)
            raise EndpointProtocolError(f"{url}: not a tokenize answer", url=url, body=json.dumps(doc)[:ERROR_BODY_CHARS])
        return doc

    # -- generation -------------------------------------------------------------------------------
    def chat(self, body: Mapping[str, Any], *, timeout_s: float | None = None) -> Any:
        """One non-streamed ``/v1/chat/completions`` answer (parsed JSON)."""
        return self.post_json(CHAT_PATH, body, timeout_s=timeout_s)

    def complete(self, body: Mapping[str, Any], *, timeout_s: float | None = None) -> Any:
        """One non-streamed ``/v1/completions`` answer (parsed JSON)."""
        return self.post_json(COMPLETIONS_PATH, body, timeout_s=timeout_s)

    @contextlib.contextmanager
    def stream_lines(self, kind: GenerationKind, body: Mapping[str, Any], *,
                     timeout_s: float | None = None) -> Iterator[Iterator[str]]:
        """``POST`` a streamed completion (``kind``: completions or chat); yields its body's lines.

        The synchronous twin of ``AsyncSession.stream``: a status >= 400 raises
        ``EndpointStatusError`` with the body read in full; a network failure while connecting or
        reading raises the mapped ``EndpointError``; anything else passes through untouched.
        """
        url = self.url_of(GENERATION_PATHS[kind])
        try:
            with self.http.stream("POST", url, json=dict(body), timeout=timeout_s or self.timeout_s) as response:
                if response.status_code >= 400:
                    raise status_error(url, response.status_code, response.read().decode("utf-8", "replace"))
                yield response.iter_lines()
        except httpx.HTTPError as error:
            raise transport_error(error, url) from error

    def unreachable_reason(self, *, timeout_s: float = 5.0) -> str | None:
        """None when the server answers HTTP at all (even 404 on ``/health``), else why it does not."""
        try:
            self.get(HEALTH_PATH, timeout_s=timeout_s)
        except EndpointError as error:
            return _cause_text(error)
        return None

    def session(self, *, max_connections: int = 256, request_timeout_s: float | None = None,
                connect_timeout_s: float = 10.0) -> AsyncSession:
        """A pooled asynchronous connection set to this server, for streamed and concurrent calls."""
        return AsyncSession(self, max_connections=max_connections, request_timeout_s=request_timeout_s or self.timeout_s,
                            connect_timeout_s=connect_timeout_s)


def _cause_text(error: EndpointError) -> str:
    cause = error.cause
    if cause is None:
        return error.message
    return f"{type(cause).__name__}: {cause}" if str(cause) else type(cause).__name__


# -- streamed (asynchronous) calls --------------------------------------------------------------
class AsyncSession:
    """Many concurrent requests to one ``Endpoint`` through one connection pool."""

    def __init__(self, endpoint: Endpoint, *, max_connections: int, request_timeout_s: float, connect_timeout_s: float) -> None:
        self.endpoint = endpoint
        self._http = httpx.AsyncClient(
            base_url=endpoint.root,
            headers=endpoint.headers,
            timeout=httpx.Timeout(request_timeout_s, connect=connect_timeout_s),
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
            trust_env=False,
        )

    async def __aenter__(self) -> AsyncSession:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    @contextlib.asynccontextmanager
    async def stream(self, kind: GenerationKind, body: Mapping[str, Any], *,
                     headers: Mapping[str, str] | None = None) -> AsyncIterator[AsyncIterator[str]]:
        """``POST`` a streamed completion (``kind``: completions or chat); yields its body's lines.

        A status >= 400 raises ``EndpointStatusError`` with the body read in full; a network
        failure while connecting or reading the lines raises the mapped ``EndpointError``.
        Anything else raised inside the ``async with`` (the caller's own checks, cancellation)
        passes through untouched.
        """
        path = GENERATION_PATHS[kind]
        url = self.endpoint.url_of(path)
        try:
            async with self._http.stream("POST", path, json=dict(body), headers=dict(headers or {})) as response:
                if response.status_code >= 400:
                    text = (await response.aread()).decode("utf-8", "replace")
                    raise status_error(url, response.status_code, text)
                yield response.aiter_lines()
        except httpx.HTTPError as error:
            raise transport_error(error, url) from error

    async def get_text(self, path: str) -> str | None:
        """The body of a 200 answer to ``GET path``; None for any other status or a network failure."""
        try:
            response = await self._http.get(path)
        except httpx.HTTPError:
            return None
        return response.text if response.status_code == 200 else None

    async def unreachable_reason(self, *, timeout_s: float = 5.0) -> str | None:
        """None when the server root answers HTTP at all (even 404), else why it does not.

        A fresh connection, not the pool's: a pooled keep-alive connection can outlive the server.
        """
        url = self.endpoint.url_of(HEALTH_PATH)
        try:
            async with httpx.AsyncClient(timeout=timeout_s, trust_env=False) as http:
                await http.get(url)
        except httpx.HTTPError as error:
            return _cause_text(transport_error(error, url))
        return None
