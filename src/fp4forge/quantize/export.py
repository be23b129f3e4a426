"""The streaming exporter behind `fp4forge quantize`.

One work unit at a time (a fused group of Linears sharing a global scale, one Linear, or one
pass-through tensor): read its BF16 tensors, quantize, write them at their planned offsets,
journal the unit, free it. Peak memory is one unit, whatever the model's depth. The output
appears only when complete; a killed run leaves `.OUT.partial/` with its journal, and the same
command continues from there and produces the same bytes as an uninterrupted run.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import math
import os
import statistics
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal, get_args

import torch

from fp4forge import __version__
from fp4forge.checkpoint import ranges
from fp4forge.checkpoint.layout import Layout, layout_for_config
from fp4forge.checkpoint.convert import BlockFp8Source, dequantized_source
from fp4forge.checkpoint.reader import Checkpoint, open_checkpoint
from fp4forge.checkpoint.schemes import kv_role_names, role_suffixes
from fp4forge.checkpoint.names import CONFIG_JSON, HF_QUANT_CONFIG_JSON, INDEX_JSON, PROVENANCE_JSON, is_model_repo_file
from fp4forge.checkpoint.writer import DEFAULT_MAX_SHARD_BYTES, CheckpointWriter, TensorSpec
from fp4forge.model.device import resolve_device
from fp4forge.errors import ConfigError, NumericsError, require_choice
from fp4forge.model import distributed
from fp4forge.numerics.fp8 import FP8_E4M3_MAX, fp8_dequantize_weight, fp8_quantize_weight
from fp4forge.numerics.nvfp4_kernel import kernel_status
from fp4forge.numerics.nvfp4 import absmax, nvfp4_global_scale, nvfp4_quantize_stacked, nvfp4_scale_2
from fp4forge.numerics.scale_search import nvfp4_mse_global_scale, relative_error, search_nvfp4
from fp4forge.quantize.act_scales import ConstantAmax, StatsAmax
from fp4forge.quantize.plan import ExportPlan, WorkUnit, plan_export
from fp4forge.quantize.qconfig import compressed_tensors_config, modelopt_configs
from fp4forge.quantize.recipe import Recipe

CONVENTION = {"compressed-tensors": "compressed-tensors", "modelopt": "modelopt"}
# Files the exporter writes itself; of the source's other files only those a model repository holds
# (checkpoint/names.py MODEL_REPO_FILES) are copied.
REWRITTEN = {CONFIG_JSON, INDEX_JSON, PROVENANCE_JSON, HF_QUANT_CONFIG_JSON}

Progress = Callable[[int, int, str], None]
LayoutFormat = Literal["compressed-tensors", "modelopt"]
BlockScales = Literal["minmax", "four_over_six", "mse"]
LAYOUT_FORMATS: tuple[str, ...] = get_args(LayoutFormat)
BLOCK_SCALES: tuple[str, ...] = get_args(BlockScales)


@dataclass(frozen=True)
class QuantizeOptions:
    recipe: Recipe
    layout_format: LayoutFormat = "compressed-tensors"
    block_scales: BlockScales = "minmax"  # minmax is identical to the reference exporters
    act_amax: ConstantAmax | StatsAmax | None = None
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES
    # compute threads: units quantized concurrently, one torch thread each (bytes do not depend on it);
    # a reader thread besides them reads the next units while these compute
    workers: int = max(1, os.cpu_count() or 1)
    # the per-Linear relative weight error (provenance, summary); False skips its arithmetic
    error_report: bool = True
    device: str | None = None  # where the numerics run; None/"auto": CUDA when available (bytes do not depend on it)
    # Precomputed NVFP4 weights (GPTQ: calibrate/gptq.py) written instead of the block-scale rule's;
    # anything with ``.weights: dict[module, Nvfp4Weight]`` and ``.provenance() -> dict``.
    precomputed: Any = None

    def __post_init__(self) -> None:
        resolve_device(self.device)
        require_choice(self.layout_format, LAYOUT_FORMATS, "layout_format")
        require_choice(self.block_scales, BLOCK_SCALES, "block_scales")
        if self.workers < 1:
            raise ConfigError(f"threads must be at least 1, got {self.workers}", option="workers")


@dataclass
class LinearError:
    module: str
    component: str
    scheme: str
    relative_error: float


@dataclass
class ExportSummary:
    output: str
    layout_format: str
    recipe: str
    tensors_written: int
    bytes_read: int
    bytes_written: int
    seconds: float
    resumed_units: int
    weight_error: dict[str, Any] = field(default_factory=dict)
    # CPU path: which NVFP4 min-max element kernel ran ("c: <library>" or "eager: <why>"); "" elsewhere
    element_kernel: str = ""

    @property
    def read_gb_per_s(self) -> float:
        return self.bytes_read / 1e9 / self.seconds if self.seconds else 0.0

    def to_json(self) -> dict[str, Any]:
        return {**self.__dict__, "read_gb_per_s": self.read_gb_per_s}


def _source_specs(ckpt: Checkpoint) -> list[TensorSpec]:
    return [TensorSpec(info.name, info.dtype, info.shape) for _, info in ckpt.tensors()]


def _check_source(ckpt: Checkpoint) -> None:
    if ckpt.config is None:
        raise ConfigError("source has no config.json", file=ckpt.display)
    if ckpt.config.get("quantization_config") or HF_QUANT_CONFIG_JSON in ckpt.extra_json:
        raise ConfigError("source is already quantized; fp4forge quantizes BF16/F16/F32 checkpoints", file=ckpt.display)


def linear_names(specs: list[TensorSpec], layout: Layout) -> list[str]:
    """Every 2-D `.weight` module that a layout component owns (the Linears a config can name)."""
    out = []
    for spec in specs:
        if spec.name.endswith(".weight") and len(spec.shape) == 2:
            module = spec.name[: -len(".weight")]
            if layout.component_of(module) not in ("unknown", "embeddings", "norms"):
                out.append(module)
    return out


def _needs_act_scales(plan: ExportPlan) -> bool:
    return any(t.scheme in ("nvfp4", "fp8") for t in plan.targets.values()) or bool(plan.kv_layers)


def resume_key(plan: ExportPlan, options: QuantizeOptions, source_digest: str) -> str:
    material = {
        "fp4forge": __version__,
        "specs": [(s.name, s.dtype, list(s.shape)) for s in plan.output_specs],
        "recipe": options.recipe.text,
        "layout": options.layout_format,
        "block_scales": options.block_scales,
        "act": options.act_amax.provenance() if options.act_amax else None,
        "source": source_digest,
        "max_shard_bytes": options.max_shard_bytes,
    }
    if not options.error_report:  # only then: keys of runs with the report stay as they were
        material["error_report"] = False
    if options.precomputed is not None:
        # the codes themselves: a resumed run must use the same GPTQ result
        digest = hashlib.blake2b(digest_size=16)
        for module in sorted(options.precomputed.weights):
            q = options.precomputed.weights[module]
            digest.update(module.encode())
            digest.update(q.packed.numpy().tobytes())
            digest.update(q.block_scale.view(torch.uint8).numpy().tobytes())
            digest.update(q.global_scale.numpy().tobytes())
        material["precomputed"] = digest.hexdigest()
    return hashlib.blake2b(json.dumps(material, sort_keys=True).encode(), digest_size=16).hexdigest()


class UnitQuantizer:
    """Quantizes one work unit; pure apart from reading tensors through `read`."""

    def __init__(self, options: QuantizeOptions):
        self.options = options
        self.convention = CONVENTION[options.layout_format]
        self.device = resolve_device(options.device)

    def _input_amax(self, modules: list[str]) -> float:
        act = self.options.act_amax
        if act is None:
            raise ConfigError("W4A4 / static FP8 need activation scales: calibration statistics or an explicit constant amax", option="act_amax")
        return max(act.input_amax(m) for m in modules)  # fused shards share their input

    def _input_scale(self, scheme: str, amax: float) -> torch.Tensor:
        if scheme == "nvfp4":
            return nvfp4_global_scale(amax) if self.convention == "compressed-tensors" else nvfp4_scale_2(amax)
        # static FP8: amax / 448, stored like the weight scale (model dtype for CT, F32 [] for ModelOpt)
        value = torch.tensor([amax], dtype=torch.float32) / FP8_E4M3_MAX
        return value.to(torch.bfloat16) if self.convention == "compressed-tensors" else value.reshape(())

    def quantize(self, unit: WorkUnit, weights: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], list[LinearError]]:
        scheme = unit.linears[0].scheme
        suffix = role_suffixes(self.options.layout_format, scheme)
        fused = len(unit.linears) > 1
        group_amax = max(float(absmax(weights[t.module])) for t in unit.linears) if fused else None
        report = self.options.error_report
        input_scale = None
        if scheme in ("nvfp4", "fp8"):
            input_scale = self._input_scale(scheme, self._input_amax([t.module for t in unit.linears]))
        out: dict[str, torch.Tensor] = {}
        errors: list[LinearError] = []
        group_scalar = None
        for target in unit.linears:
            w = weights[target.module]
            m = target.module
            if scheme.startswith("nvfp4"):
                pre = self.options.precomputed.weights.get(m) if self.options.precomputed is not None else None
                if pre is not None:
                    q = pre.to_convention(self.convention)
                    rel = relative_error(w, q.dequantize(torch.float32).to(w.device)) if report else None
                else:
                    amax = None if group_amax is None else torch.tensor(group_amax, dtype=w.dtype)
                    scalar = None
                    if fused and self.options.block_scales == "mse":  # the searched scalar, one for the whole fused group
                        if group_scalar is None:
                            group_scalar = nvfp4_mse_global_scale([weights[t.module] for t in unit.linears], convention=self.convention, global_amax=amax)
                        scalar, amax = group_scalar, None
                    result = search_nvfp4(w, self.options.block_scales, convention=self.convention, global_amax=amax, global_scale=scalar, error=report)
                    q = result.weight
                    rel = result.relative_error
                out[f"{m}.{suffix['packed']}"] = q.packed
                out[f"{m}.{suffix['block_scale']}"] = q.block_scale
                out[f"{m}.{suffix['global_scale']}"] = q.global_scale
            else:
                strategy = "channel" if scheme == "fp8_dynamic" else "tensor"
                amax = None if group_amax is None or strategy != "tensor" else group_amax
                q8 = fp8_quantize_weight(w, strategy, amax=amax)
                scale = q8.scale if self.convention == "compressed-tensors" else q8.scale.float().reshape(())
                out[f"{m}.{suffix['weight']}"] = q8.weight
                out[f"{m}.{suffix['weight_scale']}"] = scale
                rel = relative_error(w, fp8_dequantize_weight(q8, torch.float32)) if report else None
            if input_scale is not None:
                out[f"{m}.{suffix['input_scale']}"] = input_scale
            if rel is not None:
                errors.append(LinearError(m, target.component, scheme, rel))
        return out, errors

    def kv_scales(self, layer_prefix: str) -> dict[str, torch.Tensor]:
        act = self.options.act_amax
        if act is None:
            raise ConfigError("an FP8 KV cache needs k/v scales: calibration statistics or an explicit constant amax", option="act_amax")
        k_amax, v_amax = act.kv_amax(layer_prefix)
        names = kv_role_names(self.options.layout_format, layer_prefix)
        out = {}
        for role, amax in (("k_scale", k_amax), ("v_scale", v_amax)):
            spec = names[role]
            value = torch.tensor([amax], dtype=torch.float32) / FP8_E4M3_MAX
            dtype = {"BF16": torch.bfloat16, "F32": torch.float32, "F16": torch.float16}[spec.dtype]
            out[spec.name] = value.to(dtype).reshape(spec.shape)
        return out


@dataclass
class _ReadUnit:
    unit: WorkUnit
    passthrough: dict[str, bytes]
    weights: dict[str, torch.Tensor]
    nbytes: int


def _read_unit(unit: WorkUnit, ckpt: Checkpoint, pin: bool = False) -> _ReadUnit:
    """Read one unit's tensors (pass-through tensors as raw bytes, Linears as tensors; in
    page-locked host memory with ``pin``, for a fast copy to a CUDA device)."""
    passthrough = {name: ckpt.read_raw(name) for name in unit.passthrough}
    if pin:
        from fp4forge.model.streaming import CheckpointTensors

        reader = CheckpointTensors(ckpt)
        weights = {t.module: reader.read_host(f"{t.module}.weight", True) for t in unit.linears}
    else:
        weights = {t.module: ckpt.read_tensor(f"{t.module}.weight") for t in unit.linears}
    nbytes = sum(len(b) for b in passthrough.values()) + sum(w.numel() * w.element_size() for w in weights.values())
    return _ReadUnit(unit, passthrough, weights, nbytes)


def _quantize_unit(
    read: _ReadUnit, quantizer: UnitQuantizer, device: torch.device | None = None
) -> tuple[WorkUnit, dict[str, Any], list[LinearError], int]:
    tensors: dict[str, Any] = dict(read.passthrough)
    errors: list[LinearError] = []
    if read.unit.linears:
        device = device or quantizer.device
        pin = device.type == "cuda"
        weights = {m: w.to(device, non_blocking=pin) for m, w in read.weights.items()}
        quantized, errors = quantizer.quantize(read.unit, weights)
        tensors.update({name: value.cpu() for name, value in quantized.items()})  # the writer takes host tensors
    return read.unit, tensors, errors, read.nbytes


def _element_kernel(quantizer: UnitQuantizer) -> str:
    """The CPU path's NVFP4 min-max element kernel, for the summary (the bytes do not depend on it)."""
    if quantizer.device.type != "cpu":
        return ""
    status = kernel_status()
    return f"{status.name}: {status.detail}"


