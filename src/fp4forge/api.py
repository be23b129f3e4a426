"""fp4forge's Python API: one function per job, the same ones the command line calls.

Use it from ``fp4forge`` itself (``fp4forge.audit_checkpoint(path)``): the package imports this
module, and what each function needs, only when a name is first used, so ``import fp4forge``
stays cheap. The names carry their object (``audit_checkpoint``, not ``audit``) because
``fp4forge.audit``, ``.quantize`` and ``.calibrate`` are subpackages: importing one rebinds that
attribute of the package, so a function of the same name would silently become a module.
Errors are ``fp4forge.errors.Fp4forgeError`` subclasses; an error about an argument names it in
``error.option`` (the keyword below).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

# The jobs' options (light modules: importing them loads no torch), under the package's name too.
from fp4forge.audit.options import AuditOptions, ByteTableOptions, DiffOptions
from fp4forge.calibrate.options import CalibrationOptions
from fp4forge.fidelity.options import FidelityOptions
from fp4forge.model.samples import SampleOptions
from fp4forge.quantize.job import GptqOptions, QuantizeJob

if TYPE_CHECKING:
    from fp4forge.audit.byte_table import ByteTable
    from fp4forge.audit.diff import DiffReport
    from fp4forge.audit.findings import AuditReport
    from fp4forge.fidelity.evaluate import FidelityReport
    from fp4forge.checkpoint.reader import Checkpoint
    from fp4forge.quantize.job import QuantizeResult

OPTIONS = ("AuditOptions", "ByteTableOptions", "DiffOptions", "CalibrationOptions", "FidelityOptions", "GptqOptions", "QuantizeJob", "SampleOptions")
__all__ = ["audit_checkpoint", "byte_table", "calibrate_checkpoint", "diff_checkpoints", "measure_fidelity", "open_checkpoint",
           "quantize_checkpoint", *OPTIONS]

Progress = Callable[[int, int, str], None]


def open_checkpoint(location: str | Path) -> Checkpoint:
    """A checkpoint (directory, .safetensors file, HF repo id or ``/resolve/`` URL), read from its
    headers; tensors are read on demand."""
    from fp4forge.checkpoint.reader import open_checkpoint as _open

    return _open(location)


def audit_checkpoint(location: str | Path, options: AuditOptions | None = None) -> AuditReport:
    """Will it load, and load right? ``options``: an :class:`AuditOptions` (``deep``, ``fmt``,
    ``vllm_version``, ``trust_remote_code``). ``report.findings``, ``report.exit_code``, ``report.to_json()``."""
    from fp4forge.audit.engine import audit_checkpoint as _audit

    return _audit(location, options or AuditOptions())


def quantize_checkpoint(src: str | Path, out: str | Path, job: QuantizeJob, *, progress: Progress | None = None) -> QuantizeResult:
    """The quantize job, as ``fp4forge quantize`` runs it: the BF16 checkpoint ``src`` into the new
    directory ``out``. ``job``: a :class:`QuantizeJob` (a recipe, a built-in name or a .toml file;
    ``stats=`` a statistics file from :func:`calibrate_checkpoint`, or ``act_scales="constant:AMAX"``;
    layout, block scales, device, threads, ``method="gptq"`` with ``gptq=GptqOptions(...)``).
    ``result.export`` is the export's summary, ``result.gptq`` GPTQ's (or None)."""
    from fp4forge.quantize.job import run_quantize

    return run_quantize(src, out, job, progress=progress)


def calibrate_checkpoint(
    src: str | Path,
    stats_out: str | Path,
    options: CalibrationOptions | None = None,
    *,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Activation and KV amax of the BF16 checkpoint ``src``, layer-streamed, written to the
    statistics file ``stats_out`` (what :func:`quantize_checkpoint`'s ``stats`` reads); returns
    its summary (tensors, tokens, seconds, experts that saw no token...)."""
    from fp4forge.calibrate.run import calibrate_to_file

    return calibrate_to_file(src, stats_out, options or CalibrationOptions(), progress=progress)


def byte_table(location: str | Path, options: ByteTableOptions | None = None) -> ByteTable:
    """Where the bytes are: stored bytes, parameters and bits/param per component (headers only);
    ``options``: a :class:`ByteTableOptions` (``layout`` by name, else the config's, else inferred)."""
    from fp4forge.audit.byte_table import byte_table_of

    return byte_table_of(location, options or ByteTableOptions())


def diff_checkpoints(a: str | Path, b: str | Path, options: DiffOptions | None = None, *, progress: Progress | None = None) -> DiffReport:
    """Which tensors two checkpoints share byte for byte; ``DiffOptions(values=True)``: also the max abs / rel difference."""
    from fp4forge.audit.diff import diff_checkpoints as _diff

    return _diff(a, b, options or DiffOptions(), progress=progress)


def measure_fidelity(
    teacher: str | Path,
    student: str | Path,
    options: FidelityOptions | None = None,
    *,
    progress: Progress | None = None,
) -> FidelityReport:
    """KL, top-1 agreement and perplexity of the quantized ``student`` against its BF16 ``teacher``,
    each with its bootstrap interval over documents (``.metrics["intervals"]``). Held-out text is
    ``options.text_files``: none given raises ``TextRequiredError``; text the teacher cannot read
    raises ``UnreadableTextError`` unless ``options.allow_unreadable`` (docs/fidelity.md)."""
    from fp4forge.fidelity.evaluate import evaluate

    return evaluate(teacher, student, options or FidelityOptions(), progress=progress)
