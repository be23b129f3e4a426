"""`audit --deep`: every value the checks judge, read once and reduced over whole tensors.

The deep checks (NaN/Inf and all-zero weights, NaN or negative FP8 block scales, the NVFP4 and
FP8 scale magnitude) need a few numbers per tensor, not its values. :func:`plan_units` says
which tensors to read (a Linear's NVFP4 codes together with their block scales, block by block)
in pieces of at most ``PIECE_BYTES``; :func:`plan_jobs` makes neighbouring pieces of one kind and
size (an MoE layer's experts, stored side by side) one job: one read per part of the span they
cover, reduced as the rows of a strided view. Jobs are read once, in shard order, into buffers
reused job after job (no allocation, no page faults per job), while the page cache is asked to
fill ahead of them (:class:`_ReadAhead`); each piece is reduced by torch operations over whole
rows to four numbers (:data:`EMPTY_ROW` says how): two counts that add across pieces and two
maxima. Where compute runs is ``device`` (``model/device.py``): a GPU gets the bytes from a ring
of pinned buffers by non-blocking copies and keeps every row there until one transfer at the end
(:func:`_rows_on_device`); the CPU reads and reduces jobs on one thread per core, each into its
own buffer (:func:`_rows_on_threads`). An audit starts the scan on a background thread
(:func:`start`) so that it overlaps the checks that read only headers. Neither the device, the
piece size, the jobs nor the thread count changes a number the checks see
(``tests/test_audit_deep_scan.py``).
"""

from __future__ import annotations

import math
import os
import queue
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fp4forge.checkpoint.codecs import any_code_rows, blocks_match, masked_lanes
from fp4forge.checkpoint.raw import FLOAT_DTYPES
from fp4forge.checkpoint.safetensors_format import TensorInfo
from fp4forge.errors import CheckpointError

if TYPE_CHECKING:
    import torch

    from fp4forge.audit.context import AuditContext
    from fp4forge.checkpoint.reader import Checkpoint

#: The most bytes of one tensor reduced at once (a larger tensor is read in several pieces).
PIECE_BYTES = 16 << 20
#: The most bytes read ahead of the reductions on the device path (its ring of host buffers).
READ_AHEAD_BYTES = 256 << 20
#: How far ahead of the reductions the page cache is asked to fill, and so how much the disk
#: reads while torch is imported: 4 GiB, at most an eighth of the memory (page cache, not the
#: process's memory: a hint that outran the memory would evict what it read before its use).
READ_AHEAD_HINT_BYTES = min(4 << 30, os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 8 if hasattr(os, "sysconf") else 1 << 30)
#: What each piece reduces to, a row (count, count, maximum, maximum), whose meaning is the kernel's:
#: float (non-finite values, pieces with a nonzero value, -, -); e4m3 (NaN codes, pieces with a
#: nonzero code, largest non-NaN magnitude byte, -); codes (-, pieces with a nonzero code, -, -);
#: block_scale (NaN scales, negative scales, -, -); fp4_pair (NVFP4 codes with their block scales:
#: the scales' NaN, negative, any nonzero code, largest top code x |block scale|). Rows of one
#: unit's pieces add and maximise.
EMPTY_ROW = (0.0, 0.0, 0.0, -math.inf)
VALUE_KINDS = ("weight", "packed_fp4")  # the tensors whose values are checked for NaN/Inf and zeros
NVFP4_SCHEME, FP8_SCHEME = "nvfp4", "fp8"  # the codecs that read a Linear's values for the magnitude check


def is_block_scale_checked(kind: str, info: TensorInfo) -> bool:
    """FP8 block scales (NVFP4's per 16 values, block-wise FP8's) are checked for NaN and sign."""
    return kind == "weight_scale" and info.dtype == "F8_E4M3" and len(info.shape) == 2 and info.shape[1] > 1


