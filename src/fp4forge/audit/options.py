"""The read-only jobs' options (audit, bytes, diff): light to import, since `fp4forge audit` and
`fp4forge bytes` start on a fast path (``fp4forge.cli.fast``) that reads its defaults here; each
is checked when made, before a checkpoint is opened."""

from __future__ import annotations

from dataclasses import dataclass

from fp4forge.checkpoint.declarations import FORMATS
from fp4forge.errors import ConfigError, Fp4forgeError, given_options, require_choice

AUDIT_FORMATS = ("auto",) + FORMATS
DEFAULT_VLLM_VERSION = "0.32"  # the vLLM release the audit's known blind spots are judged for


def parse_version(text: str) -> tuple[int, ...]:
    """``"0.32"`` / ``"v0.31.1"`` -> (0, 32) / (0, 31, 1)."""
    try:
        return tuple(int(part) for part in text.strip().lstrip("v").split("."))
    except ValueError:
        raise ConfigError(f"not a version number: {text!r} (expected e.g. 0.32)") from None


@dataclass(frozen=True)
class AuditOptions:
    deep: bool = False  # also read every value (NaN/Inf, zero matrices, scale statistics)
    fmt: str = "auto"  # the format the checkpoint must be in: auto, compressed-tensors or modelopt
    vllm_version: str = DEFAULT_VLLM_VERSION  # the vLLM it will be served with (its known blind spots)
    trust_remote_code: bool = False  # the model's own code may build its expected tensor names
    device: str = "auto"  # where --deep reduces the values: auto (a GPU if torch sees one), cpu, cuda, cuda:N

    def __post_init__(self) -> None:
        require_choice(self.fmt, AUDIT_FORMATS, "fmt")
        if self.device not in ("auto", "cpu"):  # asking for a GPU is checked now (torch imported only then)
            from fp4forge.model.device import resolve_device

            resolve_device(self.device)
        try:
            parse_version(self.vllm_version)
        except ConfigError as error:
            error.option = "vllm_version"
            raise

    @property
    def version(self) -> tuple[int, ...]:
        return parse_version(self.vllm_version)


def audit_options(**given: object) -> AuditOptions:
    """The audit's options from the command line or the pipeline: fields by name, a value left out
    (None) keeps its default. The one place either makes them."""
    return AuditOptions(**given_options(**given))  # type: ignore[arg-type]


@dataclass(frozen=True)
class ByteTableOptions:
    layout: str | None = None  # the architecture layout by name (default: config.json's, else inferred)

    def __post_init__(self) -> None:
        if self.layout:
            from fp4forge.checkpoint.layout import layout_by_name

            try:
                layout_by_name(self.layout)
            except Fp4forgeError as error:
                error.option = "layout"
                raise


@dataclass(frozen=True)
class DiffOptions:
    values: bool = False  # also the max abs / rel difference of differing tensors of equal shape
