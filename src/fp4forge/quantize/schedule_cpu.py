"""The CPU schedule: one reader thread reads units ahead in plan order, a pool computes them.

Torch kernels release the GIL, so threads with one intra-op thread each keep every core busy
without the oversubscription of nested OpenMP pools, and every sum runs on one thread: the error
report does not depend on the number of workers.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import torch

from fp4forge.checkpoint import ranges
from fp4forge.checkpoint.codecs import torch_dtypes
from fp4forge.checkpoint.reader import Checkpoint
from fp4forge.quantize.plan import WorkUnit
from fp4forge.quantize.schedule import ExportSchedule
from fp4forge.quantize.unit import ReadUnit, UnitQuantizer, UnitResult, quantize_unit, read_unit


def unit_nbytes(unit: WorkUnit, ckpt: Checkpoint) -> int:
    """The stored bytes of the unit's tensors (its Linears' weights and its pass-through tensors)."""
    return sum(ckpt.locate(name)[1].nbytes for name in [*(f"{t.module}.weight" for t in unit.linears), *unit.passthrough])


def read_unit_coalesced(unit: WorkUnit, ckpt: Checkpoint) -> ReadUnit:
    """``read_unit`` on the CPU path: the unit's weights (a fused group's members lie next to each
    other in their shard) as one coalesced run of large ``preadv`` requests straight into the
    tensors (:mod:`fp4forge.checkpoint.ranges`) instead of one open + read per tensor; where the
    weights cannot be read as stored bytes (a converting source), the per-tensor reads."""
    weights: dict[str, torch.Tensor] = {}
    buffers: dict[str, memoryview] = {}
    for target in unit.linears:
        name = f"{target.module}.weight"
        _, info = ckpt.locate(name)
        dtype = torch_dtypes().get(info.dtype)
        if dtype is None or not info.nbytes:
            return read_unit(unit, ckpt)
        tensor = torch.empty(list(info.shape), dtype=dtype)
        weights[target.module] = tensor
        buffers[name] = memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
    if buffers and not ranges.read_into(ckpt, buffers):
        return read_unit(unit, ckpt)
    passthrough = {name: ckpt.read_raw(name) for name in unit.passthrough}
    nbytes = sum(len(b) for b in passthrough.values()) + sum(w.numel() * w.element_size() for w in weights.values())
    return ReadUnit(unit, passthrough, weights, nbytes)


def _lower_priority(steps: int) -> None:
    """Run the calling thread ``steps`` below the process's priority (Linux: per thread)."""
    if not steps or not hasattr(os, "setpriority"):
        return
    with contextlib.suppress(OSError):
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + steps)


def process_units(units: list[WorkUnit], ckpt: Checkpoint, quantizer: UnitQuantizer, workers: int, schedule: ExportSchedule) -> Iterator[UnitResult]:
    """Yield processed units in plan order, ``workers + 1`` of them computed at a time.

    One reader thread reads the units in plan order (coalesced requests per unit) up to
    ``schedule.cpu_read_ahead_bytes`` ahead of the yielded ones, so reading overlaps computing and
    writing: the disk is never idle while there is room in the budget, and an uncached source
    costs little wall time beyond its read. Memory is bounded by the read-ahead budget plus one
    unit whatever the model's size. Writing stays on the caller's thread."""
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="fp4forge-read") as reader,
            ThreadPoolExecutor(max_workers=workers, thread_name_prefix="fp4forge-quantize", initializer=_lower_priority, initargs=(schedule.compute_nice,)) as pool,
        ):
            yield from _pipeline(iter(units), ckpt, quantizer, workers, schedule.cpu_read_ahead_bytes, reader, pool)
    finally:
        torch.set_num_threads(previous_threads)


def _pipeline(todo: Iterator[WorkUnit], ckpt: Checkpoint, quantizer: UnitQuantizer, workers: int, budget: int, reader: ThreadPoolExecutor, pool: ThreadPoolExecutor) -> Iterator[UnitResult]:
    reads: deque = deque()  # (read future, bytes): queued or read, not yet computing
    window: deque = deque()  # (compute future, bytes), in plan order
    held = 0  # bytes of the units in `reads` and `window`

    def read_ahead() -> None:
        nonlocal held
        while held < budget or not (reads or window):
            unit = next(todo, None)
            if unit is None:
                return
            size = unit_nbytes(unit, ckpt)
            reads.append((reader.submit(read_unit_coalesced, unit, ckpt), size))
            held += size

    try:
        while True:
            read_ahead()
            while reads and len(window) <= workers:
                read, size = reads.popleft()
                window.append((pool.submit(lambda r=read: quantize_unit(r.result(), quantizer)), size))
            if not window:
                return
            future, size = window.popleft()
            result = future.result()
            held -= size
            read_ahead()  # before the caller writes this unit
            yield result
    finally:
        for future, _ in [*reads, *window]:  # an error or a closed generator: drop what is queued
            future.cancel()