def magnitude_tensors(params: dict[str, TensorInfo]) -> tuple[str, dict[str, str]] | None:
    """(scheme, role -> suffix) of a module whose scale magnitude can be judged, or None. Which
    scheme is told by the stored dtypes (a damaged checkpoint may match no scheme)."""
    packed = params.get("weight_packed") or (params.get("weight") if params.get("weight") is not None and params["weight"].dtype == "U8" else None)
    block = params.get("weight_scale")
    if packed is not None and block is not None and block.dtype == "F8_E4M3":
        per_tensor = params.get("weight_global_scale") or params.get("weight_scale_2")
        if per_tensor is None or per_tensor.numel != 1:
            return None
        suffix_of = {id(info): suffix for suffix, info in params.items()}
        return NVFP4_SCHEME, {"packed": suffix_of[id(packed)], "block_scale": "weight_scale", "global_scale": suffix_of[id(per_tensor)]}
    weight = params.get("weight")
    if weight is None or weight.dtype != "F8_E4M3":
        return None
    return FP8_SCHEME, {"weight": "weight"}


# -- the plan -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Part:
    """Bytes ``[start, start + length)`` of a shard file."""

    shard: str
    start: int
    length: int


@dataclass(frozen=True)
class Unit:
    """One tensor (or an NVFP4 Linear's codes and block scales) and the pieces it is read in."""

    kernel: str  # float, e4m3, codes, block_scale or fp4_pair (EMPTY_ROW says what each reduces to)
    names: tuple[str, ...]
    dtype: str  # the first tensor's stored dtype
    pieces: tuple[tuple[Part, ...], ...]


def _value_kernel(dtype: str) -> str:
    return "float" if dtype in FLOAT_DTYPES else "e4m3" if dtype == "F8_E4M3" else "codes"


def _single(ckpt: Checkpoint, kernel: str, shard: str, info: TensorInfo, piece_bytes: int) -> Unit:
    start = ckpt.headers[shard].data_start + info.begin
    step = max(piece_bytes - piece_bytes % 8, 8)  # a whole number of elements of any dtype
    pieces = tuple((Part(shard, start + at, min(step, info.nbytes - at)),) for at in range(0, info.nbytes, step))
    return Unit(kernel, (info.name,), info.dtype, pieces)


