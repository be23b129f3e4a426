"""The streaming exporter behind `fp4forge quantize`: the job's driver.

One work unit at a time (a fused group of Linears sharing a global scale, one Linear, or one
pass-through tensor): read its BF16 tensors, quantize, write them at their planned offsets,
journal the unit, free it. Peak memory is one unit, whatever the model's depth. The output
appears only when complete; a killed run leaves `.OUT.partial/` with its journal, and the same
command continues from there and produces the same bytes as an uninterrupted run.

Reading order: ``options.py`` (what is asked) -> ``unit.py`` (one unit's arithmetic, by the
schemes' codecs in ``checkpoint/codecs.py``) -> ``schedule_cpu.py`` / ``schedule_device.py``
(how units flow through threads or a GPU, tuned by ``schedule.py``) -> this module (plan,
write, resume, several processes, companion files).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fp4forge import __version__
from fp4forge.checkpoint.codecs import needs_activation_amax
from fp4forge.checkpoint.convert import BlockFp8Source, dequantized_source
from fp4forge.checkpoint.layout import Layout, layout_for_config
from fp4forge.checkpoint.names import CONFIG_JSON, HF_QUANT_CONFIG_JSON, INDEX_JSON, PROVENANCE_JSON, is_model_repo_file
from fp4forge.checkpoint.reader import Checkpoint, open_checkpoint
from fp4forge.checkpoint.writer import CheckpointWriter, TensorSpec
from fp4forge.errors import ConfigError
from fp4forge.model import distributed
from fp4forge.quantize.options import BLOCK_SCALES, LAYOUT_FORMATS, BlockScales, LayoutFormat, Progress, QuantizeOptions
from fp4forge.quantize.plan import ExportPlan, plan_export
from fp4forge.quantize.qconfig import quantization_configs
from fp4forge.quantize.schedule import ExportSchedule
from fp4forge.quantize.schedule_cpu import process_units
from fp4forge.quantize.schedule_device import process_units_on_device
from fp4forge.quantize.unit import LinearError, UnitQuantizer, UnitResult, element_kernel

__all__ = [
    "BLOCK_SCALES", "LAYOUT_FORMATS", "BlockScales", "ExportSchedule", "ExportSummary", "LayoutFormat",
    "LinearError", "Progress", "QuantizeOptions", "UnitQuantizer", "linear_names", "quantize_checkpoint",
]

# Files the exporter writes itself; of the source's other files only those a model repository holds
# (checkpoint/names.py MODEL_REPO_FILES) are copied.
REWRITTEN = {CONFIG_JSON, INDEX_JSON, PROVENANCE_JSON, HF_QUANT_CONFIG_JSON}


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


def _needs_act_scales(plan: ExportPlan, layout_format: str) -> bool:
    return any(needs_activation_amax(t.scheme, layout_format) for t in plan.targets.values()) or bool(plan.kv_layers)


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


class _Writeback:
    """Moves written shard data to the disk while the export goes on (one ``fdatasync`` at a
    time on a background thread, every ``schedule.writeback_bytes``): on a machine with much RAM the
    kernel would otherwise keep it all dirty until the output's final fsync (2.8 s of a 14.5 s GPU
    export on the H200). Both paths use it: on the CPU the element kernel made the output writes
    the export's limit (writes and the final fsync were ~60 % of the main thread's wall time in a
    profile; benchmarks/RESULTS.md), and the background sync overlaps them with the quantizing."""

    def __init__(self, writer: CheckpointWriter, every: int):
        self.writer, self.every, self.pending = writer, every, 0
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


# Significant digits of a reported weight error. Its sums are F64 sums of the same F32 squares on
# every path (the C kernel, torch on any CPU kernel family, thread count or device) and differ by
# summation order only (~1e-15 relative); rounding to 6 digits hides that unless a value sits
# within that of a rounding boundary (not seen on the tested exports: tests/test_export_cpu_kinds.py),
# so the provenance is in practice the same bytes on every machine (docs/quantization.md#the-same-bytes-on-every-cpu).
REPORTED_ERROR_DIGITS = 6


def reported_error(value: float) -> float:
    return float(f"{value:.{REPORTED_ERROR_DIGITS}g}")


def summarize_errors(errors: list[LinearError]) -> dict[str, Any]:
    """Per component and scheme: mean (``fmean`` sums by ``fsum``, exactly rounded, so in any
    order), median and max of the rounded per-Linear errors; the ten worst Linears."""
    by_component: dict[str, list[float]] = {}
    for e in errors:
        by_component.setdefault(f"{e.component}:{e.scheme}", []).append(reported_error(e.relative_error))
    worst = sorted(errors, key=lambda e: -reported_error(e.relative_error))[:10]
    return {
        "by_component": {
            k: {"linears": len(v), "mean": statistics.fmean(v), "median": statistics.median(v), "max": max(v)} for k, v in sorted(by_component.items())
        },
        "worst": [{"module": e.module, "relative_error": reported_error(e.relative_error)} for e in worst],
    }


@dataclass
class _Job:
    """One export's fixed parts, shared by its steps."""

    ckpt: Checkpoint
    plan: ExportPlan
    options: QuantizeOptions
    schedule: ExportSchedule
    quantizer: UnitQuantizer
    source_digest: str
    all_linears: list[str]


