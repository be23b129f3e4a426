"""Start and stop a real ``vllm serve`` process from a separate vLLM venv.

vLLM lives in its own venv (it pins its own transformers / compressed-tensors), so it is always
run as a subprocess of ``<venv>/bin/vllm``. The server listens on loopback only, runs in its own
process session so that its EngineCore and Worker children can be stopped together, and writes
everything it prints to one log file, whose tail goes into every error.

Linux only: stopping and measuring the process group reads ``/proc``.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Self

from fp4forge.endpoint import LOOPBACK_HOST, Endpoint, api_url, loopback_url
from fp4forge.errors import ServeError

LOG_TAIL_LINES = 40
READY_POLL_INTERVAL_S = 0.5
STOP_TIMEOUT_S = 30.0
KILL_WAIT_S = 10.0

# Overridable by the caller's environment or ``env``. 1 GiB of KV cache is plenty for tests and
# keeps a server near 3 GiB RSS; vLLM's default would reserve far more.
DEFAULT_ENV: dict[str, str] = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_NO_USAGE_STATS": "1",  # no phone-home from test or CI machines
    "DO_NOT_TRACK": "1",
    "PYTHONUNBUFFERED": "1",  # log lines reach the file as they happen
}


@dataclass
class VllmServer:
    """A running (or stopped) ``vllm serve`` process listening on loopback."""

    process: subprocess.Popen[bytes]
    port: int
    served_model_name: str
    model_dir: Path
    log_path: Path
    command: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)  # the variables the launcher set (DEFAULT_ENV and ``env``), as the server saw them

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def base_url(self) -> str:
        """Server root, e.g. ``http://127.0.0.1:8000`` (``/health``, ``/tokenize`` live here)."""
        return loopback_url(self.port)

    @property
    def openai_base_url(self) -> str:
        """The OpenAI-compatible API root (``/v1``), what OpenAI clients call ``base_url``."""
        return api_url(self.base_url)

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        return read_log_tail(self.log_path, lines)

    def wait_ready(self, timeout_s: float) -> None:
        """Poll ``GET /v1/models`` until it lists our model; raise ``ServeError`` on death or timeout."""
        deadline = time.monotonic() + timeout_s
        with Endpoint(self.base_url, self.served_model_name, timeout_s=5.0) as endpoint:
            while True:
                returncode = self.process.poll()
                if returncode is not None:
                    raise self._error(f"vllm serve exited with code {returncode} before it became ready")
                # Not listening yet, or something else answers on this port (vLLM's own bind
                # error will follow): both read as "not ready".
                if endpoint.lists_model():
                    return
                if time.monotonic() >= deadline:
                    raise self._error(f"vllm serve was not ready after {timeout_s:.0f} s")
                time.sleep(READY_POLL_INTERVAL_S)

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> int | None:
        """SIGTERM the process group, SIGKILL whatever is left after ``timeout``; return the exit code."""
        # start_new_session=True makes the server its own group leader; polling reaps it through
        # its Popen, which keeps the exit code
        stop_group(self.pid, timeout, reap=self.process.poll)
        try:
            return self.process.wait(timeout=KILL_WAIT_S)
        except subprocess.TimeoutExpired:
            return None

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def _error(self, reason: str) -> ServeError:
        tail = self.log_tail()
        return ServeError(
            f"{reason} (model {self.model_dir}, port {self.port}).\n"
            f"--- last {LOG_TAIL_LINES} lines of {self.log_path} ---\n{tail}",
            file=str(self.log_path),
        )


def start_vllm(
    model_dir: Path,
    *,
    venv: Path,
    served_model_name: str,
    log_path: Path,
    port: int | None = None,
    extra_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    ready_timeout_s: float = 600.0,
) -> VllmServer:
    """Start ``<venv>/bin/vllm serve model_dir`` on loopback and return once it answers.

    ``port=None`` picks a free loopback port. ``env`` is applied on top of the current environment
    and ``DEFAULT_ENV``. On failure the whole process group is stopped and ``ServeError`` carries
    the last lines of ``log_path``.
    """
    server = launch_vllm(
        model_dir,
        venv=venv,
        served_model_name=served_model_name,
        log_path=log_path,
        port=port,
        extra_args=extra_args,
        env=env,
    )
    try:
        server.wait_ready(ready_timeout_s)
    except BaseException:
        server.stop()
        raise
    return server


def launch_vllm(
    model_dir: Path,
    *,
    venv: Path,
    served_model_name: str,
    log_path: Path,
    port: int | None = None,
    extra_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
) -> VllmServer:
    """Start the server process without waiting for it (call ``wait_ready``); lets starts overlap."""
    model_dir = Path(model_dir)
    vllm_bin = Path(venv) / "bin" / "vllm"
    if not vllm_bin.is_file():
        raise ServeError(f"no vllm executable at {vllm_bin}; run scripts/setup-vllm-venv.sh {venv}")
    if not model_dir.is_dir():
        raise ServeError(f"model directory {model_dir} does not exist")
    port = pick_free_port() if port is None else port
    command = build_serve_command(vllm_bin, model_dir, port, served_model_name, extra_args)

    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    full_env = build_serve_env(env)
    with log_path.open("wb") as log_file:
        log_file.write(f"$ {' '.join(command)}\n".encode())
        log_file.flush()
        process = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env=full_env,
            start_new_session=True,  # own process group: stop() reaches EngineCore and Worker too
        )
    return VllmServer(
        process=process,
        port=port,
        served_model_name=served_model_name,
        model_dir=model_dir,
        log_path=log_path,
        command=command,
        env={key: full_env[key] for key in (*DEFAULT_ENV, *(env or {}))},
    )