def _pair(ckpt: Checkpoint, packed: tuple[str, TensorInfo], block: tuple[str, TensorInfo], piece_bytes: int) -> Unit:
    """Codes and block scales in step: piece k holds blocks [k*B, (k+1)*B) of both."""
    (shard, codes), (scale_shard, scales) = packed, block
    code_start = ckpt.headers[shard].data_start + codes.begin
    scale_start = ckpt.headers[scale_shard].data_start + scales.begin
    per_block = codes.nbytes // max(scales.nbytes, 1)
    blocks = max((piece_bytes - 8) // (per_block + 1), 1)  # with the scales' 8-alignment: within piece_bytes
    pieces = tuple(
        (Part(shard, code_start + at * per_block, min(blocks, scales.nbytes - at) * per_block), Part(scale_shard, scale_start + at, min(blocks, scales.nbytes - at)))
        for at in range(0, scales.nbytes, blocks)
    )
    return Unit("fp4_pair", (codes.name, scales.name), codes.dtype, pieces)


def _nvfp4_pairs(ctx: AuditContext) -> dict[str, str]:
    """codes tensor -> its block scales, for every NVFP4 Linear the magnitude check judges."""
    pairs: dict[str, str] = {}
    if ctx.layout is None:
        return pairs
    for module, params in ctx.modules.items():
        found = magnitude_tensors(params)
        if found is not None and found[0] == NVFP4_SCHEME:
            codes, scales = (f"{module}.{found[1][role]}" for role in ("packed", "block_scale"))
            if blocks_match(ctx.tensors[codes][1].nbytes, ctx.tensors[scales][1].nbytes):
                pairs[codes] = scales
    return pairs


def plan_units(ctx: AuditContext, piece_bytes: int = PIECE_BYTES) -> list[Unit]:
    """Every unit the deep checks need, in shard order. A paired code tensor is read by its pair
    alone, unless its dtype asks for another value check (a float or FP8 tensor named as codes)."""
    pairs = _nvfp4_pairs(ctx)
    paired_scales = set(pairs.values())
    units = []
    for name, (shard, info) in ctx.tensors.items():
        kind = ctx.kind(name)
        if name in pairs:
            units.append(_pair(ctx.ckpt, (shard, info), ctx.tensors[pairs[name]], piece_bytes))
        if kind in VALUE_KINDS and (name not in pairs or _value_kernel(info.dtype) != "codes"):
            units.append(_single(ctx.ckpt, _value_kernel(info.dtype), shard, info, piece_bytes))
        elif is_block_scale_checked(kind, info) and name not in paired_scales:
            units.append(_single(ctx.ckpt, "block_scale", shard, info, piece_bytes))
    return sorted(units, key=lambda u: (u.pieces[0][0].shard, u.pieces[0][0].start) if u.pieces else ("", -1))


# -- the reductions (torch, any device) -------------------------------------------------------------
def _columns(rows: int, device: Any, *values: Any) -> torch.Tensor:
    """Rows [m, 4] in float64 from up to four columns (tensors [m] or numbers; missing ones:
    EMPTY_ROW's), made on the device of the tensors (constants filled there: no copy to wait for)."""
    import torch

    full = list(values) + list(EMPTY_ROW[len(values):])
    return torch.stack([v.double() if isinstance(v, torch.Tensor) else torch.full((rows,), float(v), dtype=torch.float64, device=device) for v in full], dim=1)


#: float dtype -> (integer lanes of its bit patterns, |x| mask of one lane, the smallest |x| pattern
#: that is Inf or NaN): a float is nonzero iff its masked bits are > 0, not finite iff >= the last.
FLOAT_BITS = {
    "BF16": ("int16", 0x7FFF, 0x7F80),
    "F16": ("int16", 0x7FFF, 0x7C00),
    "F32": ("int32", 0x7FFFFFFF, 0x7F800000),
    "F64": ("int64", 0x7FFFFFFFFFFFFFFF, 0x7FF0000000000000),
}


def _row_maxima(values: torch.Tensor) -> torch.Tensor:
    """Each row's largest value (0 for rows of no values): one pass that answers both "any
    nonzero" and, for the shortcut, "anything to count"."""
    import torch

    return values.amax(dim=1) if values.shape[1] else torch.zeros(values.shape[0], dtype=values.dtype, device=values.device)


def _any_above(largest: torch.Tensor, limit: int, shortcuts: bool) -> bool:
    """Whether a count can be nonzero, from the rows' maxima: always, without ``shortcuts`` (no
    host round trip: the device's path); else whether the largest reaches ``limit``."""
    return not shortcuts or (largest.numel() > 0 and int(largest.max()) >= limit)


def _float_rows(raw: torch.Tensor, dtype: str, shortcuts: bool) -> torch.Tensor:
    """(non-finite values, any value nonzero) per row."""
    lanes, mask, nonfinite_from = FLOAT_BITS[dtype]
    bits = masked_lanes(raw, lanes, mask)
    largest = _row_maxima(bits)
    if not _any_above(largest, nonfinite_from, shortcuts):  # the usual case: no count to make
        return _columns(raw.shape[0], raw.device, 0, largest > 0)
    return _columns(raw.shape[0], raw.device, (bits >= nonfinite_from).sum(dim=1), largest > 0)


def _fp8_rows(raw: torch.Tensor, shortcuts: bool) -> torch.Tensor:
    """(NaN count, any nonzero, largest non-NaN magnitude byte) of E4M3 bytes per row."""
    from fp4forge.numerics.fp8 import FP8_E4M3_NAN_BITS

    magnitude = masked_lanes(raw, "uint8", 0x7F)
    largest = _row_maxima(magnitude)
    if not _any_above(largest, FP8_E4M3_NAN_BITS, shortcuts):
        return _columns(raw.shape[0], raw.device, 0, largest > 0, largest)
    nan = magnitude == FP8_E4M3_NAN_BITS
    return _columns(raw.shape[0], raw.device, nan.sum(dim=1), largest > 0, _row_maxima(magnitude.masked_fill(nan, 0)))


def _block_scale_counts(raw: torch.Tensor, shortcuts: bool) -> tuple[Any, Any]:
    """(NaN, negative) E4M3 scales per row: a sign bit on a value that is neither zero nor NaN."""
    from fp4forge.numerics.fp8 import FP8_E4M3_NAN_BITS

    if not _any_above(_row_maxima(raw), FP8_E4M3_NAN_BITS, shortcuts):  # no sign bit, no NaN
        return 0, 0
    magnitude = raw & 0x7F
    nan = magnitude == FP8_E4M3_NAN_BITS
    return nan.sum(dim=1), (((raw & 0x80) != 0) & (magnitude != 0) & ~nan).sum(dim=1)


def reduce_rows(kernel: str, dtype: str, data: list[torch.Tensor], *, shortcuts: bool = True) -> torch.Tensor:
    """Rows [m, 4] (float64, :data:`EMPTY_ROW` says what each kernel's are) of m pieces at once:
    ``data``, one uint8 tensor [m, L] per part (the last dimension contiguous, any device).
    ``shortcuts``: skip the exact counts where one maximum shows there is nothing to count (a
    host round trip per call: the CPU's path); the numbers are the same either way."""
    from fp4forge.checkpoint.codecs import codec

    raw = data[0]
    rows = raw.shape[0]
    if kernel == "float":
        return _float_rows(raw, dtype, shortcuts)
    if kernel == "codes":  # packed FP4 (and any other integer codes): zero and negative zero
        return _columns(rows, raw.device, 0, any_code_rows(raw))
    if kernel == "e4m3":
        return _fp8_rows(raw, shortcuts)
    if kernel == "block_scale":
        return _columns(rows, raw.device, *_block_scale_counts(raw, shortcuts))
    peeked = codec(NVFP4_SCHEME).peek_rows(raw, data[1], search=shortcuts)
    return _columns(rows, raw.device, *_block_scale_counts(data[1], shortcuts), peeked[:, 0], peeked[:, 1])


def reduce_piece(unit: Unit, data: list[torch.Tensor], *, shortcuts: bool = True) -> torch.Tensor:
    """One piece's row from its bytes (flat uint8 tensors, one per part): :func:`reduce_rows`."""
    return reduce_rows(unit.kernel, unit.dtype, [d.view(1, -1) for d in data], shortcuts=shortcuts)[0]


# -- batches: pieces read and reduced at once ------------------------------------------------------
@dataclass(frozen=True)
class Job:
    """Pieces read and reduced at once: ``rows`` consecutive pieces of one kernel whose part k
    lies at ``views[k]`` = (offset in the buffer, distance from one piece to the next, length).
    Part k of all the pieces is one read of the span they cover (an MoE layer's experts are
    stored side by side), placed at its file offset's phase mod 8 when there are several (so
    tensors 8-aligned in the file stay 8-aligned for the int64 lanes), 8-aligned otherwise."""

    kernel: str
    dtype: str
    rows: int
    reads: tuple[tuple[Part, int], ...]  # (part of a file, its offset in the buffer)
    views: tuple[tuple[int, int, int], ...]

    @property
    def nbytes(self) -> int:
        return max((at + part.length for part, at in self.reads), default=0)


def _aligned(length: int) -> int:
    return -(-length // 8) * 8  # each part starts 8-aligned in its buffer (the int64 lanes' fast path)


def _strides(group: list[tuple[Unit, tuple[Part, ...]]]) -> list[int]:
    """Per part: the distance in its file from one piece of ``group`` to the next (one piece: its length)."""
    head = group[0][1]
    return [b.start - a.start for a, b in zip(head, group[1][1])] if len(group) > 1 else [p.length for p in head]


def _layout(head: tuple[Part, ...], strides: list[int], rows: int) -> tuple[tuple[tuple[Part, int], ...], int]:
    """(each part's span and its offset in the buffer, the buffer bytes they take)."""
    reads, at = [], 0
    for part, stride in zip(head, strides):
        phase = part.start % 8 if rows > 1 else 0
        span = Part(part.shard, part.start, (rows - 1) * stride + part.length)
        reads.append((span, at + phase))
        at += _aligned(phase + span.length)
    return tuple(reads), at


def _job(group: list[tuple[Unit, tuple[Part, ...]]]) -> Job:
    unit, head = group[0]
    strides = _strides(group)
    reads, _ = _layout(head, strides, len(group))
    return Job(unit.kernel, unit.dtype, len(group), reads, tuple((at, stride, part.length) for (_, at), stride, part in zip(reads, strides, head)))


def _extends(group: list[tuple[Unit, tuple[Part, ...]]], unit: Unit, piece: tuple[Part, ...], limit: int) -> bool:
    """Whether ``piece`` joins ``group``: one-piece units of one kernel, each part as long as the
    first piece's, in the same file, at a constant distance from the last piece's; the buffer
    within ``limit`` bytes and at least half of what is read read for a reason."""
    head_unit, head = group[0]
    if len(unit.pieces) != 1 or len(head_unit.pieces) != 1 or (unit.kernel, unit.dtype) != (head_unit.kernel, head_unit.dtype):
        return False
    if len(piece) != len(head) or any(p.shard != q.shard or p.length != q.length or not p.length for p, q in zip(piece, head)):
        return False
    steps = [p.start - q.start for p, q in zip(piece, group[-1][1])]
    if any(step <= 0 for step in steps) or (len(group) > 1 and steps != _strides(group)):
        return False
    reads, nbytes = _layout(head, steps, len(group) + 1)
    return nbytes <= limit and all(2 * (len(group) + 1) * part.length >= span.length for part, (span, _) in zip(head, reads))


def plan_jobs(units: list[Unit], piece_bytes: int = PIECE_BYTES) -> list[Job]:
    """The units' pieces, in order, as jobs (:class:`Job`): neighbours that :func:`_extends`
    allows share one, within ``piece_bytes``; every piece's row comes out in the same order."""
    jobs: list[Job] = []
    group: list[tuple[Unit, tuple[Part, ...]]] = []
    for unit in units:
        for piece in unit.pieces:
            if group and not _extends(group, unit, piece, piece_bytes):
                jobs.append(_job(group))
                group = []
            group.append((unit, piece))
    if group:
        jobs.append(_job(group))
    return jobs


def _buffer_bytes(jobs: list[Job]) -> int:
    """The most bytes one job needs in a buffer."""
    return max((job.nbytes for job in jobs), default=8) or 8


def _job_data(job: Job, flat: torch.Tensor) -> list[torch.Tensor]:
    """The job's parts as uint8 rows [rows, length] over ``flat`` (its bytes, on any device)."""
    return [flat.as_strided((job.rows, length), (stride, 1), flat.storage_offset() + offset) for offset, stride, length in job.views]


def _read_job(ckpt: Checkpoint, job: Job, buffer: torch.Tensor) -> torch.Tensor:
    """The job's bytes read into ``buffer`` (flat uint8, reused job after job: no allocation, no
    page faults), straight from the page cache where the source reads into a buffer; the bytes
    used, valid until the buffer's next job."""
    for part, at in job.reads:
        if part.length:
            _read_part(ckpt, part, memoryview(buffer[at : at + part.length].numpy()))
    return buffer[: job.nbytes]


def _read_part(ckpt: Checkpoint, part: Part, out: memoryview) -> None:
    read_into = getattr(ckpt.source, "read_into", None)
    if read_into is not None:
        read_into(part.shard, part.start, out)
        return
    got = ckpt.source.read(part.shard, part.start, part.length)
    if len(got) != part.length:
        raise CheckpointError(f"file ends {part.length - len(got):,} bytes early", file=part.shard)
    out[:] = got


class ScanStopped(Exception):
    """The audit ended before its background scan (a check raised): nothing more is read."""


def _in_order(pool: ThreadPoolExecutor, work: Callable[[Any], Any], jobs: Iterable[Any], window: int, stop: threading.Event | None = None) -> Iterator[Any]:
    """``work(job)`` for every job on the pool, results in job order, at most ``window`` ahead;
    no job is started once ``stop`` is set."""
    pending: deque = deque()
    for job in jobs:
        if stop is not None and stop.is_set():
            raise ScanStopped
        pending.append(pool.submit(work, job))
        if len(pending) >= window:
            yield pending.popleft().result()
    while pending:
        yield pending.popleft().result()


class _ReadAhead:
    """Hints the source (a local file's ``will_need``) to start reading the next ``ahead`` bytes
    of the jobs' parts into the page cache, in order, as the jobs are taken: the disk reads while
    torch is imported and while the pieces before are reduced. Adjacent parts are one hint.

    The first window is hinted on a thread of its own (:meth:`start`): a hint may block while the
    disk's queue is full, and torch's import must not wait behind it. Until that hint returns,
    :meth:`take` adds none (it is ahead of the reads anyway)."""

    def __init__(self, ckpt: Checkpoint, jobs: list[Job], ahead: int):
        self.will_need = getattr(ckpt.source, "will_need", None)
        self.parts = [part for job in jobs for part, _ in job.reads] if self.will_need else []
        self.ahead, self.at, self.hinted, self.taken = ahead, 0, 0, 0
        self.hinting = threading.Lock()

    def start(self) -> None:
        """Hint the first ``ahead`` bytes now, on a daemon thread."""
        if self.parts:
            threading.Thread(target=self._hint_unless_busy, name="fp4forge-read-ahead", daemon=True).start()

    def take(self, job: Job) -> Job:
        """``job`` (the next one), after hinting the parts up to ``ahead`` bytes beyond it."""
        self.taken += sum(part.length for part, _ in job.reads)
        self._hint_unless_busy()
        return job

    def _hint_unless_busy(self) -> None:
        if self.hinting.acquire(blocking=False):
            try:
                self.hint()
            finally:
                self.hinting.release()

    def hint(self) -> None:
        run: Part | None = None
        while self.at < len(self.parts) and self.hinted < self.taken + self.ahead:
            part = self.parts[self.at]
            if run is not None and (part.shard != run.shard or part.start != run.start + run.length):
                self.will_need(run.shard, run.start, run.length)
                run = None
            run = part if run is None else Part(run.shard, run.start, run.length + part.length)
            self.hinted += part.length
            self.at += 1
        if run is not None:
            self.will_need(run.shard, run.start, run.length)


def _rows_on_threads(ckpt: Checkpoint, jobs: Iterable[Job], size: int, workers: int, stop: threading.Event | None) -> list[list[float]]:
    """The CPU path: every job read and reduced on a pool thread (torch releases the GIL), into
    that thread's own buffer of ``size`` bytes; its rows leave the thread as numbers, so the
    buffer is free again."""
    import torch

    local = threading.local()

    def work(job: Job) -> list[list[float]]:
        buffer = getattr(local, "buffer", None)
        if buffer is None:
            buffer = local.buffer = torch.empty(size, dtype=torch.uint8)
        return reduce_rows(job.kernel, job.dtype, _job_data(job, _read_job(ckpt, job, buffer)), shortcuts=True).tolist()

    intra_op = torch.get_num_threads()
    torch.set_num_threads(1)  # the pool is the parallelism; a shared intra-op pool would make each small op wait for all
    try:
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="deep-audit") as pool:
            return [row for rows in _in_order(pool, work, jobs, 4 * workers, stop) for row in rows]  # rows are small: a deep queue is free
    finally:
        torch.set_num_threads(intra_op)


class _Ring:
    """Buffers the reader threads fill and the device path copies from: pinned host memory for a
    GPU (the copy runs asynchronously, overlapped with the reading and the reductions), each
    reused once the work queued after its copy has finished (a CUDA event), never sooner."""

    def __init__(self, count: int, size: int, device: torch.device):
        import torch

        self.cuda = device.type == "cuda"
        self.free: queue.SimpleQueue = queue.SimpleQueue()
        for _ in range(count):
            self.free.put((torch.empty(size, dtype=torch.uint8, pin_memory=self.cuda), None))

    def take(self) -> torch.Tensor:
        buffer, done = self.free.get()
        if done is not None:
            done.synchronize()
        return buffer

    def give_back(self, buffer: torch.Tensor) -> None:
        """After the copies (and reductions) reading ``buffer`` were queued on this thread's stream."""
        import torch

        done = None
        if self.cuda:
            done = torch.cuda.Event()
            done.record()
        self.free.put((buffer, done))


def _rows_on_device(ckpt: Checkpoint, jobs: Iterable[Job], size: int, device: torch.device, workers: int, window: int, stop: threading.Event | None) -> list[torch.Tensor]:
    """The device path: pool threads read ahead into the ring (``window`` buffers of ``size``
    bytes and one more); this thread copies each job's bytes to ``device`` (non-blocking from
    pinned memory) and reduces them there; the rows stay on the device (no synchronisation per
    tensor)."""
    ring = _Ring(window + 1, size, device)  # one more than can wait: the one being copied

    def fill(job: Job) -> tuple[Job, torch.Tensor, torch.Tensor]:
        buffer = ring.take()
        return job, buffer, _read_job(ckpt, job, buffer)

    rows = []
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="deep-audit-read") as pool:
        for job, buffer, used in _in_order(pool, fill, jobs, window, stop):
            rows.append(reduce_rows(job.kernel, job.dtype, _job_data(job, used.to(device, non_blocking=True)), shortcuts=False))
            ring.give_back(buffer)  # on the CPU device the reduction has read it by now
    return rows