def _prepare(src: str | Path, options: QuantizeOptions, schedule: ExportSchedule) -> _Job:
    """Open the source, plan the output, refuse what cannot be written (before any work)."""
    ckpt = dequantized_source(open_checkpoint(src))  # a block-FP8 release reads as the BF16 model
    _check_source(ckpt)
    layout = layout_for_config(ckpt.config)
    specs = _source_specs(ckpt)
    plan = plan_export(specs, layout, options.recipe, options.layout_format)
    if _needs_act_scales(plan, options.layout_format) and options.act_amax is None:
        raise ConfigError(
            f"recipe {options.recipe.name} quantizes activations (W4A4 / static FP8 / FP8 KV): it needs calibration "
            "statistics (from `fp4forge calibrate`) or an explicit constant amax (recorded as uncalibrated)",
            option="act_amax",
        )
    return _Job(ckpt, plan, options, schedule, UnitQuantizer(options), ckpt.header_digest(), linear_names(specs, layout))


def _processed(job: _Job, pending: list) -> Any:
    """The schedule that fits the device: the CPU pool, or the stacked device path."""
    if job.quantizer.device.type == "cpu" and job.schedule.path == "auto":
        return process_units(pending, job.ckpt, job.quantizer, job.options.workers, job.schedule)
    return process_units_on_device(pending, job.ckpt, job.quantizer, job.schedule)


def _write_units(job: _Job, writer: CheckpointWriter, pending: list, finished: dict[str, list[LinearError]], done: int, progress: Progress | None, started: float) -> int:
    """Quantize and write the pending units, journalling each; returns the bytes read."""
    total_units = len(job.plan.units) + (1 if job.plan.kv_layers else 0)
    bytes_read = 0
    with _Writeback(writer, job.schedule.writeback_bytes) as writeback:
        result: UnitResult
        for result in _processed(job, pending):
            unit, tensors, unit_errors, unit_bytes = result
            for name, tensor in tensors.items():
                writer.write(name, tensor)
            writer.commit_unit(unit.key, list(tensors), [e.__dict__ for e in unit_errors])
            writeback.wrote(sum(t.numel() * t.element_size() if isinstance(t, torch.Tensor) else len(t) for t in tensors.values()))
            finished[unit.key] = unit_errors
            bytes_read += unit_bytes
            done += 1
            if progress:
                progress(done, total_units, f"{unit.key} · {bytes_read / 1e9 / max(time.perf_counter() - started, 1e-9):.3f} GB/s")
    return bytes_read


def _write_kv_scales(job: _Job, writer: CheckpointWriter) -> None:
    if not job.plan.kv_layers or "kv_scales" in writer.completed_units:
        return
    kv = {}
    for prefix in job.plan.kv_layers:
        kv.update(job.quantizer.kv_scales(prefix))
    for name, tensor in kv.items():
        writer.write(name, tensor)
    writer.commit_unit("kv_scales", list(kv))


def quantize_checkpoint(
    src: str | Path, out: str | Path, options: QuantizeOptions, progress: Progress | None = None, schedule: ExportSchedule | None = None
) -> ExportSummary:
    """Write the quantized checkpoint of ``src`` at ``out`` (``schedule``: how the work flows; the
    default, with ``FP4FORGE_COMPUTE_NICE`` applied, is the measured one; no byte depends on it)."""
    started = time.perf_counter()
    job = _prepare(src, options, schedule or ExportSchedule.from_environment())
    plan, out = job.plan, Path(out)
    ranks = distributed.current()  # several processes: each quantizes its block of the units
    progress = progress if ranks.is_main else None
    key = resume_key(plan, options, job.source_digest)
    writer = CheckpointWriter(out, plan.output_specs, max_shard_bytes=options.max_shard_bytes, resume_key=key, part=ranks.rank)
    with _shared_writer(writer, ranks):
        resumed = len(writer.completed_units)
        pending = ranks.share([u for u in plan.units if u.key not in writer.completed_units])
        finished: dict[str, list[LinearError]] = {
            u.key: [LinearError(**e) for e in writer.completed_payloads.get(u.key) or []] for u in plan.units if u.key in writer.completed_units
        }
        bytes_read = _write_units(job, writer, pending, finished, resumed, progress, started)
        bytes_read = _gather_parts(writer, ranks, finished, bytes_read)
        errors = [e for u in plan.units for e in finished.get(u.key, [])]  # plan order, resumed or not
        if ranks.is_main:
            _write_kv_scales(job, writer)
            _write_companions(writer, job.ckpt, plan, options, job.all_linears, errors, job.source_digest)
    return ExportSummary(
        output=str(out),
        layout_format=options.layout_format,
        recipe=options.recipe.name,
        tensors_written=len(plan.output_specs),
        bytes_read=bytes_read,
        bytes_written=sum(s.nbytes for s in plan.output_specs),
        seconds=time.perf_counter() - started,
        resumed_units=resumed,
        weight_error=summarize_errors(errors) if errors else {},
        element_kernel=element_kernel(job.quantizer),
    )


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
    config["quantization_config"], hf_quant = quantization_configs(options.layout_format, plan, all_linears, __version__)
    if hf_quant is not None:
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
