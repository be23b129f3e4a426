"""The device (GPU) schedule: units in batches, same-shaped NVFP4 units quantized as one stack.

In a batch, the units of one signature (a layer's expert gate/up pairs, its down projections)
are read straight into one page-locked stack and quantized by one stacked pass
(:func:`~fp4forge.numerics.nvfp4.nvfp4_quantize_stacked`: no host sync, a few dozen kernels per
stack instead of that many per Linear); the rest go one unit at a time (``unit.py``).
Software-pipelined on the calling thread: batch k+1's numerics and result copies are queued on
the device before batch k's units are yielded (and written by the caller), and reader threads
read the next batches meanwhile. (Several threads sharing one GPU were measured 3-4x slower than
one: they contend for the GIL and the stream.)
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from fp4forge.checkpoint import ranges
from fp4forge.checkpoint.codecs import Nvfp4Codec, codec, torch_dtypes
from fp4forge.checkpoint.reader import Checkpoint
from fp4forge.errors import NumericsError
from fp4forge.model.host_memory import empty_host_cache
from fp4forge.numerics.nvfp4 import NVFP4_BLOCK, nvfp4_quantize_stacked
from fp4forge.quantize.options import QuantizeOptions
from fp4forge.quantize.plan import WorkUnit
from fp4forge.quantize.schedule import ExportSchedule
from fp4forge.quantize.unit import LinearError, ReadUnit, UnitQuantizer, UnitResult, quantize_unit, read_unit


# -- which units stack ---------------------------------------------------------------------------------
def stack_signature(unit: WorkUnit, options: QuantizeOptions) -> tuple | None:
    """Units with the same signature are quantized as one stack: NVFP4 with minmax block scales,
    no precomputed weights, every Linear of the unit of one shape and dtype (a fused gate/up pair,
    or one projection). None: the unit goes the per-unit way."""
    if not unit.linears or unit.passthrough or options.block_scales != "minmax" or options.precomputed is not None:
        return None
    if not isinstance(codec(unit.linears[0].scheme), Nvfp4Codec):
        return None
    shapes = {(t.scheme, t.out_features, t.in_features, t.source_dtype) for t in unit.linears}
    if len(shapes) != 1:
        return None
    ((scheme, out_features, in_features, dtype),) = shapes
    if dtype not in torch_dtypes() or out_features == 0 or in_features == 0 or in_features % NVFP4_BLOCK:
        return None
    return scheme, len(unit.linears), out_features, in_features, dtype


@dataclass
class _Stack:
    """Units of one signature in a batch, their weights read into one (pinned) host tensor
    ``[units * linears, out, in]``, unit-major (a fused group's members are consecutive)."""

    units: list[WorkUnit]
    host: torch.Tensor
    reads: list = field(default_factory=list)
    result: Any = None  # StackedNvfp4 on the host once computed


@dataclass
class _Batch:
    units: list[WorkUnit]
    stacks: list[_Stack]
    singles: dict[str, Any]  # unit key -> Future[ReadUnit] (pass-through and per-unit Linears)
    event: Any = None


def plan_batches(units: list[WorkUnit], batch_bytes: int) -> list[list[WorkUnit]]:
    """Consecutive units, cut after about ``batch_bytes`` of BF16 weights."""
    batches: list[list[WorkUnit]] = []
    current: list[WorkUnit] = []
    size = 0
    for unit in units:
        current.append(unit)
        size += sum(t.out_features * t.in_features * 2 for t in unit.linears)
        if size >= batch_bytes:
            batches.append(current)
            current, size = [], 0
    if current:
        batches.append(current)
    return batches


# -- reading a batch -------------------------------------------------------------------------------------
def _start_batch(units: list[WorkUnit], ckpt: Checkpoint, quantizer: UnitQuantizer, pool: ThreadPoolExecutor, schedule: ExportSchedule) -> _Batch:
    """Allocate a batch's stacks (page-locked for CUDA) and queue every tensor's read on ``pool``."""
    from fp4forge.model.streaming import CheckpointTensors

    pin = quantizer.device.type == "cuda"
    reader = CheckpointTensors(ckpt)
    groups: dict[tuple, list[WorkUnit]] = {}
    singles: dict[str, Any] = {}
    for unit in units:
        signature = stack_signature(unit, quantizer.options)
        if signature is None:
            singles[unit.key] = pool.submit(read_unit, unit, ckpt, pin)
        else:
            groups.setdefault(signature, []).append(unit)
    if schedule.willneed_hint:
        names = [f"{t.module}.weight" for u in units for t in u.linears] + [n for u in units for n in u.passthrough]
        pool.submit(reader.will_need, names)
    stacks = []
    slots: dict[str, tuple[_Stack, torch.Tensor]] = {}  # weight name -> its stack and slice
    for (_, linears, out_features, in_features, dtype), members in groups.items():
        host = torch.empty((len(members) * linears, out_features, in_features), dtype=torch_dtypes()[dtype], pin_memory=pin)
        stack = _Stack(members, host)
        for i, target in enumerate(t for u in members for t in u.linears):
            slots[f"{target.module}.weight"] = (stack, host[i])
        stacks.append(stack)
    if not (schedule.device_coalesced_reads and _queue_coalesced_reads(slots, ckpt, pool, schedule.device_read_request_bytes)):
        for name, (stack, out) in slots.items():
            stack.reads.append(pool.submit(reader.read_host, name, pin, out))
    return _Batch(units, stacks, singles)


def _queue_coalesced_reads(slots: dict[str, tuple[_Stack, torch.Tensor]], ckpt: Checkpoint, pool: ThreadPoolExecutor, request_bytes: int) -> bool:
    """Queue the reads of the batch's stacked weights as a few large sequential requests
    (:mod:`fp4forge.checkpoint.ranges`: a batch of a layer's experts is one contiguous byte range
    of its shard), each scattered straight into the stacks' page-locked slices; a stack waits
    for the requests that cover its slices. False (nothing queued) where the weights cannot be
    read as stored bytes of their stack's dtype: the caller reads them tensor by tensor."""
    if not slots:
        return True
    dtype_codes = {dtype: code for code, dtype in torch_dtypes().items()}
    for name, (_, out) in slots.items():
        if ckpt.locate(name)[1].dtype != dtype_codes.get(out.dtype):
            return False
    requests = ranges.plan_reads(ckpt, slots, request_bytes=request_bytes)
    if requests is None:
        return False
    buffers = {name: memoryview(out.reshape(-1).view(torch.uint8).numpy()) for name, (_, out) in slots.items()}
    ranges.check_buffers(ckpt, buffers)
    for request in requests:
        future = pool.submit(ranges.read_request, ckpt, request, buffers)
        for stack in {id(slots[key][0]): slots[key][0] for key in request.keys}.values():
            stack.reads.append(future)
    return True


# -- computing and unpacking a batch -------------------------------------------------------------------
def _compute_batch(batch: _Batch, quantizer: UnitQuantizer, schedule: ExportSchedule) -> None:
    """Queue the batch's stacked numerics on the device and the copies of their results into
    page-locked host memory; nothing waits for the device here (``batch.event`` marks the end)."""
    cuda = quantizer.device.type == "cuda"
    for stack in batch.stacks:
        for read in stack.reads:
            read.result()
        weights = stack.host.to(quantizer.device, non_blocking=cuda)
        result = nvfp4_quantize_stacked(
            weights,
            convention=quantizer.layout,
            group=len(stack.units[0].linears),
            error=quantizer.options.error_report,
            chunk_elements=schedule.device_chunk_elements if cuda else None,
        )
        stack.result = result.to("cpu", non_blocking=True, pin_memory=True) if cuda else result
    if cuda:
        batch.event = torch.cuda.Event()
        batch.event.record()


def _finish_batch(batch: _Batch, quantizer: UnitQuantizer) -> Iterator[UnitResult]:
    """Yield the batch's units as ``quantize_unit`` does, in plan order, once the device is done."""
    if batch.event is not None:
        batch.event.synchronize()
    done: dict[str, UnitResult] = {}
    for stack in batch.stacks:
        done.update(_unpack_stack(stack, quantizer))
    for unit in batch.units:
        if unit.key in done:
            yield done[unit.key]
        else:
            yield quantize_unit(batch.singles[unit.key].result(), quantizer)


def _unpack_stack(stack: _Stack, quantizer: UnitQuantizer) -> dict[str, UnitResult]:
    """Each unit of a computed stack as ``quantize_unit`` would give it: a slice that is not
    finite is refused by name; one that is not regular goes the general path on the host."""
    result = stack.result
    finite, regular = result.finite.tolist(), result.regular.tolist()
    err = result.err_sq.double().tolist() if result.err_sq is not None else None
    ref = result.ref_sq.double().tolist() if result.ref_sq is not None else None
    scheme = stack.units[0].linears[0].scheme
    out: dict[str, UnitResult] = {}
    index = 0
    for unit in stack.units:
        rows = range(index, index + len(unit.linears))
        index += len(unit.linears)
        for i, target in zip(rows, unit.linears):
            if not finite[i]:
                raise NumericsError(f"{target.module}: weight holds NaN or Inf; refusing to quantize it")
        nbytes = sum(stack.host[i].numel() * stack.host[i].element_size() for i in rows)
        if not all(regular[rows.start : rows.stop]):
            # a zero or infinite step (ModelOpt scalars of denormal weights): the general path, on the host
            read = ReadUnit(unit, {}, {t.module: stack.host[i] for i, t in zip(rows, unit.linears)}, nbytes)
            out[unit.key] = quantize_unit(read, quantizer, torch.device("cpu"))
            continue
        input_scale = quantizer.input_scale(unit)
        tensors: dict[str, Any] = {}
        errors: list[LinearError] = []
        for i, target in zip(rows, unit.linears):
            tensors.update(quantizer.named(scheme, target.module, Nvfp4Codec.tensors_of(result.weight(i)), input_scale))
            if err is not None and ref is not None:
                rel = 0.0 if ref[i] == 0.0 else math.sqrt(err[i] / ref[i])
                errors.append(LinearError(target.module, target.component, scheme, rel))
        out[unit.key] = (unit, tensors, errors, nbytes)
    return out


# -- the schedule ------------------------------------------------------------------------------------------
def process_units_on_device(units: list[WorkUnit], ckpt: Checkpoint, quantizer: UnitQuantizer, schedule: ExportSchedule) -> Iterator[UnitResult]:
    """The GPU path: yields as the CPU path does, in plan order. ``schedule.device_read_threads``
    threads read the next ``schedule.device_read_ahead`` batches while one is computed."""
    batches = plan_batches(units, schedule.device_batch_bytes)
    with ThreadPoolExecutor(max_workers=schedule.device_read_threads, thread_name_prefix="fp4forge-read") as pool:
        started: deque[_Batch] = deque()
        queue = iter(batches)
        try:
            for members in itertools.islice(queue, schedule.device_read_ahead + 1):
                started.append(_start_batch(members, ckpt, quantizer, pool, schedule))
            computed: _Batch | None = None
            while started:
                batch = started.popleft()
                _compute_batch(batch, quantizer, schedule)
                following = next(queue, None)
                if following is not None:
                    started.append(_start_batch(following, ckpt, quantizer, pool, schedule))
                if computed is not None:
                    yield from _finish_batch(computed, quantizer)
                computed = batch
            if computed is not None:
                yield from _finish_batch(computed, quantizer)
        finally:
            for batch in started:  # an error or a closed generator: drop the queued reads
                for future in [*batch.singles.values(), *(r for st in batch.stacks for r in st.reads)]:
                    future.cancel()
            empty_host_cache()  # the batches' page-locked blocks are not held into the next step