#: CPU path: bytes of work units (their stored tensors) read ahead of the computing threads, those
#: being computed included. The reader thread keeps this much queued in plan order, so an uncached
#: disk never idles while the threads compute (a window of ``workers + 1`` units was too shallow:
#: the disk waited for every unit's compute to start); memory: this plus one unit.
CPU_READ_AHEAD_BYTES = 512 << 20


#: Stored dtypes of Linear weights the CPU reader fills straight from the file (anything else: per tensor).
_STORED_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


def _unit_nbytes(unit: WorkUnit, ckpt: Checkpoint) -> int:
    """The stored bytes of the unit's tensors (its Linears' weights and its pass-through tensors)."""
    return sum(ckpt.locate(name)[1].nbytes for name in [*(f"{t.module}.weight" for t in unit.linears), *unit.passthrough])


def _read_unit_coalesced(unit: WorkUnit, ckpt: Checkpoint) -> _ReadUnit:
    """``_read_unit`` on the CPU path: the unit's weights (a fused group's members lie next to each
    other in their shard) as one coalesced run of large ``preadv`` requests straight into the
    tensors (:mod:`fp4forge.checkpoint.ranges`) instead of one open + read per tensor; where the
    weights cannot be read as stored bytes (a converting source), the per-tensor reads."""
    weights: dict[str, torch.Tensor] = {}
    buffers: dict[str, memoryview] = {}
    for target in unit.linears:
        name = f"{target.module}.weight"
        _, info = ckpt.locate(name)
        dtype = _STORED_DTYPES.get(info.dtype)
        if dtype is None or not info.nbytes:
            return _read_unit(unit, ckpt)
        tensor = torch.empty(list(info.shape), dtype=dtype)
        weights[target.module] = tensor
        buffers[name] = memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
    if buffers and not ranges.read_into(ckpt, buffers):
        return _read_unit(unit, ckpt)
    passthrough = {name: ckpt.read_raw(name) for name in unit.passthrough}
    nbytes = sum(len(b) for b in passthrough.values()) + sum(w.numel() * w.element_size() for w in weights.values())
    return _ReadUnit(unit, passthrough, weights, nbytes)