def build_serve_command(
    vllm_bin: Path, model_dir: Path, port: int, served_model_name: str, extra_args: Sequence[str]
) -> list[str]:
    return [
        str(vllm_bin),
        "serve",
        str(model_dir),
        "--host",
        LOOPBACK_HOST,
        "--port",
        str(port),
        "--served-model-name",
        served_model_name,
        *extra_args,
    ]


def build_serve_env(overrides: Mapping[str, str] | None) -> dict[str, str]:
    env = dict(os.environ)
    for key, value in DEFAULT_ENV.items():
        env.setdefault(key, value)
    env.update(overrides or {})
    return env


# The serve line as someone else can run it: no venv path, no port or served name picked at random
# for this run. The model directory becomes $MODEL_VAR; paths inside it become "$MODEL_VAR/...".
MODEL_VAR = "MODEL"
PORTABLE_PORT = "8000"  # vLLM's own default
LAUNCHER_ONLY_ENV = ("PYTHONUNBUFFERED",)  # set so the log file fills line by line; serving does not need it


def portable_command(command: Sequence[str], env: Mapping[str, str], *, served_model_name: str) -> str:
    """A ``vllm serve`` command line (bash) from a launched ``command`` and the ``env`` it ran with.

    ``command`` is what ``build_serve_command`` made: ``<venv>/bin/vllm serve <model_dir> ...``.
    """
    import shlex

    if len(command) < 3 or command[1] != "serve":
        raise ServeError(f"not a vllm serve command: {list(command)[:3]}")
    model_dir = command[2].rstrip("/")
    args, parts = list(command[3:]), []
    index = 0
    while index < len(args):
        arg = args[index]
        value = args[index + 1] if index + 1 < len(args) else None
        if arg == "--port" and value is not None:
            parts.append(["--port", PORTABLE_PORT])
            index += 2
            continue
        if arg == "--served-model-name" and value is not None:
            parts.append(["--served-model-name", served_model_name])
            index += 2
            continue
        if arg.startswith("--") and value is not None and not value.startswith("--"):
            parts.append([arg, value])
            index += 2
            continue
        parts.append([arg])
        index += 1

    def word(text: str) -> str:
        if text == model_dir or text.startswith(model_dir + "/"):
            return f'"${MODEL_VAR}{text[len(model_dir):]}"'
        return shlex.quote(text)

    lines = []
    needed = {k: v for k, v in env.items() if k not in LAUNCHER_ONLY_ENV}
    if needed:
        lines.append(" ".join(f"{k}={shlex.quote(v)}" for k, v in needed.items()))
    lines.append(f'vllm serve "${MODEL_VAR}"')
    lines += ["  " + " ".join(word(w) for w in flag) for flag in parts]
    return " \\\n".join(lines)


def pick_free_port() -> int:
    """A port that was free on loopback a moment ago (the server may still lose a race for it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK_HOST, 0))
        return sock.getsockname()[1]


def read_log_tail(log_path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        with Path(log_path).open("r", encoding="utf-8", errors="replace") as log_file:
            return "".join(deque(log_file, maxlen=lines))
    except OSError as error:
        return f"<log {log_path} unreadable: {error}>"


# -- process group helpers (Linux /proc) --------------------------------------------------------
def _live_group_members(pgid: int) -> list[int]:
    """PIDs in process group ``pgid`` that are not zombies."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        stat = _read_stat_fields(entry / "stat")
        # Fields after "(comm)": state, ppid, pgrp, ...
        if stat is not None and int(stat[2]) == pgid and stat[0] != "Z":
            members.append(int(entry.name))
    return members


def _read_stat_fields(stat_path: Path) -> list[str] | None:
    try:
        text = stat_path.read_text()
    except OSError:
        return None  # the process ended while we looked
    # comm may contain spaces and parentheses; it ends at the last ')'.
    return text[text.rfind(")") + 2 :].split()


def stop_group(pgid: int, timeout: float = STOP_TIMEOUT_S, *, reap: Callable[[], object] = lambda: None) -> None:
    """SIGTERM process group ``pgid``, SIGKILL whatever is left after ``timeout``, and wait (at most
    KILL_WAIT_S more) until no live member remains. A zombie is not live: it has exited, and only
    its parent's wait removes it, so ``reap`` (the leader's ``Popen.poll`` when the caller started
    it) is called while waiting."""
    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, KILL_WAIT_S)):
        if not _live_group_members(pgid):
            return
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return  # gone in between
        deadline = time.monotonic() + wait
        while True:
            reap()
            if not _live_group_members(pgid):
                return
            if time.monotonic() >= deadline:
                break
            time.sleep(0.2)