# -- the result -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DeepValues:
    """Each planned unit's row, summed and maximised over its pieces, by the names it read."""

    rows: dict[tuple[str, str], tuple[float, float, float, float]]  # (kernel, first name) -> its row

    def _find(self, name: str, kernels: tuple[str, ...]) -> tuple[float, ...] | None:
        return next((self.rows[(k, name)] for k in kernels if (k, name) in self.rows), None)

    def weight(self, name: str) -> tuple[int, bool]:
        """(non-finite values, any value nonzero) of a weight or code tensor."""
        row = self._find(name, ("float", "e4m3", "codes"))
        if row is not None:
            return int(row[0]), row[1] > 0
        pair = self.rows.get(("fp4_pair", name), EMPTY_ROW)  # codes read with their block scales
        return 0, pair[2] > 0

    def block_scale(self, name: str) -> tuple[int, int]:
        """(NaN, negative) FP8 block scales of a tensor."""
        row = self._find(name, ("block_scale",)) or self.rows.get(("fp4_pair_scales", name), EMPTY_ROW)
        return int(row[0]), int(row[1])

    def fp8_top(self, name: str) -> int:
        """The largest non-NaN E4M3 magnitude byte of an FP8 weight (0: none)."""
        return int(self.rows.get(("e4m3", name), EMPTY_ROW)[2])

    def nvfp4(self, codes: str) -> tuple[bool, float] | None:
        """(any code nonzero, largest top code x |block scale|) of an NVFP4 Linear's codes; None
        where they were not read as a pair (sizes that do not pair up)."""
        row = self.rows.get(("fp4_pair", codes))
        return None if row is None else (row[2] > 0, row[3])