#: How many ``nice`` steps below the reader's and the writer's the compute threads run (per thread;
#: within the process's autogroup on Linux). 0, the default: on a loaded two-core machine it made no
#: difference (the export was bound by the CPU it got), and on a machine shared without autogroups it
#: would cost the export its share; the benchmark's niced arm (``FP4FORGE_COMPUTE_NICE=5``) measures
#: whether it lets the reader keep an idle machine's disk busier (benchmarks/RESULTS.md).
COMPUTE_NICE = int(_nice) if (_nice := os.environ.get("FP4FORGE_COMPUTE_NICE", "").strip()).isdigit() else 0


def _lower_priority() -> None:
    """Run the calling thread ``COMPUTE_NICE`` steps below the process's priority (Linux: per thread)."""
    if not COMPUTE_NICE or not hasattr(os, "setpriority"):
        return
    with contextlib.suppress(OSError):
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + COMPUTE_NICE)


def _process_units(units: list[WorkUnit], ckpt: Checkpoint, quantizer: UnitQuantizer, workers: int, read_ahead_bytes: int | None = None):
    """Yield processed units in plan order, `workers` of them computed at a time.

    One reader thread reads the units in plan order (coalesced requests per unit) up to
    ``read_ahead_bytes`` (:data:`CPU_READ_AHEAD_BYTES`) ahead of the yielded ones, so reading
    overlaps computing and writing: the disk is never idle while there is room in the budget, and
    an uncached source costs little wall time beyond its read. Torch kernels release the GIL, so
    threads with one intra-op thread each keep every core busy without the oversubscription of
    nested OpenMP pools, and every sum runs on one thread: the error report does not depend on
    `workers`. ``workers + 1`` units are computed at a time; memory is bounded by the read-ahead
    budget plus one unit whatever the model's size. Writing stays on the caller's thread."""
    budget = CPU_READ_AHEAD_BYTES if read_ahead_bytes is None else read_ahead_bytes
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="fp4forge-read") as reader,
            ThreadPoolExecutor(max_workers=workers, thread_name_prefix="fp4forge-quantize", initializer=_lower_priority) as pool,
        ):
            todo = iter(units)
            reads: deque = deque()  # (read future, bytes): queued or read, not yet computing
            window: deque = deque()  # (compute future, bytes), in plan order
            held = 0  # bytes of the units in `reads` and `window`

            def read_ahead() -> None:
                nonlocal held
                while held < budget or not (reads or window):
                    unit = next(todo, None)
                    if unit is None:
                        return
                    size = _unit_nbytes(unit, ckpt)
                    reads.append((reader.submit(_read_unit_coalesced, unit, ckpt), size))
                    held += size

            try:
                while True:
                    read_ahead()
                    while reads and len(window) <= workers:
                        read, size = reads.popleft()
                        window.append((pool.submit(lambda r=read: _quantize_unit(r.result(), quantizer)), size))
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
    finally:
        torch.set_num_threads(previous_threads)


