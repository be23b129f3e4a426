"""Page-locked host memory for layer read-ahead, held in a fixed number of slabs.

torch's page-locked allocator rounds every block up to a power of two and keeps freed blocks for
reuse until the process ends: a layer of 768 expert tensors of 6.5 MB holds 768 blocks of 8 MB,
and blocks of every size any step asked for stay resident after that step. A layer-streamed run
instead reads each layer into one :class:`HostSlab` of a ring (:class:`SlabRing`), sized once to
the largest layer's bytes and page-locked in place (``cudaHostRegister``), so what the read-ahead
holds is ``slabs x largest layer`` exactly, and is freed when the run closes.

A slab is refilled only after the device has finished copying out of it: whoever copies from it
records a device event (:meth:`HostSlab.copied`), and :meth:`HostSlab.reset` waits for it.
Without CUDA the slabs are plain host memory (the same carving, testable on a CPU).
"""

from __future__ import annotations

import math
import threading
from typing import Any

import torch

#: Every carved tensor starts at a multiple of this (any dtype's alignment; a cache line).
ALIGN = 256


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


class HostSlab:
    """``capacity`` bytes of host memory, page-locked when ``pin`` (registered with CUDA), handed
    out as tensors by :meth:`empty` from the front until :meth:`reset`. A request that does not fit
    gets memory of its own (torch's page-locked allocator when ``pin``) and is counted in
    ``overflow_bytes``: the sizing is an estimate, the values never depend on it."""

    def __init__(self, capacity: int, pin: bool):
        self.capacity, self.pin = aligned(capacity), pin
        self.buffer = torch.empty(self.capacity, dtype=torch.uint8)
        self.registered = bool(pin and self.capacity) and _register(self.buffer)
        self.used, self.overflow_bytes = 0, 0
        self._copied: Any = None  # the device event after the last copy out of this slab
        self._lock = threading.Lock()  # several reader threads carve one layer's tensors

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        nbytes = math.prod(shape) * dtype.itemsize
        with self._lock:
            start = self.used
            if start + nbytes > self.capacity or not self.registered and self.pin:
                self.overflow_bytes += nbytes
                return torch.empty(shape, dtype=dtype, pin_memory=self.pin)
            self.used = start + aligned(nbytes)
        return self.buffer[start : start + nbytes].view(dtype).view(shape)

    def copied(self) -> None:
        """Mark the copies queued so far out of this slab (on the current CUDA stream)."""
        if self.registered:
            event = torch.cuda.Event()
            event.record()
            self._copied = event

    def reset(self) -> None:
        """Wait until the device has read what was carved, then carve from the front again."""
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None
        self.used = 0

    def close(self) -> None:
        self.reset()
        if self.registered:
            torch.cuda.cudart().cudaHostUnregister(self.buffer.data_ptr())
            self.registered = False
        self.buffer = torch.empty(0, dtype=torch.uint8)


def _register(buffer: torch.Tensor) -> bool:
    """Page-lock ``buffer`` in place; False where CUDA refuses (the slab then hands out torch's
    page-locked blocks, as without it)."""
    error = torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), buffer.numel(), 0)
    return int(getattr(error, "value", error)) == 0


class SlabRing:
    """``count`` slabs, layer ``i`` in slab ``i % count``: the read-ahead of layer ``i + count``
    waits until layer ``i``'s copies to the device are done."""

    def __init__(self, capacity: int, pin: bool, count: int = 2):
        self.slabs = [HostSlab(capacity, pin) for _ in range(count)]

    def for_layer(self, index: int) -> HostSlab:
        return self.slabs[index % len(self.slabs)]

    @property
    def overflow_bytes(self) -> int:
        return sum(slab.overflow_bytes for slab in self.slabs)

    def close(self) -> None:
        for slab in self.slabs:
            slab.close()


def empty_host_cache() -> None:
    """Return torch's cached, unused page-locked blocks to the system (a step's read-ahead is not
    held into the next step). No-op without CUDA."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        release = getattr(torch._C, "_host_emptyCache", None)
        if release is not None:
            release()
