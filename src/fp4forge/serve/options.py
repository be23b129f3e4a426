"""`fp4forge serve doctor` and `serve up`: their options, checked when made, and the job each
command and the pipeline call (`serve cmd`'s are ``recommend.ServeCmdOptions`` / ``serve_command``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fp4forge.errors import ConfigError, require_choice

if TYPE_CHECKING:
    from fp4forge.serve.doctor import Diagnosis, Finding, LogDoctor
    from fp4forge.serve.process import ServeRecord


DEFAULT_VLLM_VENV = Path(".venv-vllm")  # where scripts/setup-vllm-venv.sh puts vLLM


@dataclass(frozen=True)
class DoctorOptions:
    vllm_version: str | None = None  # None: the version the log states
    checkpoint: str | None = None  # the served checkpoint (None: the log's model path, when local)
    partial: bool = False  # a log that ends before the server came up is not a failure

    def __post_init__(self) -> None:
        if self.vllm_version is not None:
            from packaging.version import InvalidVersion, Version

            try:
                Version(self.vllm_version)
            except InvalidVersion:
                raise ConfigError(f"not a vLLM version: {self.vllm_version!r}", option="vllm_version") from None


def diagnose_log(text: str, options: DoctorOptions = DoctorOptions()) -> Diagnosis:
    """The doctor job: the verdict and findings of a vLLM log's text (``diagnosis.passes(partial=options.partial)``)."""
    from fp4forge.serve.doctor import diagnose_text

    return diagnose_text(text, vllm_version=options.vllm_version, checkpoint=options.checkpoint)


@dataclass(frozen=True)
class ServeUpOptions:
    venv: Path | None = DEFAULT_VLLM_VENV  # the vLLM venv
    name: str | None = None  # served model name and state-file name (None: the directory's name)
    port: int | None = None  # loopback port (None: a free one)
    hardware: str = "cpu"  # the target whose recommended flags are used
    ready_timeout_s: float = 900.0  # seconds to wait for readiness
    directory: Path | None = None  # where PID/state files go (None: $FP4FORGE_STATE_DIR or the cache)
    extra_args: tuple[str, ...] = ()  # passed on to `vllm serve`

    def __post_init__(self) -> None:
        from fp4forge.serve.recommend import HARDWARE

        require_choice(self.hardware, HARDWARE, "hardware")
        if self.port is not None and not 0 < self.port < 65536:
            raise ConfigError(f"not a TCP port: {self.port}", option="port")
        if not self.ready_timeout_s > 0:
            raise ConfigError(f"must be more than 0 seconds, got {self.ready_timeout_s}", option="ready_timeout_s")


def serve_up_options(**given: Any) -> ServeUpOptions:
    """`serve up`'s options, from the command line or the pipeline's serve step: the one place
    either makes them (``given``: the fields by name)."""
    return ServeUpOptions(**given)


def start_server(model: Path, options: ServeUpOptions, *, on_finding: Callable[[Finding], None] = lambda finding: None,
                 on_line: Callable[[str], None] = lambda line: None) -> tuple[ServeRecord, LogDoctor]:
    """The serve-up job: the recommended vLLM server of ``model``, started and ready."""
    from fp4forge.serve.process import serve_up

    return serve_up(model, venv=options.venv, name=options.name, port=options.port, hardware=options.hardware,  # type: ignore[arg-type]
                    extra_args=options.extra_args, ready_timeout_s=options.ready_timeout_s, directory=options.directory,
                    on_finding=on_finding, on_line=on_line)
