"""A real HTTP server on loopback that serves local directories the way the Hugging Face Hub
does: `/<org>/<name>/resolve/<rev>/<file>` with HTTP Range support (Starlette's FileResponse,
run by uvicorn), and `/<org>/<name>/raw/<rev>/<file>` returning a git-LFS pointer for large
files, as the Hub's `/raw/` does. Used by the remote-mode tests; not part of fp4forge."""

from __future__ import annotations

import hashlib
import socket
import threading
import time
from pathlib import Path

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import FileResponse, PlainTextResponse, Response
from starlette.routing import Route

LFS_SUFFIXES = (".safetensors", ".json")


def lfs_pointer(path: Path) -> str:
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{digest}\nsize {path.stat().st_size}\n"


class RepoServer:
    """Serve `repos[repo_id] = directory` on 127.0.0.1; counts body bytes sent."""

    def __init__(self, repos: dict[str, Path]):
        self.repos = repos
        self.requests: list[tuple[str, str, str | None]] = []
        self.bytes_sent = 0  # response body bytes, for "what did a remote read cost"
        self.port = _free_port()
        app = Starlette(routes=[Route("/{org}/{name}/{kind}/{rev}/{path:path}", self._serve, methods=["GET", "HEAD"])])
        self._server = uvicorn.Server(uvicorn.Config(self._counting(app), host="127.0.0.1", port=self.port, log_level="warning"))
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _counting(self, app):
        async def counted(scope, receive, send):
            async def counting_send(message):
                if message["type"] == "http.response.body":
                    self.bytes_sent += len(message.get("body", b""))
                await send(message)

            await app(scope, receive, counting_send)

        return counted

    async def _serve(self, request: Request) -> Response:
        repo = f"{request.path_params['org']}/{request.path_params['name']}"
        kind, rel = request.path_params["kind"], request.path_params["path"]
        self.requests.append((request.method, request.url.path, request.headers.get("range")))
        root = self.repos.get(repo)
        if root is None or ".." in rel.split("/"):
            return PlainTextResponse("Repository not found", status_code=404)
        path = root / rel
        if not path.is_file():
            return PlainTextResponse("Entry not found", status_code=404)
        if kind == "raw" and path.name.endswith(LFS_SUFFIXES):
            return PlainTextResponse(lfs_pointer(path))
        if kind not in ("resolve", "raw"):
            return PlainTextResponse("Not found", status_code=404)
        return FileResponse(path)

    def __enter__(self) -> RepoServer:
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("loopback HTTP server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
