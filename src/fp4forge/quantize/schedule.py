"""How an export is scheduled: read-ahead, batching, threads, write-back pacing.

None of it changes a byte of the output; a benchmark passes its own :class:`ExportSchedule` to
``quantize_checkpoint`` to measure another setting (``benchmarks/bench_gpu.py``). The defaults
are the measured choices (benchmarks/RESULTS.md).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

from fp4forge.errors import ConfigError


def _compute_nice_from_env() -> int:
    """``FP4FORGE_COMPUTE_NICE``: the benchmark's niced arm sets it for a whole CLI run."""
    value = os.environ.get("FP4FORGE_COMPUTE_NICE", "").strip()
    return int(value) if value.isdigit() else 0


@dataclass(frozen=True)
class ExportSchedule:
    #: which path quantizes: "auto" = the CPU pool on a CPU device, the stacked device path on a
    #: GPU; "device" runs the device path on any device (how it is tested without a GPU)
    path: Literal["auto", "device"] = "auto"
    #: CPU path: bytes of work units (their stored tensors) read ahead of the computing threads,
    #: those being computed included. The reader thread keeps this much queued in plan order, so an
    #: uncached disk never idles while the threads compute (a window of ``workers + 1`` units was
    #: too shallow: the disk waited for every unit's compute to start); memory: this plus one unit.
    cpu_read_ahead_bytes: int = 512 << 20
    #: CPU path: how many ``nice`` steps below the reader's and the writer's the compute threads run
    #: (per thread; within the process's autogroup on Linux). 0, the default: on a loaded two-core
    #: machine it made no difference (the export was bound by the CPU it got), and on a machine
    #: shared without autogroups it would cost the export its share; the benchmark's niced arm
    #: measures whether it lets the reader keep an idle machine's disk busier.
    compute_nice: int = 0
    #: BF16 bytes of work units a device batch holds: its stackable units are quantized in one pass
    #: per stack; large enough that a stack costs a few dozen kernel launches for ~30 expert
    #: projections, small enough that the first batch's read (before any compute) and the pinned
    #: memory (three batches in flight) stay small.
    device_batch_bytes: int = 256 << 20
    #: device path: batches read ahead of the one being computed
    device_read_ahead: int = 2
    #: elements per chunk of the stacked encoder on a CUDA device (F32 temporaries of 256 MiB each)
    device_chunk_elements: int = 1 << 26
    #: threads reading the next batches into page-locked memory (the disk wants several requests in flight)
    device_read_threads: int = 4
    #: read a batch's stacked weights as a few large sequential requests of
    #: ``device_read_request_bytes`` scattered into the stacks (``checkpoint.ranges``), not one read
    #: per tensor (6.3 MB for an expert projection of hidden 3072): the disk's rate is measured with
    #: large sequential reads
    device_coalesced_reads: bool = True
    device_read_request_bytes: int = 64 << 20
    #: hint the kernel to read each batch's whole file range ahead (posix_fadvise WILLNEED) when the
    #: batch is queued. Off: on the H200's disk it did not help (1.09 GB/s with it, 1.15 without, in
    #: one run); a switch for disks where it does
    willneed_hint: bool = False
    #: output bytes after which the shards written so far are synced to disk in the background
    writeback_bytes: int = 256 << 20

    def __post_init__(self) -> None:
        for name in ("cpu_read_ahead_bytes", "device_batch_bytes", "device_chunk_elements", "device_read_threads", "device_read_request_bytes", "writeback_bytes"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}", option=name)
        if self.compute_nice < 0 or self.device_read_ahead < 0:
            raise ConfigError("compute_nice and device_read_ahead must not be negative", option="schedule")

    @classmethod
    def from_environment(cls) -> ExportSchedule:
        """The default schedule, with ``FP4FORGE_COMPUTE_NICE`` applied."""
        return cls(compute_nice=_compute_nice_from_env())