#: BF16 bytes of work units a device batch holds: its stackable units are quantized in one pass per
#: stack; large enough that a stack costs a few dozen kernel launches for ~30 expert projections,
#: small enough that the first batch's read (before any compute) and the pinned memory (three
#: batches in flight) stay small.
DEVICE_BATCH_BYTES = 256 << 20
#: Elements per chunk of the stacked encoder on a CUDA device (F32 temporaries of 256 MiB each).
DEVICE_CHUNK_ELEMENTS = 1 << 26
#: Threads reading the next batches into page-locked memory (the disk wants several requests in flight).
DEVICE_READ_THREADS = 4
#: Read a batch's stacked weights as a few large sequential requests of ``DEVICE_READ_REQUEST_BYTES``
#: scattered into the stacks (``checkpoint.ranges``), not one read per tensor (6.3 MB for an expert
#: projection of hidden 3072): the disk's rate is measured with large sequential reads.
DEVICE_COALESCED_READS = True
DEVICE_READ_REQUEST_BYTES = 64 << 20
#: Hint the kernel to read each batch's whole file range ahead (posix_fadvise WILLNEED) when the
#: batch is queued. Off: on the H200's disk it did not help (1.09 GB/s with it, 1.15 without, in
#: one run; benchmarks/RESULTS.md); a switch for disks where it does.
WILLNEED_HINT = False


