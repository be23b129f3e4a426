"""Remote checkpoints over HTTP: all of fp4forge's network I/O lives here.

Headers are fetched with HTTP Range requests (the first 100 kB, then the rest of the header
if it is longer, as huggingface_hub's `parse_safetensors_file_metadata` does), so auditing
a 64 GiB checkpoint costs a few megabytes. Hugging Face repo ids resolve through
huggingface_hub (endpoint, revision, token); any `https://…/resolve/<rev>` base works too.
A git-LFS pointer (what `/raw/` URLs return) is recognised and named, not parsed as data.
"""

from __future__ import annotations

import threading

import httpx

from fp4forge.checkpoint.safetensors_format import (
    LENGTH_PREFIX_BYTES,
    ShardHeader,
    header_length,
    parse_header,
)
from fp4forge.checkpoint.source import check_file_size, check_relpath
from fp4forge.errors import CheckpointError, RemoteError

FIRST_RANGE_BYTES = 100_000
TIMEOUT = httpx.Timeout(30.0, connect=10.0)


class RemoteSource:
    is_remote = True

    def __init__(self, base_url: str, *, headers: dict[str, str] | None = None):
        self.base_url = base_url.rstrip("/") + "/"
        self.display = base_url
        self._headers = dict(headers or {})
        self._client = httpx.Client(follow_redirects=True, timeout=TIMEOUT, headers=self._headers)
        self._sizes: dict[str, int] = {}
        self._lock = threading.Lock()
        self.bytes_fetched = 0  # body bytes received, for reporting what an audit cost

    @classmethod
    def for_repo(cls, repo_id: str, revision: str = "main") -> RemoteSource:
        from huggingface_hub import hf_hub_url
        from huggingface_hub.utils import build_hf_headers

        base = hf_hub_url(repo_id, "x", revision=revision)[: -len("x")]
        source = cls(base, headers=build_hf_headers())
        source.display = f"{repo_id}@{revision}"
        return source

    def url(self, relpath: str) -> str:
        return self.base_url + check_relpath(relpath)

    def describe(self, relpath: str) -> str:
        return self.url(relpath)

    def _get(self, relpath: str, start: int, length: int | None) -> tuple[bytes, int | None]:
        """GET a byte range; returns the bytes and the full file size when the server says it.

        Streams the body and stops reading after the range, so a server that ignores Range
        never makes us download a whole shard."""
        url = self.url(relpath)
        headers = {"Accept-Encoding": "identity"}
        if start or length is not None:
            end = "" if length is None else str(start + length - 1)
            headers["Range"] = f"bytes={start}-{end}"
        try:
            with self._client.stream("GET", url, headers=headers) as resp:
                if resp.status_code == 404:
                    raise CheckpointError("not found (HTTP 404)", file=url)
                if resp.status_code == 416:
                    return b"", _total_from_content_range(resp.headers.get("content-range"))
                if resp.status_code not in (200, 206):
                    raise RemoteError(f"HTTP {resp.status_code} {resp.reason_phrase}", file=url)
                total = _total_from_content_range(resp.headers.get("content-range"))
                skip = start if resp.status_code == 200 else 0
                if resp.status_code == 200 and resp.headers.get("content-length"):
                    total = int(resp.headers["content-length"])
                want = None if length is None else skip + length
                chunks, got = [], 0
                for chunk in resp.iter_bytes():
                    chunks.append(chunk)
                    got += len(chunk)
                    if want is not None and got >= want:
                        break
                body = b"".join(chunks)
        except httpx.HTTPError as exc:
            raise RemoteError(f"request failed: {exc.__class__.__name__}: {exc}", file=url) from None
        with self._lock:
            self.bytes_fetched += len(body)
        body = body[skip:]
        return (body if length is None else body[:length]), total

    def exists(self, relpath: str) -> bool:
        try:
            self.size(relpath)
            return True
        except RemoteError:  # the server is unreachable or failing: not the same as "absent"
            raise
        except CheckpointError:
            return False

    def size(self, relpath: str) -> int:
        if relpath not in self._sizes:
            _, total = self._get(relpath, 0, 1)
            if total is None:
                raise RemoteError("server reported no file size (no Content-Range / Content-Length)", file=self.url(relpath))
            self._sizes[relpath] = total
        return self._sizes[relpath]

    def read(self, relpath: str, start: int = 0, length: int | None = None) -> bytes:
        body, total = self._get(relpath, start, length)
        if total is not None:
            self._sizes[relpath] = total
        return body

    def list_files(self) -> None:
        return None  # plain HTTP cannot list; callers work from the index

    def read_header(self, relpath: str) -> ShardHeader:
        shown = self.url(relpath)
        first, total = self._get(relpath, 0, FIRST_RANGE_BYTES)
        if total is None:
            raise RemoteError("server reported no file size (no Content-Range / Content-Length)", file=shown)
        self._sizes[relpath] = total
        length = header_length(first, source=shown, file_size=total)
        if LENGTH_PREFIX_BYTES + length <= len(first):
            raw = first[LENGTH_PREFIX_BYTES : LENGTH_PREFIX_BYTES + length]
        else:
            raw, _ = self._get(relpath, LENGTH_PREFIX_BYTES, length)
        if len(raw) != length:
            raise RemoteError(f"server returned {len(raw)} header bytes, expected {length}", file=shown)
        header = parse_header(raw, source=shown, header_len=length)
        check_file_size(header, total)
        return header

    def close(self) -> None:
        self._client.close()


def _total_from_content_range(value: str | None) -> int | None:
    """`bytes 0-99/1234` -> 1234 (None when absent or `*`)."""
    if not value or "/" not in value:
        return None
    total = value.rsplit("/", 1)[1].strip()
    return int(total) if total.isdigit() else None
