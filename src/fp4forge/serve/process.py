"""`fp4forge serve up` / `serve down`: a vLLM server that outlives the command that started it.

``up`` builds the recommended command (:mod:`fp4forge.serve.recommend`), starts it in vLLM's own
venv through the launcher (own process group, log file), writes a state file at once (so ``down``
can stop a server that is still starting), streams the log through the doctor while it waits for
readiness, and on failure stops the group and raises with the doctor's errors. ``down`` stops by
the recorded process group (``launcher.stop_group``), after checking that the PID still belongs to
that ``vllm serve``.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from fp4forge.endpoint import Endpoint, loopback_url

from fp4forge.checkpoint.atomic import write_text_atomic
from fp4forge.errors import ServeError
from fp4forge.serve.doctor import LOG_PREFIX, PROCESS_TAG, Finding, LogDoctor
from fp4forge.serve.launcher import VllmServer, launch_vllm, stop_group
from fp4forge.serve.recommend import read_checkpoint_facts, recommend, target_vllm_version

STATE_DIR_ENV = "FP4FORGE_STATE_DIR"
POLL_S = 0.5


def state_dir(override: Path | None = None) -> Path:
    if override is not None:
        return Path(override)
    if os.environ.get(STATE_DIR_ENV):
        return Path(os.environ[STATE_DIR_ENV])
    return Path.home() / ".cache" / "fp4forge" / "serve"


@dataclass(frozen=True)
class ServeRecord:
    name: str
    pid: int  # also the process-group id (the launcher starts a new session)
    port: int
    model: str
    log: str
    command: list[str]
    started: float
    env: dict[str, str] = field(default_factory=dict)  # what the launcher set on top of the caller's environment

    @property
    def base_url(self) -> str:
        return loopback_url(self.port)

    def to_json(self) -> dict[str, object]:
        return {**asdict(self), "base_url": self.base_url}


def _record_path(directory: Path, name: str) -> Path:
    return directory / f"{name}.json"


def write_record(directory: Path, record: ServeRecord) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = _record_path(directory, record.name)
    write_text_atomic(path, json.dumps(asdict(record), indent=2))
    return path


def read_records(directory: Path) -> list[ServeRecord]:
    if not directory.is_dir():
        return []
    return [ServeRecord(**json.loads(p.read_text())) for p in sorted(directory.glob("*.json"))]


def _is_our_server(record: ServeRecord) -> bool:
    """The PID is alive and still runs `vllm ... serve` (PIDs get reused)."""
    try:
        cmdline = Path(f"/proc/{record.pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return any(part.endswith(b"vllm") for part in cmdline) and b"serve" in cmdline


STATUS_MAX_CHARS = 120
UVICORN_PREFIX = re.compile(r"^(?:DEBUG|INFO|WARNING|ERROR|CRITICAL):\s+")  # the HTTP server's own lines


def startup_status(line: str) -> str | None:
    """What a start-up log line says, for a live status ("Loading weights took 0.21 seconds"):
    the line without vLLM's level/time/file prefix and process tag, cut to STATUS_MAX_CHARS; None
    for a blank line, a progress-bar redraw or the command line the launcher wrote first."""
    text = line.replace("\x00", "").split("\r")[-1].strip()
    text = UVICORN_PREFIX.sub("", LOG_PREFIX.sub("", PROCESS_TAG.sub("", text) + " ").strip())
    if not text or text.startswith("$ ") or not any(ch.isalpha() for ch in text):
        return None
    return text if len(text) <= STATUS_MAX_CHARS else text[: STATUS_MAX_CHARS - 1] + "…"


class _LogFollower:
    def __init__(self, path: Path, doctor: LogDoctor, on_finding: Callable[[Finding], None],
                 on_line: Callable[[str], None] = lambda line: None) -> None:
        self.path, self.doctor, self.on_finding, self.on_line = path, doctor, on_finding, on_line
        self.offset = 0
        self.partial = ""

    def poll(self) -> None:
        try:
            with self.path.open("r", encoding="utf-8", errors="replace") as log:
                log.seek(self.offset)
                chunk = log.read()
                self.offset = log.tell()
        except OSError:
            return
        lines = (self.partial + chunk.replace("\x00", "")).split("\n")
        self.partial = lines.pop()
        for line in lines:
            self.on_line(line)
            for finding in self.doctor.feed(line):
                self.on_finding(finding)


def serve_up(
    model: Path,
    *,
    venv: Path,
    name: str | None = None,
    port: int | None = None,
    hardware: str = "cpu",
    vllm_version: str | None = None,
    extra_args: Sequence[str] = (),
    env: dict[str, str] | None = None,
    ready_timeout_s: float = 900.0,
    directory: Path | None = None,
    on_finding: Callable[[Finding], None] = lambda finding: None,
    on_line: Callable[[str], None] = lambda line: None,
) -> tuple[ServeRecord, LogDoctor]:
    """Start the recommended server and wait until it serves; ``on_line`` sees every log line
    while it starts (a live status: ``startup_status(line)``), ``on_finding`` each doctor finding."""
    model = Path(model)
    directory = state_dir(directory)
    name = name or model.name
    if _record_path(directory, name).exists():
        raise ServeError(f"a server named {name!r} is recorded in {directory}; `fp4forge serve down {name}` first")
    version = target_vllm_version(vllm_version, str(venv))
    rec = recommend(str(model), read_checkpoint_facts(str(model)), hardware, version)
    args = [part for flag in rec.args for part in flag] + list(extra_args)
    log_path = directory / f"{name}.log"
    server = launch_vllm(
        model, venv=venv, served_model_name=name, log_path=log_path, port=port, extra_args=args, env={**rec.env, **(env or {})}
    )
    record = ServeRecord(name, server.pid, server.port, str(model), str(log_path), server.command, time.time(), server.env)
    # From here on a Ctrl-C (or any failure) must stop the server and drop its record, including one
    # that lands between writing the record and waiting (building the doctor takes milliseconds).
    try:
        write_record(directory, record)
        doctor = LogDoctor()
        follower = _LogFollower(log_path, doctor, on_finding, on_line)
        _wait_ready(server, record, follower, doctor, ready_timeout_s)
    except BaseException:  # not ready, or Ctrl-C while starting: the server must not be orphaned
        server.stop()
        _record_path(directory, name).unlink(missing_ok=True)
        raise
    return record, doctor


def _wait_ready(server: VllmServer, record: ServeRecord, follower: _LogFollower, doctor: LogDoctor, ready_timeout_s: float) -> None:
    """Return when the server lists the model; raise ServeError (with the doctor's errors) when it
    exits first or the timeout passes."""
    name = record.name
    deadline = time.monotonic() + ready_timeout_s
    with Endpoint(record.base_url, name, timeout_s=5.0) as endpoint:
        while True:
            follower.poll()
            if endpoint.lists_model():
                follower.poll()
                return
            failure = None
            if server.process.poll() is not None:
                failure = f"vllm serve exited with code {server.process.returncode} before it became ready"
            elif time.monotonic() > deadline:
                failure = f"vllm serve was not ready after {ready_timeout_s:.0f} s"
            if failure:
                follower.poll()
                errors = [f"  [{f.id}] {f.message}" + (f" Fix: {f.fix}" if f.fix else "")
                          for f in doctor.diagnosis().findings if f.severity == "error"]
                raise ServeError("\n".join([failure, *errors, f"log: {record.log}"]), file=record.log)
            time.sleep(POLL_S)


def serve_down(names: Sequence[str], *, directory: Path | None = None, every: bool = False) -> list[ServeRecord]:
    """Stop the named (or every recorded) server; returns the records that were stopped."""
    directory = state_dir(directory)
    records = {r.name: r for r in read_records(directory)}
    chosen = list(records) if every else list(names)
    unknown = [n for n in chosen if n not in records]
    if unknown:
        raise ServeError(f"no recorded server named {', '.join(unknown)} in {directory} (recorded: {', '.join(records) or 'none'})")
    stopped = []
    for name in chosen:
        record = records[name]
        if _is_our_server(record):
            stop_group(record.pid)
        _record_path(directory, name).unlink(missing_ok=True)
        stopped.append(record)
    return stopped
