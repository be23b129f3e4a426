"""fp4forge: make, prove and measure NVFP4 / FP8 checkpoints of MoE LLMs.

The Python API (each function in :mod:`fp4forge.api`, imported on first use)::

    import fp4forge

    ckpt = fp4forge.open_checkpoint("path/or/org/repo")
    fp4forge.calibrate_checkpoint("bf16/", "stats.safetensors", fp4forge.CalibrationOptions(text_files=("calib.jsonl",)))
    fp4forge.quantize_checkpoint("bf16/", "out/", fp4forge.QuantizeJob("nvfp4-experts-fp8-attn", stats="stats.safetensors"))
    report = fp4forge.audit_checkpoint("out/")       # .findings, .exit_code, .to_json()
    table = fp4forge.byte_table("out/")              # .bpp, .to_json()
    changes = fp4forge.diff_checkpoints("out/", "other/")
    scores = fp4forge.measure_fidelity("bf16/", "out/", fp4forge.FidelityOptions(text_files=("heldout.jsonl",)))
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

try:
    __version__ = version("fp4forge")  # the installed package's metadata: pyproject.toml states it once
except PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+unknown"

API = ("audit_checkpoint", "byte_table", "calibrate_checkpoint", "diff_checkpoints", "measure_fidelity", "open_checkpoint", "quantize_checkpoint",
       "AuditOptions", "ByteTableOptions", "DiffOptions", "CalibrationOptions", "FidelityOptions", "GptqOptions", "QuantizeJob", "SampleOptions")
__all__ = ["__version__", *API]


def versioned(doc: dict[str, Any]) -> dict[str, Any]:
    """A JSON document fp4forge writes or prints, saying which fp4forge made it (its own
    ``fp4forge_version``, when it already has one, is kept)."""
    out = dict(doc)  # the document's own keys first: a report leads with its verdict
    out.setdefault("fp4forge_version", __version__)
    return out

if TYPE_CHECKING:
    # Redundant aliases mark these as re-exports for linters (`__all__` is built from API).
    from fp4forge.api import AuditOptions as AuditOptions
    from fp4forge.api import ByteTableOptions as ByteTableOptions
    from fp4forge.api import CalibrationOptions as CalibrationOptions
    from fp4forge.api import DiffOptions as DiffOptions
    from fp4forge.api import FidelityOptions as FidelityOptions
    from fp4forge.api import GptqOptions as GptqOptions
    from fp4forge.api import QuantizeJob as QuantizeJob
    from fp4forge.api import SampleOptions as SampleOptions
    from fp4forge.api import audit_checkpoint as audit_checkpoint
    from fp4forge.api import byte_table as byte_table
    from fp4forge.api import calibrate_checkpoint as calibrate_checkpoint
    from fp4forge.api import diff_checkpoints as diff_checkpoints
    from fp4forge.api import measure_fidelity as measure_fidelity
    from fp4forge.api import open_checkpoint as open_checkpoint
    from fp4forge.api import quantize_checkpoint as quantize_checkpoint


def __getattr__(name: str) -> Any:
    # PEP 562: the API module (and, in each function, what it needs) loads on first use.
    if name in API:
        from fp4forge import api

        return getattr(api, name)
    raise AttributeError(f"module 'fp4forge' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *API})
