"""What every `fp4forge` command module shares: the JSON document on stdout, rich consoles, the
progress bar, and the one-line error with its exit code. Kept free of heavy imports (rich only,
on use)."""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TextIO

from fp4forge.errors import Fp4forgeError

# Library option names (``Fp4forgeError.option``) whose flag is not ``--`` + the name with dashes.
FLAG_SPELLING = {
    "text_files": "--text",
    "builtin_corpus": "--builtin / --no-builtin",
    "ram_budget_bytes": "--ram-budget-gb",
    "max_shard_bytes": "--max-shard-gb",
    "layout_format": "--format",
    "fmt": "--format",
    "ready_timeout_s": "--timeout",
    "activation_budget_bytes": "--activation-budget",
    "workers": "--threads",
    # the exporter's activation amax: from a statistics file or an explicit constant
    "act_amax": "--stats / --act-scales",
    # the frontier's and the study's options
    "int_groups": "--groups",
    "fidelity_samples": "--samples",
    "fidelity_seq_len": "--seq-len",
    "calibration_text_files": "--calibration-text",
}

BYTE_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12,
              "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str | None, option: str) -> int | None:
    """``"8GiB"``, ``"512MB"``, ``"1.5G"``, ``"1000"`` -> bytes (``None`` stays ``None``); a bad
    value is a ConfigError about ``option``."""
    if text is None:
        return None
    import re

    from fp4forge.errors import ConfigError

    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in BYTE_UNITS:
        raise ConfigError(f"{text!r} is not a size (e.g. 512MiB, 8GiB, 2GB, 1000000)", option=option)
    return int(float(match.group(1)) * BYTE_UNITS[unit])


def flag_for(option: str) -> str:
    """How the command line spells the library option ``option`` (``stats`` -> ``--stats``,
    ``gptq.damp`` -> ``--gptq-damp``); an option a command already spelled (``spelled``) stays."""
    if option.startswith("--"):
        return option
    return FLAG_SPELLING.get(option, "--" + option.replace("_", "-").replace(".", "-"))


@contextmanager
def spelled(flags: dict[str, str] | Callable[[str], str]) -> Iterator[None]:
    """Errors raised inside name their option by this command's own flag: ``flags`` maps an
    option path to it where it differs from the usual spelling (``flag_for``), or spells any."""
    try:
        yield
    except Fp4forgeError as error:
        if not error.option:
            raise
        if callable(flags):
            error.option = flags(error.option)
        elif error.option in flags:
            error.option = flags[error.option]  # type: ignore[index]
        raise


def error_text(error: object) -> str:
    """An error's one line, options spelled as flags."""
    return error.describe(flag_for) if isinstance(error, Fp4forgeError) else str(error)


def emit_json(doc: object) -> None:
    """The command's one JSON document on stdout (an object says which fp4forge made it)."""
    from fp4forge import versioned

    sys.stdout.write(json.dumps(versioned(doc) if isinstance(doc, dict) else doc, indent=2) + "\n")


def console(stderr: bool = False) -> Any:
    from rich.console import Console

    return Console(stderr=stderr, soft_wrap=True, highlight=False)


def fail(message: object, code: int, as_json: bool = False, **context: object) -> SystemExit:
    """An error fp4forge understands: one line on stderr (and ``{..., "error"}`` on stdout with
    --json); ``raise`` the returned SystemExit to exit with ``code``."""
    text = error_text(message)
    if as_json:
        emit_json({**context, "error": text})
    console(stderr=True).print(f"[red]error:[/red] {text}")
    return SystemExit(code)


# -- progress -----------------------------------------------------------------------------------
# Live bars only where a person watches both streams; anywhere else (CI, `| tee`, a log file) a
# bar either prints nothing until it ends or floods the log with redraws, so progress becomes plain
# lines: one per change of step, and a heartbeat every HEARTBEAT_S during a long one.
HEARTBEAT_S = 10.0


def interactive() -> bool:
    """True when stdout and stderr are both terminals (a pipe or a file on either: plain lines)."""
    return _isatty(sys.stdout) and _isatty(sys.stderr)


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def plain_stream() -> TextIO:
    """Where plain progress lines go: stdout when it is captured (so `| tee` keeps them), else stderr."""
    return sys.stderr if _isatty(sys.stdout) else sys.stdout


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


class PlainProgress:
    """Progress as lines of text: ``line(text)`` prints at once; while a task runs (``begin``),
    ``update`` records what it is doing and a background thread prints it every ``heartbeat_s``
    with the task's own elapsed time and done/total (both start again at every ``begin``)."""

    def __init__(self, name: str, stream: TextIO | None = None, heartbeat_s: float = HEARTBEAT_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.name, self.stream, self.heartbeat_s, self.clock = name, stream or plain_stream(), heartbeat_s, clock
        self.started = clock()
        self._lock = threading.Lock()
        self._task: str | None = None
        self._task_started = self.started
        self._last_line = self.started
        self._done, self._total, self._detail = 0, 0, ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> PlainProgress:
        if self.heartbeat_s > 0:
            self._thread = threading.Thread(target=self._beat, name="fp4forge-heartbeat", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)

    def line(self, text: str) -> None:
        with self._lock:
            self._write(text)

    def begin(self, task: str, text: str | None = None) -> None:
        with self._lock:
            self._task, self._task_started = task, self.clock()
            self._done, self._total, self._detail = 0, 0, ""
            self._write(text or f"{task}: started")

    def update(self, done: int, total: int, detail: str = "") -> None:
        with self._lock:
            self._done, self._total, self._detail = done, total, detail or self._detail

    def end(self, text: str) -> None:
        with self._lock:
            self._task = None
            self._write(text)

    def task_elapsed(self) -> float:
        """Seconds since the running (or last) task began."""
        return self.clock() - self._task_started

    def heartbeat_text(self) -> str | None:
        """The line a heartbeat prints now (None when no task runs)."""
        if self._task is None:
            return None
        parts = [f"{self._task}: running {_duration(self.clock() - self._task_started)}"]
        if self._total:
            parts.append(f"{self._done}/{self._total} ({self._done / self._total:.0%})")
        if self._detail:
            parts.append(self._detail)
        return ", ".join(parts)

    def _beat(self) -> None:
        while not self._stop.wait(min(1.0, self.heartbeat_s)):
            with self._lock:
                if self._task is not None and self.clock() - self._last_line >= self.heartbeat_s:
                    self._write(self.heartbeat_text() or "")

    def _write(self, text: str) -> None:
        now = self.clock()
        self._last_line = now
        self.stream.write(f"[{self.name} {_duration(now - self.started):>6}] {text}\n")
        self.stream.flush()


@contextmanager
def progress_bar(description: str, enabled: bool = True) -> Iterator:
    """Yields a `progress(done, total, desc)` callback drawing a rich bar on stderr, or plain
    heartbeat lines off a terminal (None when not ``enabled``, e.g. under --json)."""
    if not enabled:
        yield None
        return
    if not interactive():
        with PlainProgress("fp4forge") as plain:
            plain.begin(description)
            plain.update(0, 0)

            def plain_update(done: int, total: int, desc: str = description) -> None:
                plain.update(done, total, desc)

            yield plain_update
            plain.end(f"{description}: finished in {_duration(plain.task_elapsed())}")
        return
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn(),
                  console=console(stderr=True), transient=True) as bar:
        task = bar.add_task(description, total=None)

        def update(done: int, total: int, desc: str = description) -> None:
            bar.update(task, completed=done, total=total, description=desc)

        yield update