def _stack_signature(unit: WorkUnit, options: QuantizeOptions) -> tuple | None:
    """Units with the same signature are quantized as one stack (:func:`nvfp4_quantize_stacked`):
    NVFP4 with minmax block scales, no precomputed weights, every Linear of the unit of one shape
    and dtype (a fused gate/up pair, or one projection). None: the unit goes the per-unit way."""
    if not unit.linears or unit.passthrough or options.block_scales != "minmax" or options.precomputed is not None:
        return None
    if not unit.linears[0].scheme.startswith("nvfp4"):
        return None
    shapes = {(t.scheme, t.out_features, t.in_features, t.source_dtype) for t in unit.linears}
    if len(shapes) != 1:
        return None
    ((scheme, out_features, in_features, dtype),) = shapes
    if dtype not in ("BF16", "F16", "F32") or out_features == 0 or in_features == 0 or in_features % 16:
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
    singles: dict[str, Any]  # unit key -> Future[_ReadUnit] (pass-through and per-unit Linears)
    event: Any = None


def _plan_batches(units: list[WorkUnit], options: QuantizeOptions, batch_bytes: int) -> list[list[WorkUnit]]:
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


def _start_batch(units: list[WorkUnit], ckpt: Checkpoint, quantizer: UnitQuantizer, pool: ThreadPoolExecutor) -> _Batch:
    """Allocate a batch's stacks (page-locked for CUDA) and queue every tensor's read on ``pool``."""
    from fp4forge.model.streaming import CheckpointTensors

    pin = quantizer.device.type == "cuda"
    reader = CheckpointTensors(ckpt)
    groups: dict[tuple, list[WorkUnit]] = {}
    singles: dict[str, Any] = {}
    for unit in units:
        signature = _stack_signature(unit, quantizer.options)
        if signature is None:
            singles[unit.key] = pool.submit(_read_unit, unit, ckpt, pin)
        else:
            groups.setdefault(signature, []).append(unit)
    if WILLNEED_HINT:
        names = [f"{t.module}.weight" for u in units for t in u.linears] + [n for u in units for n in u.passthrough]
        pool.submit(reader.will_need, names)
    stacks = []
    slots: dict[str, tuple[_Stack, torch.Tensor]] = {}  # weight name -> its stack and slice
    for (_, linears, out_features, in_features, dtype), members in groups.items():
        torch_dtype = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}[dtype]
        host = torch.empty((len(members) * linears, out_features, in_features), dtype=torch_dtype, pin_memory=pin)
        stack = _Stack(members, host)
        for i, target in enumerate(t for u in members for t in u.linears):
            slots[f"{target.module}.weight"] = (stack, host[i])
        stacks.append(stack)
    if not (DEVICE_COALESCED_READS and _queue_coalesced_reads(slots, ckpt, pool)):
        for name, (stack, out) in slots.items():
            stack.reads.append(pool.submit(reader.read_host, name, pin, out))
    return _Batch(units, stacks, singles)


def _queue_coalesced_reads(slots: dict[str, tuple[_Stack, torch.Tensor]], ckpt: Checkpoint, pool: ThreadPoolExecutor) -> bool:
    """Queue the reads of the batch's stacked weights as a few large sequential requests
    (:mod:`fp4forge.checkpoint.ranges`: a batch of a layer's experts is one contiguous byte range
    of its shard), each scattered straight into the stacks' page-locked slices; a stack waits
    for the requests that cover its slices. False (nothing queued) where the weights cannot be
    read as stored bytes of their stack's dtype: the caller reads them tensor by tensor."""
    if not slots:
        return True
    torch_dtype_codes = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}
    for name, (_, out) in slots.items():
        if ckpt.locate(name)[1].dtype != torch_dtype_codes.get(out.dtype):
            return False
    requests = ranges.plan_reads(ckpt, slots, request_bytes=DEVICE_READ_REQUEST_BYTES)
    if requests is None:
        return False
    buffers = {name: memoryview(out.reshape(-1).view(torch.uint8).numpy()) for name, (_, out) in slots.items()}
    ranges.check_buffers(ckpt, buffers)
    for request in requests:
        future = pool.submit(ranges.read_request, ckpt, request, buffers)
        for stack in {id(slots[key][0]): slots[key][0] for key in request.keys}.values():
            stack.reads.append(future)
    return True


def _compute_batch(batch: _Batch, quantizer: UnitQuantizer) -> None:
    """Queue the batch's stacked numerics on the device and the copies of their results into
    page-locked host memory; nothing waits for the device here (``batch.event`` marks the end)."""
    cuda = quantizer.device.type == "cuda"
    for stack in batch.stacks:
        for read in stack.reads:
            read.result()
        weights = stack.host.to(quantizer.device, non_blocking=cuda)
        linears = len(stack.units[0].linears)
        result = nvfp4_quantize_stacked(
            weights,
            convention=quantizer.convention,
            group=linears,
            error=quantizer.options.error_report,
            chunk_elements=DEVICE_CHUNK_ELEMENTS if cuda else None,
        )
        stack.result = result.to("cpu", non_blocking=True, pin_memory=True) if cuda else result
    if cuda:
        batch.event = torch.cuda.Event()
        batch.event.record()


