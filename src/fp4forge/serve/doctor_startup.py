"""vLLM's start-up as a sequence of phases: where a log got to, and how it ended.

The knowledge is data (``doctor_startup.toml``): the phases in the order vLLM runs them and the
lines that mark each one, the traceback frames that place an exception in a phase, and the lines
that say a server stopped, failed or died. This module follows a log line by line
(:class:`StartupTracker`) and gives one :class:`Verdict`:

- ``ready`` (the evidence line),
- ``failed`` at phase P (the deepest relevant exception: the cause, not the wrapper),
- ``died`` after ready,
- ``cannot-tell``: the log ends at phase P (cut, still starting, or stopped while starting).

A text that is not a vLLM log at all (empty, binary, no vLLM line) is :class:`NotAVllmLogError`.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from typing import Any

from fp4forge.errors import DataFileError, NotAVllmLogError

STARTUP_FILE = "doctor_startup.toml"
STATES = ("ready", "failed", "died", "cannot-tell")
TRACEBACK_START = "Traceback (most recent call last):"
# The last line of a Python traceback: a (dotted) exception name, then ": message" or nothing.
EXCEPTION_LINE = re.compile(r"^(?P<type>[A-Za-z_][\w.]*)(?:: (?P<message>.*))?$")
# An exception line outside a traceback (a pasted excerpt): the name must say it is one.
BARE_EXCEPTION = re.compile(r"^(?P<type>(?:[A-Za-z_]\w*\.)*[A-Z]\w*(?:Error|Exception|Interrupt))(?:: (?P<message>.*))?$")
FRAME_LINE = re.compile(r'^File "(?P<file>[^"]+)", line \d+, in (?P<function>\S+)')
CHAIN_LINES = ("The above exception was the direct cause", "During handling of the above exception")
# pydantic puts the reason on the line after "1 validation error for ModelConfig"
DETAIL_FOLLOWS = re.compile(r"\d+ validation errors? for ")
MAX_TEXT = 400
CUT = "a traceback cut before its exception"
# binary input: more than this share of characters that no log writes (undecodable or control)
BINARY_SHARE = 0.1
# (NUL runs are not counted: vLLM's resource tracker can leave them in a real log)
CONTROL = re.compile(r"[\x01-\x08\x0b\x0c\x0e-\x1a\x1c-\x1f\ufffd]")


@dataclass(frozen=True)
class Phase:
    id: str
    name: str
    index: int
    markers: tuple[re.Pattern[str], ...]
    done: tuple[re.Pattern[str], ...]
    optional: bool


@dataclass(frozen=True)
class FrameRule:
    phase: str
    function: re.Pattern[str] | None
    file: re.Pattern[str] | None
    at_least: bool

    def matches(self, frame: tuple[str, str]) -> bool:
        file, function = frame
        return bool((self.function and self.function.search(function)) or (self.file and self.file.search(file)))


@dataclass(frozen=True)
class StartupTable:
    process: re.Pattern[str]
    prefixes: tuple[re.Pattern[str], ...]
    phases: tuple[Phase, ...]
    frames: tuple[FrameRule, ...]
    stopping: tuple[re.Pattern[str], ...]
    failed: tuple[re.Pattern[str], ...]
    died: tuple[re.Pattern[str], ...]
    wrappers: tuple[re.Pattern[str], ...]
    carriers: tuple[re.Pattern[str], ...]
    evidence: tuple[re.Pattern[str], ...]
    exited: str
    wrapper_note: str

    def phase(self, phase_id: str) -> Phase:
        return next(p for p in self.phases if p.id == phase_id)


def _regexes(values: list[str], where: str) -> tuple[re.Pattern[str], ...]:
    try:
        return tuple(re.compile(v) for v in values)
    except re.error as error:
        raise DataFileError(f"{STARTUP_FILE}: a regex of {where} is invalid: {error}") from error


def _optional(value: str | None, where: str) -> re.Pattern[str] | None:
    return _regexes([value], where)[0] if value else None


@lru_cache(maxsize=1)
def load_startup_table() -> StartupTable:
    data = tomllib.loads(resources.files("fp4forge.serve").joinpath(STARTUP_FILE).read_text(encoding="utf-8"))
    try:
        phases = tuple(Phase(p["id"], p["name"], i, _regexes(p["markers"], p["id"]), _regexes(p.get("done", []), p["id"]),
                             bool(p.get("optional"))) for i, p in enumerate(data["phase"]))
        ids = {p.id for p in phases}
        frames = tuple(FrameRule(f["phase"], _optional(f.get("function"), "[[frame]]"), _optional(f.get("file"), "[[frame]]"),
                                 bool(f.get("at_least"))) for f in data["frame"])
        if unknown := {f.phase for f in frames} - ids:
            raise DataFileError(f"{STARTUP_FILE}: [[frame]] names unknown phases {sorted(unknown)}")
        life, prefixes = data["life"], data["prefixes"]
        return StartupTable(
            process=_regexes([prefixes["process"]], "[prefixes]")[0], prefixes=_regexes(prefixes["others"], "[prefixes]"),
            phases=phases, frames=frames,
            **{key: _regexes(life[key], f"[life].{key}") for key in ("stopping", "failed", "died", "wrappers", "carriers")},
            evidence=_regexes(life["vllm_evidence"], "[life].vllm_evidence"),
            exited=life["exited"], wrapper_note=life["wrapper_note"],
        )
    except KeyError as error:
        raise DataFileError(f"{STARTUP_FILE}: missing key {error}") from error


def split_prefix(line: str, table: StartupTable | None = None) -> tuple[str, str]:
    """(process tag or "", the line without vLLM's prefixes)."""
    table = table or load_startup_table()
    proc = ""
    if match := table.process.match(line):
        proc, line = match["proc"], line[match.end():]
    changed = True
    while changed:
        changed = False
        for prefix in table.prefixes:
            if match := prefix.match(line):
                line, changed = line[match.end():], True
    return proc, line


def check_log_text(text: str) -> None:
    """Raise NotAVllmLogError for an empty or binary text (one whose lines no log writes)."""
    if not text.strip("\x00 \t\r\n"):
        raise NotAVllmLogError("the log is empty: there is nothing to diagnose", kind="empty")
    sample = text[:200_000]
    if len(CONTROL.findall(sample)) > BINARY_SHARE * len(sample):
        raise NotAVllmLogError("the file is binary, not a text log", kind="binary")


@dataclass
class Raised:
    """An exception the log shows (or a traceback cut before its exception)."""

    line: int
    text: str
    proc: str
    frames: tuple[tuple[str, str], ...]
    reached: int  # the phase index the log had reached when it was raised
    after_stop: bool
    cut: bool = False
    method: str | None = None  # the worker method that raised it (a carrier line)
    handled: bool = False  # the start-up went on to a later phase after it


@dataclass
class _OpenTraceback:
    start: int
    frames: list[tuple[str, str]] = field(default_factory=list)
    last_source: str | None = None


@dataclass(frozen=True)
class Verdict:
    state: str  # one of STATES
    phase: str | None  # the phase id it failed at / ends at ("serving" when it died)
    phase_name: str | None
    line: int | None  # the evidence: the ready line, or the quoted cause's line
    evidence: str  # the ready line's text, or the quoted cause

    @property
    def summary(self) -> str:
        """The verdict in one line, what every front end prints first."""
        where = f"phase {self.phase} ({self.phase_name})" if self.phase else "an unknown phase"
        at = f" (line {self.line})" if self.line else ""
        if self.state == "ready":
            return f"ready: the server came up{at}: {self.evidence}"
        if self.state == "failed":
            return f"failed at {where}{at}: {self.evidence}"
        if self.state == "died":
            return f"died after ready{at}: {self.evidence}"
        return f"cannot tell: the log ends at {where}{at}" + (f": {self.evidence}" if self.evidence else "")

    def to_json(self) -> dict[str, Any]:
        return {"state": self.state, "phase": self.phase, "phase_name": self.phase_name, "line": self.line,
                "evidence": self.evidence, "summary": self.summary}


class StartupTracker:
    """Follows a log line by line: the phases it reached, its exceptions, how it ended."""

    def __init__(self) -> None:
        self.table = load_startup_table()
        self.reached = -1  # index of the furthest phase a marker showed
        self.done = -1  # index of the furthest phase a `done` marker closed
        self.reached_line: int | None = None
        self.phase_lines: list[tuple[int, int]] = []  # (line, phase index) of every marker
        self.ready_line: int | None = None  # the first line of the `ready` phase
        self.ready_text = ""
        self.serving_line: int | None = None  # the first line of the `serving` phase
        self.stop_line: int | None = None
        self.failed_line: int | None = None  # the first start-up failure line (before any stop)
        self.failed_text: str | None = None
        self.died_line: int | None = None  # the first death line (before any stop)
        self.died_text: str | None = None
        self.exceptions: list[Raised] = []
        self.vllm_evidence = False
        self._open: dict[str, _OpenTraceback] = {}
        self._detail_for: dict[str, Raised] = {}  # per process: an exception whose reason is on the next line
        self._ready_index = self.table.phase("ready").index
        self._serving_index = self.table.phase("serving").index

    @property
    def is_ready(self) -> bool:
        return self.reached >= self._ready_index

    def feed(self, number: int, line: str) -> None:
        proc, body = split_prefix(line, self.table)
        if not self.vllm_evidence and any(r.search(line) for r in self.table.evidence):
            self.vllm_evidence = True
        self._follow_phases(number, body)
        self._follow_life(number, body)
        self._follow_traceback(number, proc, body)

    def _follow_phases(self, number: int, body: str) -> None:
        for phase in self.table.phases:
            if any(r.search(body) for r in phase.markers):
                self.phase_lines.append((number, phase.index))
                if phase.index > self.reached:
                    self.reached, self.reached_line = phase.index, number
            if phase.index > self.done and any(r.search(body) for r in phase.done):
                self.done = phase.index
                if phase.index >= self.reached:
                    self.reached, self.reached_line = phase.index, number
        if self.ready_line is None and self.reached == self._ready_index:
            self.ready_line, self.ready_text = number, " ".join(body.split())[:MAX_TEXT]
        if self.serving_line is None and self.reached == self._serving_index:
            self.serving_line = number

    def _follow_life(self, number: int, body: str) -> None:
        life = self.table
        if self.stop_line is None and any(r.search(body) for r in life.stopping):
            self.stop_line = number
        if self.stop_line is not None:
            return
        if self.failed_line is None and not self.is_ready and any(r.search(body) for r in life.failed):
            self.failed_line, self.failed_text = number, body.strip()
        # the first death line, and again the first after readiness (a start-up may log one too)
        stale = self.died_line is None or (self.ready_line is not None and self.died_line < self.ready_line)
        if stale and any(r.search(body) for r in life.died):
            self.died_line, self.died_text = number, body.strip()

    def _raised(self, number: int, text: str, proc: str, frames: list[tuple[str, str]], **extra: Any) -> Raised:
        raised = Raised(number, text[:MAX_TEXT], proc, tuple(frames), self.reached, self.stop_line is not None,
                        **extra)
        self.exceptions.append(raised)
        return raised

    def _follow_traceback(self, number: int, proc: str, body: str) -> None:
        stripped = body.strip()
        if detail := self._detail_for.pop(proc, None):
            if stripped:
                detail.text = f"{detail.text}: {stripped}"[:MAX_TEXT]
            else:
                self._detail_for[proc] = detail
            return
        if stripped.endswith(TRACEBACK_START):
            for carrier in self.table.carriers:
                if match := carrier.search(stripped):
                    self._raised(number, match["exception"], proc, [], method=match["method"])
            self._open[proc] = _OpenTraceback(number)
            return
        trace = self._open.get(proc)
        if trace is None and FRAME_LINE.match(stripped):  # an excerpt that starts inside a traceback
            trace = self._open[proc] = _OpenTraceback(number)
        if trace is None:
            if match := BARE_EXCEPTION.match(stripped):
                raised = self._raised(number, stripped, proc, [])
                if match["message"] and DETAIL_FOLLOWS.match(match["message"]):
                    self._detail_for[proc] = raised
            return
        self._follow_open(number, proc, body, trace)

    def _follow_open(self, number: int, proc: str, body: str, trace: _OpenTraceback) -> None:
        stripped = body.strip()
        if body.startswith((" ", "\t")) or not stripped or stripped.startswith(CHAIN_LINES):
            if frame := FRAME_LINE.match(stripped):
                trace.frames.append((frame["file"], frame["function"]))
            elif stripped and not stripped.startswith(("^", "~", "...")) and not stripped.startswith(CHAIN_LINES):
                trace.last_source = stripped
            return
        match = EXCEPTION_LINE.match(stripped)
        if match is None or match["type"].isupper():  # another process's line ("INFO: ..."): it goes on
            return
        del self._open[proc]
        text = stripped if match["message"] is not None or not trace.last_source else f"{stripped} (at: {trace.last_source})"
        raised = self._raised(number, text, proc, trace.frames)
        if match["message"] and DETAIL_FOLLOWS.match(match["message"]):
            self._detail_for[proc] = raised

    def all_exceptions(self) -> list[Raised]:
        """Every exception so far, and each traceback still open as one cut before its exception;
        ``handled`` set on those after which the start-up went on to a later phase (not what stopped it)."""
        cut = [Raised(t.start, CUT + (f" (last frame: {t.last_source})" if t.last_source else ""), proc, tuple(t.frames),
                      self.reached, self.stop_line is not None, cut=True)
               for proc, t in self._open.items() if t.frames]
        for raised in self.exceptions:
            raised.handled = any(line > raised.line and max(raised.reached, 0) < index < self._ready_index
                                 for line, index in self.phase_lines)
        return self.exceptions + cut

    def frame_phase(self, raised: Raised) -> tuple[str | None, bool]:
        """The phase a traceback's frames (or the worker method that raised it) place it in."""
        frames = list(raised.frames) + ([("", raised.method)] if raised.method else [])
        for rule in self.table.frames:
            if any(rule.matches(frame) for frame in frames):
                return rule.phase, rule.at_least
        return None, False

    def marker_phase(self) -> Phase | None:
        """Where the markers say the start-up is: the furthest phase, or the one after a closed one."""
        if self.reached < 0:
            return None
        if self.done < self.reached:
            return self.table.phases[self.reached]
        later = [p for p in self.table.phases[self.reached + 1:] if not p.optional]
        return later[0] if later else self.table.phases[self.reached]

    def wrapper(self, raised: Raised) -> bool:
        return any(w.search(raised.text) for w in self.table.wrappers)

    # -- the verdict ------------------------------------------------------------------------------
    def verdict(self, explained: dict[int, str | None], fatal: list[tuple[int, str]], *,
                process_exited: bool = False) -> Verdict:
        """How the log ends, and the exception (or line) it quotes as the cause.

        ``explained``: line -> phase (or None) of every line an error pattern explains; ``fatal``:
        (line, text) of lines that by themselves stop a start-up (a pasted error without its
        traceback). ``process_exited``: the caller saw the process exit, which a SIGKILL does not log.
        """
        fatal = [(n, t) for n, t in fatal if self.stop_line is None or n < self.stop_line]
        window = [e for e in self.all_exceptions() if not e.after_stop and not e.handled]
        # an engine loop's frames in an excerpt: the server was serving before its first line
        in_loop = any(self.frame_phase(e)[0] == "serving" for e in window)
        if self.is_ready or in_loop:
            return self._ready_or_died(explained, fatal, in_loop=in_loop)
        window += [self._pseudo(n, t) for n, t in fatal if not any(e.line <= n <= e.line + 2 for e in window)]
        if not (window or self.failed_line or (process_exited and self.stop_line is None)):
            return self._cannot_tell()
        root = self._root(window, explained)
        phase = self._failed_phase(root, window, explained)
        return Verdict("failed", phase and phase.id, phase and phase.name, root.line if root else self.failed_line,
                       self._quote(root))

    def _pseudo(self, number: int, text: str) -> Raised:
        return Raised(number, text[:MAX_TEXT], "", (), self.reached, False)

    def _ready_or_died(self, explained: dict[int, str | None], fatal: list[tuple[int, str]], *,
                       in_loop: bool = False) -> Verdict:
        since = self.ready_line or 0  # a log that starts while serving was ready before its first line
        died = (self.died_line is not None and self.died_line >= since) or (in_loop and not self.is_ready)
        if not died:
            return Verdict("ready", "ready", self.table.phase("ready").name, self.ready_line or self.serving_line,
                           self.ready_text or "requests were served")
        window = [e for e in self.all_exceptions() if not e.after_stop and e.line >= since]
        window += [self._pseudo(n, t) for n, t in fatal if n >= since]
        root = self._root(window, explained)
        serving = self.table.phase("serving")
        quote = self._quote(root) if root else (self.died_text or "")
        return Verdict("died", serving.id, serving.name, root.line if root else self.died_line, quote)

    def _cannot_tell(self) -> Verdict:
        phase = self.marker_phase()
        stopped = f"the server was stopped while starting (line {self.stop_line})" if self.stop_line else ""
        return Verdict("cannot-tell", phase and phase.id, phase and phase.name, self.reached_line, stopped)

    def _root(self, candidates: list[Raised], explained: dict[int, str | None]) -> Raised | None:
        """The cause, not the wrapper: the first exception a pattern explains, else the first one
        that is not a wrapper (a chain prints its deepest cause first), else a cut traceback, else a wrapper."""
        candidates = sorted(candidates, key=lambda e: e.line)
        real = [e for e in candidates if not e.cut and not self.wrapper(e)]
        known = [e for e in real if any(n in explained for n in range(e.line, e.line + 3))]
        cut = [e for e in candidates if e.cut]
        return next(iter(known or real or cut or candidates), None)

    def _failed_phase(self, root: Raised | None, window: list[Raised], explained: dict[int, str | None]) -> Phase | None:
        """The phase the cause pins (a pattern's `phase`), else the frames of the cause (or of
        another exception of the same failure), else where the markers got to."""
        lines = [*range(root.line, root.line + 3), self.failed_line] if root else [self.failed_line]
        if placed := next((explained[n] for n in lines if n is not None and explained.get(n)), None):
            return self.table.phase(placed)
        marker = self.marker_phase()
        for raised in ([root] if root else []) + [e for e in window if e is not root]:
            phase_id, at_least = self.frame_phase(raised)
            if phase_id is not None:
                phase = self.table.phase(phase_id)
                return marker if at_least and marker is not None and marker.index > phase.index else phase
        return marker

    def _quote(self, root: Raised | None) -> str:
        if root is None:
            return self.failed_text or self.table.exited
        return f"{root.text} ({self.table.wrapper_note})" if self.wrapper(root) else root.text