def combine(units: list[Unit], rows: list[Any]) -> DeepValues:
    """Per unit: counts added, maxima taken over its pieces (``rows``: one per piece, in order)."""
    out: dict[tuple[str, str], tuple[float, float, float, float]] = {}
    at = 0
    for unit in units:
        mine = rows[at : at + len(unit.pieces)]
        at += len(unit.pieces)
        row = list(EMPTY_ROW)
        for piece in mine:
            row = [row[0] + piece[0], row[1] + piece[1], max(row[2], piece[2]), max(row[3], piece[3])]
        out[(unit.kernel, unit.names[0])] = tuple(row)  # type: ignore[assignment]
        if unit.kernel == "fp4_pair":
            out[("fp4_pair_scales", unit.names[1])] = tuple(row)  # type: ignore[assignment]
    return DeepValues(out)


def scan(ctx: AuditContext, device: str | None = None, *, piece_bytes: int = PIECE_BYTES, threads: int | None = None, path: str | None = None) -> DeepValues:
    """Read and reduce every unit :func:`plan_units` lists. ``device``: as ``--device``
    (``model/device.py``); ``path``: ``device`` (reduce on the device, the GPU's path) or
    ``threads`` (the CPU's path, ``threads`` of them, default one per core); default: the
    device's own path."""
    return scan_units(ctx.ckpt, plan_units(ctx, piece_bytes), device, piece_bytes=piece_bytes, threads=threads, path=path)