def _finish_batch(batch: _Batch, ckpt: Checkpoint, quantizer: UnitQuantizer):
    """Yield the batch's units as ``_quantize_unit`` does, in plan order, once the device is done."""
    if batch.event is not None:
        batch.event.synchronize()
    done: dict[str, tuple] = {}
    for stack in batch.stacks:
        done.update(_unpack_stack(stack, ckpt, quantizer))
    for unit in batch.units:
        if unit.key in done:
            yield done[unit.key]
        else:
            yield _quantize_unit(batch.singles[unit.key].result(), quantizer)


def _unpack_stack(stack: _Stack, ckpt: Checkpoint, quantizer: UnitQuantizer) -> dict[str, tuple]:
    result = stack.result
    finite = result.finite.tolist()
    regular = result.regular.tolist()
    err = result.err_sq.double().tolist() if result.err_sq is not None else None
    ref = result.ref_sq.double().tolist() if result.ref_sq is not None else None
    scheme = stack.units[0].linears[0].scheme
    suffix = role_suffixes(quantizer.options.layout_format, scheme)
    out: dict[str, tuple] = {}
    index = 0
    for unit in stack.units:
        first = index
        index += len(unit.linears)
        for i, target in zip(range(first, index), unit.linears):
            if not finite[i]:
                raise NumericsError(f"{target.module}: weight holds NaN or Inf; refusing to quantize it")
        nbytes = sum(stack.host[i].numel() * stack.host[i].element_size() for i in range(first, index))
        if not all(regular[first:index]):
            # a zero or infinite step (ModelOpt scalars of denormal weights): the general path, on the host
            read = _ReadUnit(unit, {}, {t.module: stack.host[i] for i, t in zip(range(first, index), unit.linears)}, nbytes)
            out[unit.key] = _quantize_unit(read, quantizer, torch.device("cpu"))
            continue
        input_scale = None
        if scheme == "nvfp4":
            input_scale = quantizer._input_scale(scheme, quantizer._input_amax([t.module for t in unit.linears]))
        tensors: dict[str, Any] = {}
        errors: list[LinearError] = []
        for i, target in zip(range(first, index), unit.linears):
            q = result.weight(i)
            m = target.module
            tensors[f"{m}.{suffix['packed']}"] = q.packed
            tensors[f"{m}.{suffix['block_scale']}"] = q.block_scale
            tensors[f"{m}.{suffix['global_scale']}"] = q.global_scale
            if input_scale is not None:
                tensors[f"{m}.{suffix['input_scale']}"] = input_scale
            if err is not None and ref is not None:
                rel = 0.0 if ref[i] == 0.0 else math.sqrt(err[i] / ref[i])
                errors.append(LinearError(m, target.component, scheme, rel))
        out[unit.key] = (unit, tensors, errors, nbytes)
    return out


def _process_units_on_device(
    units: list[WorkUnit], ckpt: Checkpoint, quantizer: UnitQuantizer, batch_bytes: int | None = None, read_ahead: int = 2
):
    """The GPU path. Units go in batches of about ``batch_bytes`` of weights; in a batch, the
    units of one signature (a layer's expert gate/up pairs, its down projections) are read
    straight into one page-locked stack (a batch's stacked weights as a few large sequential
    requests of its contiguous file range, :func:`_queue_coalesced_reads`) and quantized by one
    stacked pass
    (:func:`nvfp4_quantize_stacked`: no host sync, a few dozen kernels per stack instead of that
    many per Linear), the rest one unit at a time. Software-pipelined on the calling thread:
    batch k+1's numerics and result copies are queued on the device before batch k's units are
    yielded (and written by the caller), and ``DEVICE_READ_THREADS`` threads read the next
    ``read_ahead`` batches meanwhile. (Several threads sharing one GPU were measured 3-4x slower
    than one: they contend for the GIL and the stream.) Yields as ``_process_units``, in plan order."""
    batches = _plan_batches(units, quantizer.options, batch_bytes or DEVICE_BATCH_BYTES)
    with ThreadPoolExecutor(max_workers=DEVICE_READ_THREADS, thread_name_prefix="fp4forge-read") as pool:
        started: deque[_Batch] = deque()
        queue = iter(batches)
        try:
            for members in itertools.islice(queue, read_ahead + 1):
                started.append(_start_batch(members, ckpt, quantizer, pool))
            computed: _Batch | None = None
            while started:
                batch = started.popleft()
                _compute_batch(batch, quantizer)
                following = next(queue, None)
                if following is not None:
                    started.append(_start_batch(following, ckpt, quantizer, pool))
                if computed is not None:
                    yield from _finish_batch(computed, ckpt, quantizer)
                computed = batch
            if computed is not None:
                yield from _finish_batch(computed, ckpt, quantizer)
        finally:
            for batch in started:  # an error or a closed generator: drop the queued reads
                for future in [*batch.singles.values(), *(r for st in batch.stacks for r in st.reads)]:
                    future.cancel()


