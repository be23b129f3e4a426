"""`fp4forge serve ...`, added to the main Typer app by ``register(app)``.

    fp4forge serve cmd MODEL [--hardware gb10|b200|h100|h200|cpu] [--vllm-version 0.32.0] [--json]
    fp4forge serve doctor LOGFILE|- [--vllm-version V] [--checkpoint CKPT] [--partial] [--json]
    fp4forge serve up MODEL [--name N] [--port P] [--venv DIR] [--hardware cpu] [--timeout S] [--json] [-- EXTRA...]
    fp4forge serve down [NAME...] [--all] [--json]

Exit codes. doctor: 0 the server came up and no finding is an error; 1 it failed at a phase, died
after ready, the log ends before it could tell (unless --partial), or an error finding; 2 input that
is not a vLLM log (empty, binary, no vLLM line) or unreadable.
cmd/up/down: 0 success, 2 an error fp4forge understands (one line on stderr).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

from fp4forge.cli.common import console as _console
from fp4forge.cli.common import emit_json as _emit
from fp4forge.cli.common import fail
from fp4forge.endpoint import api_url
from fp4forge.errors import ExitCode, Fp4forgeError
from fp4forge.serve.options import DoctorOptions, ServeUpOptions
from fp4forge.serve.recommend import HARDWARE, ServeCmdOptions

SEVERITY_STYLE = {"error": "red", "warning": "yellow", "info": "cyan"}

serve_app = typer.Typer(no_args_is_help=True, help="Serve checkpoints with vLLM: the right command, log diagnosis, start/stop.")


def register(app: typer.Typer) -> None:
    app.add_typer(serve_app, name="serve")


def _fail(error: Exception, as_json: bool) -> SystemExit:
    return fail(error, ExitCode.UNUSABLE, as_json)


@serve_app.command("cmd")
def cmd_command(
    model: str = typer.Argument(..., metavar="MODEL", help="Checkpoint directory, HF repo id or https://…/resolve/<rev> URL."),
    hardware: str = typer.Option(ServeCmdOptions.hardware, "--hardware", help=" | ".join(HARDWARE)),
    vllm_version: Optional[str] = typer.Option(ServeCmdOptions.vllm_version, "--vllm-version", help="Target vLLM (default: the one in --venv, else the newest known)."),
    venv: Path = typer.Option(ServeCmdOptions.venv, "--venv", help="vLLM venv whose version is the default target."),
    as_json: bool = typer.Option(False, "--json", help="One JSON document: env, argv, command, notes, warnings."),
) -> None:
    """Print the `vllm serve` command that serves MODEL correctly on HARDWARE, with why-comments."""
    from fp4forge.serve.recommend import serve_cmd_options, serve_command

    try:
        rec = serve_command(model, serve_cmd_options(hardware=hardware, vllm_version=vllm_version, venv=venv))
    except Fp4forgeError as error:
        raise _fail(error, as_json) from None
    if as_json:
        _emit(rec.to_json())
    else:
        sys.stdout.write(rec.render())


@serve_app.command("doctor")
def doctor_command(
    logfile: str = typer.Argument(..., metavar="LOGFILE|-", help="A vLLM log, or - for stdin."),
    vllm_version: Optional[str] = typer.Option(DoctorOptions.vllm_version, "--vllm-version", help="Override the version read from the log."),
    checkpoint: Optional[str] = typer.Option(DoctorOptions.checkpoint, "--checkpoint", help="The served checkpoint (default: the log's model path, when it is a local directory): lets the doctor tell whether the FP8 KV cache runs at scale 1.0."),
    partial: bool = typer.Option(DoctorOptions.partial, "--partial", help="A log that ends before the server came up (still starting, cut) is not a failure: exit 0 unless an error is found."),
    as_json: bool = typer.Option(False, "--json", help='{"verdict": {"state","phase","summary",...}, "vllm_version", "findings": [...]}'),
) -> None:
    """Read a vLLM log the way vLLM starts: the verdict first (ready / failed at phase P / died after
    ready / cannot tell where the log ends), then the cause and what each telling line means."""
    from fp4forge.errors import NotAVllmLogError
    from fp4forge.serve.options import diagnose_log

    try:
        options = DoctorOptions(vllm_version=vllm_version, checkpoint=checkpoint, partial=partial)
    except Fp4forgeError as error:
        raise _fail(error, as_json) from None
    try:
        if logfile == "-":
            text = sys.stdin.read()
        else:  # newline="": a progress bar's "\r" is not a line break, so line numbers match the file's
            with open(logfile, encoding="utf-8", errors="replace", newline="") as handle:
                text = handle.read()
    except OSError as error:
        raise _fail(error, as_json) from None
    try:
        diagnosis = diagnose_log(text, options)
    except NotAVllmLogError as error:  # the named verdict: empty, binary, not-vllm
        error.file = None if logfile == "-" else logfile
        raise fail(error, ExitCode.UNUSABLE, as_json, verdict={"state": error.kind}) from None
    except Fp4forgeError as error:
        raise _fail(error, as_json) from None
    if as_json:
        _emit(diagnosis.to_json())
    else:
        _print_diagnosis(diagnosis)
    if not diagnosis.passes(partial=options.partial):
        raise SystemExit(ExitCode.FINDINGS)


VERDICT_STYLE = {"ready": "green", "failed": "red", "died": "red", "cannot-tell": "yellow"}


def _print_diagnosis(diagnosis) -> None:  # type: ignore[no-untyped-def]
    from rich.markup import escape

    out = _console()
    style = VERDICT_STYLE[diagnosis.verdict.state]
    out.print(f"[bold {style}]{escape(diagnosis.verdict_line)}[/bold {style}]")
    out.print(f"vLLM version: {diagnosis.vllm_version or 'unknown'}; {len(diagnosis.findings)} findings")
    for f in diagnosis.findings:
        _print_finding(out, f)


def _print_finding(out, f) -> None:  # type: ignore[no-untyped-def]
    style = SEVERITY_STYLE[f.severity]
    out.print(f"[{style}]{f.severity:7s}[/{style}] line {f.line:<5d} [bold]{f.id}[/bold]: {f.message}")
    if f.fix:
        out.print(f"                    fix: {f.fix}")


class _StartupStatus:
    """While vLLM starts: on a terminal a spinner with the seconds so far and the log's latest
    meaningful line; off one, a heartbeat line every few seconds with the same."""

    def __init__(self, console, what: str, enabled: bool) -> None:  # type: ignore[no-untyped-def]
        import time

        from fp4forge.cli.common import interactive

        self.console, self.what, self.enabled = console, what, enabled
        self.live = interactive()
        self.started = time.monotonic()
        self.latest = ""
        self._status = None
        self._plain = None

    def __enter__(self) -> _StartupStatus:
        if self.enabled and self.live:
            self._status = self.console.status(self.what)
            self._status.__enter__()
        elif self.enabled:
            from fp4forge.cli.common import PlainProgress

            self._plain = PlainProgress("serve up").__enter__()
            self._plain.begin(self.what)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._status is not None:
            self._status.__exit__(*exc)
        if self._plain is not None:
            self._plain.__exit__(*exc)

    def line(self, line: str) -> None:
        import time

        from fp4forge.serve.process import startup_status

        text = startup_status(line)
        if not text:
            return
        if self._status is not None:
            self._status.update(f"{self.what}, {time.monotonic() - self.started:.0f} s: {text}")
        elif self._plain is not None:
            self._plain.update(0, 0, text)


@serve_app.command("up", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def up_command(
    ctx: typer.Context,
    model: Path = typer.Argument(..., metavar="MODEL", help="Local checkpoint directory."),
    name: Optional[str] = typer.Option(None, "--name", help="Served model name and state-file name (default: directory name)."),
    port: Optional[int] = typer.Option(None, "--port", help="Loopback port (default: a free one)."),
    venv: Path = typer.Option(ServeUpOptions.venv, "--venv", help="The vLLM venv (scripts/setup-vllm-venv.sh)."),
    hardware: str = typer.Option(ServeUpOptions.hardware, "--hardware", help="Target whose recommended flags to use."),
    timeout: float = typer.Option(ServeUpOptions.ready_timeout_s, "--timeout", help="Seconds to wait for readiness."),
    state: Optional[Path] = typer.Option(None, "--state-dir", help="Where PID/state files go (default $FP4FORGE_STATE_DIR or ~/.cache/fp4forge/serve)."),
    as_json: bool = typer.Option(False, "--json", help="Print the server record (pid, port, base_url, log) as JSON."),
) -> None:
    """Start vLLM with the recommended flags, wait until ready (log through the doctor), record its PID.
    Arguments after MODEL that fp4forge does not know are passed to `vllm serve`."""
    from fp4forge.serve.options import serve_up_options, start_server

    err = _console(stderr=True)
    try:
        options = serve_up_options(venv=venv, name=name, port=port, hardware=hardware, extra_args=tuple(ctx.args), ready_timeout_s=timeout,
                                   directory=state)
        with _StartupStatus(err, f"starting vLLM ({name or model.name})", enabled=not as_json) as status:
            record, doctor = start_server(model, options, on_finding=lambda f: _print_finding(err, f), on_line=status.line)
    except Fp4forgeError as error:
        raise _fail(error, as_json) from None
    if as_json:
        _emit({**record.to_json(), "findings": doctor.diagnosis().to_json()["findings"]})
    else:
        _console().print(f"[green]ready[/green] {record.name} at {api_url(record.base_url)} (pid {record.pid}, log {record.log})")


@serve_app.command("down")
def down_command(
    names: Optional[list[str]] = typer.Argument(None, metavar="[NAME...]", help="Recorded server names."),
    every: bool = typer.Option(False, "--all", help="Stop every recorded server."),
    state: Optional[Path] = typer.Option(None, "--state-dir"),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Stop servers started by `serve up`, by their recorded process group."""
    from fp4forge.serve.process import serve_down

    if not names and not every:
        raise _fail(ValueError("give server NAMEs or --all"), as_json)
    try:
        stopped = serve_down(names or [], directory=state, every=every)
    except Fp4forgeError as error:
        raise _fail(error, as_json) from None
    if as_json:
        _emit({"stopped": [r.to_json() for r in stopped]})
    else:
        for record in stopped:
            _console().print(f"stopped {record.name} (pid {record.pid})")
