"""Reading many tensors of a checkpoint as a few large sequential requests.

Tensors that lie next to each other in a shard (a layer's experts: a shard stores its tensors in
name order, and the exporter's work units come in that order) are read as the shard's byte range
from the first wanted tensor's start to the last one's end, cut into requests of
``request_bytes``, each scattered by the kernel straight into the tensors' own buffers
(``preadv``): a few requests of tens of MiB instead of one tensor-sized read per tensor. A small
gap between two wanted tensors (an unwanted tensor between them) is read and dropped rather than
splitting the run; a larger one starts a new run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Hashable, Iterable, Mapping

from fp4forge.errors import CheckpointError, ConfigError

if TYPE_CHECKING:
    from fp4forge.checkpoint.reader import Checkpoint

#: Bytes one request reads (a 256 MiB batch of expert weights: four requests).
REQUEST_BYTES = 64 << 20
#: Unwanted bytes between two wanted tensors that are read and dropped to keep one run.
MAX_GAP_BYTES = 1 << 20


@dataclass(frozen=True)
class Extent:
    """One wanted tensor's bytes: ``[start, end)`` of the shard file (absolute file offsets)."""

    key: Hashable  # the caller's name for it (a tensor name)
    shard: str
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class ByteRun:
    """A contiguous byte range of one shard that holds ``extents`` (in file order) and the gaps between them."""

    shard: str
    start: int
    end: int
    extents: tuple[Extent, ...]

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class ReadRequest:
    """One ``preadv``: ``nbytes`` from ``offset`` of ``shard``, in order into ``targets``: each
    ``(key, offset into that key's buffer, length)``, key None for gap bytes that are dropped."""

    shard: str
    offset: int
    nbytes: int
    targets: tuple[tuple[Hashable | None, int, int], ...]

    @property
    def keys(self) -> list[Hashable]:
        return [key for key, _, _ in self.targets if key is not None]


def coalesce(extents: Iterable[Extent], max_gap: int = MAX_GAP_BYTES) -> list[ByteRun]:
    """The extents merged into runs: per shard, in file order, a gap of at most ``max_gap``
    bytes keeps a run going. Overlapping extents (one tensor asked for twice) are refused."""
    ordered = sorted(extents, key=lambda e: (e.shard, e.start, e.end))
    runs: list[ByteRun] = []
    for extent in ordered:
        if extent.start < 0 or extent.end < extent.start:
            raise CheckpointError(f"bytes [{extent.start}, {extent.end}) are no byte range", file=extent.shard, tensor=str(extent.key))
        last = runs[-1] if runs else None
        if last is not None and last.shard == extent.shard and extent.start - last.end <= max_gap:
            if extent.start < last.end:
                raise CheckpointError(
                    f"bytes [{extent.start}, {extent.end}) overlap {last.extents[-1].key}'s [{last.extents[-1].start}, {last.extents[-1].end})",
                    file=extent.shard,
                    tensor=str(extent.key),
                )
            runs[-1] = ByteRun(last.shard, last.start, extent.end, (*last.extents, extent))
        else:
            runs.append(ByteRun(extent.shard, extent.start, extent.end, (extent,)))
    return runs


def split_run(run: ByteRun, request_bytes: int = REQUEST_BYTES) -> list[ReadRequest]:
    """``run`` as requests of at most ``request_bytes`` each (the last one shorter), in file order;
    a tensor that straddles a request boundary is filled by two requests."""
    if request_bytes < 1:
        raise ConfigError(f"request_bytes must be positive, got {request_bytes}")
    segments: list[tuple[Hashable | None, int, int]] = []  # (key or None for a gap, file start, length)
    position = run.start
    for extent in run.extents:
        if extent.start > position:
            segments.append((None, position, extent.start - position))
        if extent.nbytes:
            segments.append((extent.key, extent.start, extent.nbytes))
        position = extent.end
    requests: list[ReadRequest] = []
    targets: list[tuple[Hashable | None, int, int]] = []
    begin = filled = 0
    for key, file_start, length in segments:
        done = 0
        while done < length:
            if not targets:
                begin = file_start + done
            take = min(length - done, request_bytes - filled)
            targets.append((key, done, take))
            done += take
            filled += take
            if filled == request_bytes:
                requests.append(ReadRequest(run.shard, begin, filled, tuple(targets)))
                targets, filled = [], 0
    if targets:
        requests.append(ReadRequest(run.shard, begin, filled, tuple(targets)))
    return requests


def plan_reads(
    ckpt: Checkpoint, names: Iterable[str], *, request_bytes: int = REQUEST_BYTES, max_gap: int = MAX_GAP_BYTES
) -> list[ReadRequest] | None:
    """The requests that read the tensors ``names`` as stored, or None where that is not a plain
    file read (a remote source; a tensor the checkpoint converts as it reads it)."""
    if not hasattr(ckpt.source, "read_scatter"):
        return None
    extents = []
    for name in names:
        if not ckpt.reads_as_stored(name):
            return None
        shard, info = ckpt.locate(name)
        start = ckpt.headers[shard].data_start + info.begin
        extents.append(Extent(name, shard, start, start + info.nbytes))
    return [request for run in coalesce(extents, max_gap) for request in split_run(run, request_bytes)]


def read_request(ckpt: Checkpoint, request: ReadRequest, buffers: Mapping[Hashable, memoryview]) -> None:
    """Fill the buffers' parts that ``request`` covers (each buffer a writable byte view of its
    tensor's full size; gap bytes are read into a scratch buffer and dropped). Requests of one
    plan cover disjoint bytes: they may run in any order, on any threads."""
    views = []
    for key, offset, length in request.targets:
        if key is None:
            views.append(memoryview(bytearray(length)))
        else:
            views.append(buffers[key][offset : offset + length])
    ckpt.source.read_scatter(request.shard, request.offset, views)


def check_buffers(ckpt: Checkpoint, buffers: Mapping[str, memoryview]) -> None:
    """Every buffer holds exactly its tensor's stored bytes."""
    for name, buffer in buffers.items():
        _, info = ckpt.locate(name)
        if buffer.nbytes != info.nbytes or buffer.readonly:
            raise CheckpointError(f"cannot read {info.nbytes:,} bytes into a {'read-only ' if buffer.readonly else ''}buffer of {buffer.nbytes:,}", file=ckpt.display, tensor=name)


def read_into(
    ckpt: Checkpoint, buffers: Mapping[str, memoryview], *, request_bytes: int = REQUEST_BYTES, max_gap: int = MAX_GAP_BYTES
) -> bool:
    """Read the named tensors' stored bytes into ``buffers`` (name -> writable byte view) on this
    thread, as coalesced requests. False (nothing read) where :func:`plan_reads` says it cannot."""
    requests = plan_reads(ckpt, buffers, request_bytes=request_bytes, max_gap=max_gap)
    if requests is None:
        return False
    views = {name: memoryview(buffer).cast("B") for name, buffer in buffers.items()}
    check_buffers(ckpt, views)
    for request in requests:
        read_request(ckpt, request, views)
    return True