#: Output bytes after which the shards written so far are synced to disk in the background.
WRITEBACK_BYTES = 256 << 20


class _Writeback:
    """Moves written shard data to the disk while the export goes on (one ``fdatasync`` at a
    time on a background thread, every ``WRITEBACK_BYTES``): on a machine with much RAM the
    kernel would otherwise keep it all dirty until the output's final fsync (2.8 s of a 14.5 s GPU
    export on the H200). Both paths use it: on the CPU the element kernel made the output writes
    the export's limit (writes and the final fsync were ~60 % of the main thread's wall time in a
    profile; benchmarks/RESULTS.md), and the background sync overlaps them with the quantizing."""

    def __init__(self, writer: CheckpointWriter, every: int | None = None):
        self.writer, self.every, self.pending = writer, every or WRITEBACK_BYTES, 0
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fp4forge-writeback")
        self.running: Any = None

    def wrote(self, nbytes: int) -> None:
        self.pending += nbytes
        if self.pending >= self.every and (self.running is None or self.running.done()):
            self.pending = 0
            self.running = self.pool.submit(self.writer.flush_data)

    def __enter__(self) -> _Writeback:
        return self

    def __exit__(self, *exc: object) -> None:
        self.pool.shutdown(wait=True)


def summarize_errors(errors: list[LinearError]) -> dict[str, Any]:
    by_component: dict[str, list[float]] = {}
    for e in errors:
        by_component.setdefault(f"{e.component}:{e.scheme}", []).append(e.relative_error)
    worst = sorted(errors, key=lambda e: -e.relative_error)[:10]
    return {
        "by_component": {
            k: {"linears": len(v), "mean": statistics.fmean(v), "median": statistics.median(v), "max": max(v)} for k, v in sorted(by_component.items())
        },
        "worst": [{"module": e.module, "relative_error": e.relative_error} for e in worst],
    }


def quantize_checkpoint(src: str | Path, out: str | Path, options: QuantizeOptions, progress: Progress | None = None) -> ExportSummary:
    started = time.perf_counter()
    ckpt = dequantized_source(open_checkpoint(src))  # a block-FP8 release reads as the BF16 model
    _check_source(ckpt)
    layout = layout_for_config(ckpt.config)
    specs = _source_specs(ckpt)
    plan = plan_export(specs, layout, options.recipe, options.layout_format)
    if _needs_act_scales(plan) and options.act_amax is None:
        raise ConfigError(
            f"recipe {options.recipe.name} quantizes activations (W4A4 / static FP8 / FP8 KV): it needs calibration "
            "statistics (from `fp4forge calibrate`) or an explicit constant amax (recorded as uncalibrated)",
            option="act_amax",
        )
    all_linears = linear_names(specs, layout)
    source_digest = ckpt.header_digest()
    key = resume_key(plan, options, source_digest)
    out = Path(out)
    quantizer = UnitQuantizer(options)
    bytes_read = 0
    total_units = len(plan.units) + (1 if plan.kv_layers else 0)
    ranks = distributed.current()  # several processes: each quantizes its block of the units
    progress = progress if ranks.is_main else None
    writer = CheckpointWriter(out, plan.output_specs, max_shard_bytes=options.max_shard_bytes, resume_key=key, part=ranks.rank)
    with _shared_writer(writer, ranks):
        resumed = len(writer.completed_units)
        pending = ranks.share([u for u in plan.units if u.key not in writer.completed_units])
        finished: dict[str, list[LinearError]] = {
            u.key: [LinearError(**e) for e in writer.completed_payloads.get(u.key) or []] for u in plan.units if u.key in writer.completed_units
        }
        done = resumed
        with _Writeback(writer) as writeback:
            units = _process_units(pending, ckpt, quantizer, options.workers) if quantizer.device.type == "cpu" else _process_units_on_device(pending, ckpt, quantizer)
            for unit, tensors, unit_errors, unit_bytes in units:
                for name, tensor in tensors.items():
                    writer.write(name, tensor)
                writer.commit_unit(unit.key, list(tensors), [e.__dict__ for e in unit_errors])
                writeback.wrote(sum(t.numel() * t.element_size() if isinstance(t, torch.Tensor) else len(t) for t in tensors.values()))
                finished[unit.key] = unit_errors
                bytes_read += unit_bytes
                done += 1
                if progress:
                    progress(done, total_units, f"{unit.key} · {bytes_read / 1e9 / max(time.perf_counter() - started, 1e-9):.3f} GB/s")
        bytes_read = _gather_parts(writer, ranks, finished, bytes_read)
        errors = [e for u in plan.units for e in finished.get(u.key, [])]  # plan order, resumed or not
        if ranks.is_main and plan.kv_layers and "kv_scales" not in writer.completed_units:
            kv = {}
            for prefix in plan.kv_layers:
                kv.update(quantizer.kv_scales(prefix))
            for name, tensor in kv.items():
                writer.write(name, tensor)
            writer.commit_unit("kv_scales", list(kv))
        if ranks.is_main:
            _write_companions(writer, ckpt, plan, options, all_linears, errors, source_digest)
    summary = ExportSummary(
        output=str(out),
        layout_format=options.layout_format,
        recipe=options.recipe.name,
        tensors_written=len(plan.output_specs),
        bytes_read=bytes_read,
        bytes_written=sum(s.nbytes for s in plan.output_specs),
        seconds=time.perf_counter() - started,
        resumed_units=resumed,
        weight_error=summarize_errors(errors) if errors else {},
        element_kernel=_element_kernel(quantizer),
    )
    return summary