def _import_kernels() -> None:
    """Import what the reductions import lazily (the numerics package, the codecs) on this one
    thread, before the pool threads start: the first import of a package from several threads at
    once can hand one of them a module its circular imports left half done (ImportError:
    "partially initialized module"), seen on a 16-core node and on 2 cores."""
    import fp4forge.numerics  # noqa: F401  (its __init__ imports every numerics module)
    from fp4forge.checkpoint import codecs, raw  # noqa: F401


def scan_units(ckpt: Checkpoint, units: list[Unit], device: str | None = None, *, piece_bytes: int = PIECE_BYTES, threads: int | None = None,
               path: str | None = None, stop: threading.Event | None = None) -> DeepValues:
    """:func:`scan` of planned units (on any thread: it reads only ``ckpt``'s files); the disk
    starts on the first ``READ_AHEAD_HINT_BYTES`` while torch is imported."""
    jobs = plan_jobs(units, piece_bytes)
    ahead = _ReadAhead(ckpt, jobs, READ_AHEAD_HINT_BYTES)
    ahead.start()
    import torch

    _import_kernels()
    from fp4forge.model.device import resolve_device
    from fp4forge.model.host_memory import empty_host_cache

    where = resolve_device(device)
    size = _buffer_bytes(jobs)
    workers = threads or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
    hinted = map(ahead.take, jobs)
    if (path or ("threads" if where.type == "cpu" else "device")) == "threads":
        rows = _rows_on_threads(ckpt, hinted, size, workers, stop)
    else:
        on_device = _rows_on_device(ckpt, hinted, size, where, workers, max(2, min(READ_AHEAD_BYTES // piece_bytes, 4 * workers)), stop)
        rows = torch.cat(on_device).cpu().tolist() if on_device else []  # one transfer from the device
        empty_host_cache()  # the ring's page-locked buffers are not held into the pipeline's next step
    return combine(units, rows)


@dataclass
class _Running:
    """A scan started on a background thread (:func:`start`) and how to stop it."""

    future: Future
    stop: threading.Event


def start(ctx: AuditContext) -> None:
    """Plan the scan here (the context's tables are built on this thread), then read and reduce
    on a background thread while the checks that read no values run: :func:`deep_values` waits
    for it; :func:`stop` ends it early (the audit raised)."""
    if "deep_values" in ctx.memo:
        return
    units, stop_event = plan_units(ctx), threading.Event()
    runner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="deep-audit-scan")
    ctx.memo["deep_values"] = _Running(runner.submit(scan_units, ctx.ckpt, units, ctx.device, stop=stop_event), stop_event)
    runner.shutdown(wait=False)  # the thread ends with its scan


def stop(ctx: AuditContext) -> None:
    """End a background scan that nobody waited for, before the checkpoint's files close."""
    running = ctx.memo.get("deep_values")
    if isinstance(running, _Running):
        running.stop.set()
        wait([running.future])


def deep_values(ctx: AuditContext) -> DeepValues:
    """The scan, once per audit (the integrity and the magnitude checks share it): the one
    :func:`start` began, else one run here."""
    found = ctx.memo.get("deep_values")
    if isinstance(found, _Running):
        found = ctx.memo["deep_values"] = found.future.result()
    if found is None:
        found = ctx.memo["deep_values"] = scan(ctx, ctx.device)
    return found