# -- several processes (torchrun): one output, the same bytes as one process ---------------------------
@contextlib.contextmanager
def _shared_writer(writer: CheckpointWriter, ranks: distributed.Ranks):
    """Enter ``writer`` as one part of a shared output. One process: the plain writer. Several:
    rank 0 creates (or reopens, to resume) the staging directory, then the others join it; each
    writes its units at their planned offsets; rank 0 alone finishes (renames) the output, after
    every part's units are on disk (:func:`_gather_parts`). A rank's failure stops them all."""
    if not ranks.distributed:
        with writer:
            yield writer
        return
    for step, mine in (("creating the output", ranks.is_main), ("joining the output", not ranks.is_main)):
        if mine:
            try:
                writer.__enter__()
            except BaseException:
                ranks.fail(step)
                raise
        ranks.agree(True, step)
    try:
        yield writer
    except BaseException as exc:
        ranks.fail("quantize")
        writer.__exit__(type(exc), exc, exc.__traceback__)
        raise
    try:
        writer.__exit__(None, None, None)
    except BaseException:
        ranks.fail("finishing the output")
        raise
    ranks.agree(True, "finishing the output")


def _gather_parts(writer: CheckpointWriter, ranks: distributed.Ranks, finished: dict[str, list[LinearError]], bytes_read: int) -> int:
    """After every rank's units: rank 0 reads the parts' journals (their units count as written),
    and every rank gets every unit's weight errors; returns the bytes all ranks read."""
    if not ranks.distributed:
        return bytes_read
    if not ranks.is_main:
        writer.sync()
    ranks.agree(True, "quantizing the work units")

    def payloads() -> dict[str, Any]:
        writer.refresh()
        return {unit: writer.completed_payloads.get(unit) or [] for unit in writer.completed_units}

    mine = {unit: [e.__dict__ for e in errors] for unit, errors in finished.items()}
    every = ranks.on_main(lambda: {**payloads(), **mine}, "reading the parts' journals")
    finished.update({unit: [LinearError(**e) for e in errors] for unit, errors in every.items() if unit != "kv_scales"})
    return ranks.sum_int(bytes_read)


def _write_companions(
    writer: CheckpointWriter,
    ckpt: Checkpoint,
    plan: ExportPlan,
    options: QuantizeOptions,
    all_linears: list[str],
    errors: list[LinearError],
    source_digest: str,
) -> None:
    """config.json with the declaration, tokenizer and other files copied, provenance (no
    timestamps or durations: a resumed run writes the same bytes as an uninterrupted one)."""
    config = dict(ckpt.config or {})
    if options.layout_format == "compressed-tensors":
        config["quantization_config"] = compressed_tensors_config(plan, all_linears)
    else:
        config_form, hf_quant = modelopt_configs(plan, all_linears, __version__)
        config["quantization_config"] = config_form
        writer.write_json(HF_QUANT_CONFIG_JSON, hf_quant)
    writer.write_json(CONFIG_JSON, config)
    source_root = getattr(ckpt.source, "root", None)
    if source_root is not None:
        for path in sorted(Path(source_root).iterdir()):
            if path.is_file() and path.name not in REWRITTEN and is_model_repo_file(path.name):
                writer.copy_file(path, path.name)
    provenance = {
        "fp4forge_version": __version__,
        "recipe": {"name": options.recipe.name, "source": options.recipe.source, "text": options.recipe.text},
        "layout": options.layout_format,
        "options": {"block_scales": options.block_scales, "max_shard_bytes": options.max_shard_bytes}
        | ({} if options.error_report else {"error_report": False}),
        "method": options.precomputed.provenance() if options.precomputed is not None else {"method": "rtn", "block_scales": options.block_scales},
        "activation_scales": options.act_amax.provenance() if options.act_amax else None,
        "source": {"location": ckpt.display, "header_digest": source_digest, "shards": ckpt.shard_names}
        | ({"dequantized_from": ckpt.dequantized_from} if isinstance(ckpt, BlockFp8Source) else {}),
        "fused_groups": {"count": len(plan.fused_groups), "rule": "one weight global scale per group, from the group's max amax"},
        "ignored_modules": plan.ignored,
        "kv_cache": {"scheme": options.recipe.kv_cache_scheme, "layers": len(plan.kv_layers)} if plan.kv_layers else None,
        "weight_error": summarize_errors(errors) if errors else None,
    }
    writer.write_json(PROVENANCE_JSON, provenance)
