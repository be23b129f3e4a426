"""Read a vLLM startup log and say what each telling line means: `fp4forge serve doctor`.

The knowledge is data (``doctor_patterns.toml``): one regex per kind of line, the vLLM versions
that emit it, a severity, a meaning and a fix, refined per captured value (``cases``). This module
only matches lines against that table. JSON form (documented in docs/serve.md; other tools rely on
these keys)::

    {"vllm_version": "0.32.0" | null,
     "findings": [{"id", "severity", "message", "line", "fix", "text"}]}

``line`` is the 1-based line number in the log; ``fix`` may be null; ``text`` is the log line.

Besides the per-line patterns, the doctor follows the server's life (``[lifecycle]`` in the same
file): a server that never became ready, or whose engine died, is always an error finding that
quotes the root exception, whether or not a pattern knows it. With the checkpoint (given, or read
from the log's engine line when it is a local directory) it also says whether the FP8 KV cache
runs at scale 1.0, from the knowledge ``serve cmd`` uses (:func:`fp4forge.serve.recommend.kv_cache_verdict`).
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from fp4forge.errors import ConfigError, Fp4forgeError

SEVERITIES = ("error", "warning", "info")
PATTERNS_FILE = "doctor_patterns.toml"
# vLLM prefixes its lines with "(Proc pid=N) LEVEL MM-DD HH:MM:SS [file.py:N] "; matched lines
# are reported without it.
LOG_PREFIX = re.compile(r"^(?:\(\S+ pid=\d+\) )?(?:DEBUG|INFO|WARNING|ERROR|CRITICAL) \d\d-\d\d \S+ \[[^\]]+\] ")
# Only the first match counts per (id, message): every vLLM process logs some lines again.
MAX_TEXT = 400
PROCESS_TAG = re.compile(r"^\((?P<proc>\S+ pid=\d+)\) ")
TRACEBACK_START = "Traceback (most recent call last):"
# The last line of a Python traceback: a (dotted) exception name, then ": message" or nothing.
EXCEPTION_LINE = re.compile(r"^(?P<type>[A-Za-z_][\w.]*)(?:: (?P<message>.*))?$")
# Context lines of a traceback that are not frames (chained exceptions).
KV_SCALE_ONE_ID = "kv-scale-1.0"  # the pattern of vLLM's own scale-1.0 warning
CHAIN_LINES = ("The above exception was the direct cause", "During handling of the above exception")


@dataclass(frozen=True)
class Pattern:
    id: str
    regex: re.Pattern[str]
    severity: str
    message: str
    fix: str | None
    versions: SpecifierSet | None
    cases: dict[str, dict[str, dict[str, str]]] = field(default_factory=dict)
    # (regex, overrides): once a line matched regex, later matches take these severity/message/fix
    after: tuple[re.Pattern[str], dict[str, str]] | None = None

    def applies_to(self, version: Version | None) -> bool:
        return version is None or self.versions is None or self.versions.contains(version, prereleases=True)


@dataclass(frozen=True)
class Finding:
    id: str
    severity: str
    message: str
    line: int
    fix: str | None
    text: str

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Diagnosis:
    vllm_version: str | None
    findings: list[Finding]

    def to_json(self) -> dict[str, Any]:
        return {"vllm_version": self.vllm_version, "findings": [f.to_json() for f in self.findings]}

    @property
    def worst(self) -> str | None:
        present = {f.severity for f in self.findings}
        return next((s for s in SEVERITIES if s in present), None)


@dataclass(frozen=True)
class Lifecycle:
    ready: tuple[re.Pattern[str], ...]
    stopping: tuple[re.Pattern[str], ...]
    failed: tuple[re.Pattern[str], ...]
    died: tuple[re.Pattern[str], ...]
    wrappers: tuple[re.Pattern[str], ...]
    failed_id: str
    failed_message: str
    died_id: str
    died_message: str
    unknown_fix: str
    exited_message: str
    engine_config: tuple[re.Pattern[str], ...]  # named groups: model, quantization, kv_cache_dtype
    kv_id: str


@dataclass(frozen=True)
class RaisedException:
    line: int
    text: str  # "Type: message", or "Type (at: the last source line)" for a bare exception
    after_ready: bool
    after_stop: bool


class _Missing(dict):
    def __missing__(self, key: str) -> str:
        return "{" + key + "}"


def _compile(entry: dict[str, Any]) -> Pattern:
    try:
        versions = SpecifierSet(entry["vllm"]) if entry.get("vllm") else None
        regex = re.compile(entry["regex"])
    except (InvalidSpecifier, re.error, KeyError) as error:
        raise ConfigError(f"{PATTERNS_FILE}: pattern {entry.get('id')!r} is invalid: {error}") from error
    after = entry.get("after")
    if entry["severity"] not in SEVERITIES or (after and after.get("severity", "info") not in SEVERITIES):
        raise ConfigError(f"{PATTERNS_FILE}: pattern {entry['id']!r} has severity {entry['severity']!r}")
    return Pattern(
        id=entry["id"],
        regex=regex,
        severity=entry["severity"],
        message=entry["message"],
        fix=entry.get("fix"),
        versions=versions,
        cases=entry.get("cases", {}),
        after=(re.compile(after["regex"]), {k: v for k, v in after.items() if k != "regex"}) if after else None,
    )


@lru_cache(maxsize=1)
def _load_table() -> dict[str, Any]:
    text = resources.files("fp4forge.serve").joinpath(PATTERNS_FILE).read_text(encoding="utf-8")
    return tomllib.loads(text)


@lru_cache(maxsize=1)
def load_patterns() -> tuple[list[re.Pattern[str]], tuple[Pattern, ...]]:
    data = _load_table()
    version_regexes = [re.compile(r) for r in data["version"]["regexes"]]
    return version_regexes, tuple(_compile(entry) for entry in data["pattern"])


@lru_cache(maxsize=1)
def load_lifecycle() -> Lifecycle:
    data = _load_table()
    life, context = data["lifecycle"], data["context"]
    try:
        regexes = {key: tuple(re.compile(r) for r in life[key]) for key in ("ready", "stopping", "failed", "died", "wrappers")}
        engine_config = tuple(re.compile(r) for r in context["engine_config"])
    except (re.error, KeyError) as error:
        raise ConfigError(f"{PATTERNS_FILE}: [lifecycle]/[context] is invalid: {error}") from error
    return Lifecycle(
        **regexes,
        failed_id=life["failed_id"],
        failed_message=life["failed_message"],
        died_id=life["died_id"],
        died_message=life["died_message"],
        unknown_fix=life["unknown_fix"],
        exited_message=life["exited_message"],
        engine_config=engine_config,
        kv_id=context["kv_id"],
    )


def find_vllm_version(lines: Iterable[str]) -> str | None:
    version_regexes, _ = load_patterns()
    for line in lines:
        for regex in version_regexes:
            match = regex.search(line)
            if match:
                return match["version"]
    return None


def _parse_version(version: str | None) -> Version | None:
    if version is None:
        return None
    try:
        return Version(version)
    except InvalidVersion:
        return None


@lru_cache(maxsize=1)
def _knowledge_values() -> dict[str, str]:
    """Placeholders a pattern's message or fix may use, from the knowledge ``serve cmd`` uses:
    ``{cpu_kv_override}`` is the flags that serve a declared FP8 KV cache unquantized on a CPU
    without AVX-512/AMX."""
    from fp4forge.serve.recommend import knowledge

    override = knowledge()["cpu_fp8_kv"]["override"]
    return {"cpu_kv_override": " ".join(part for flag in override for part in flag)}


def _finding(pattern: Pattern, match: re.Match[str], number: int, text: str, after_seen: bool) -> Finding:
    groups = {k: v for k, v in match.groupdict().items() if v is not None}
    severity, message, fix = pattern.severity, pattern.message, pattern.fix
    overrides = [table.get(groups.get(group, ""), table.get("*")) for group, table in pattern.cases.items()]
    if after_seen and pattern.after is not None:
        overrides.append({"fix": None, **pattern.after[1]})
    for case in overrides:
        if case:
            severity = case.get("severity", severity)
            message = case.get("message", message)
            fix = case.get("fix", fix)
    values = _Missing({**_knowledge_values(), **groups})
    return Finding(
        id=pattern.id,
        severity=severity,
        message=message.format_map(values),
        line=number,
        fix=None if fix is None else fix.format_map(values),
        text=text[:MAX_TEXT],
    )


class LogDoctor:
    """Incremental: feed lines as they arrive (``serve up`` streams the log through it)."""

    def __init__(self, vllm_version: str | None = None, checkpoint: str | None = None, *, find_checkpoint: bool = True) -> None:
        self.vllm_version = vllm_version
        self._version = _parse_version(vllm_version)
        self._version_regexes, self._patterns = load_patterns()
        self._life = load_lifecycle()
        self._seen: set[tuple[str, str]] = set()
        self._after_seen: set[str] = set()  # ids of patterns whose `after` context has appeared
        self.findings: list[Finding] = []
        self.line_count = 0
        # the server's life, for the lifecycle finding
        self.checkpoint = checkpoint
        self.find_checkpoint = find_checkpoint  # read the log's model path when it is a local directory
        self.ready_line: int | None = None
        self.stop_line: int | None = None
        self.failed_line: int | None = None  # first start-up failure line (before any stop)
        self.failed_text: str | None = None
        self.died_line: int | None = None  # first engine-death line after ready (before any stop)
        self.exceptions: list[RaisedException] = []
        self.engine: dict[str, str] = {}  # model, quantization, kv_cache_dtype from the engine line
        self.engine_line: int | None = None
        self._frames: dict[str, str | None] = {}  # per process: last source line of an open traceback
        self._facts: dict[str | None, Any] = {}  # checkpoint location -> CheckpointFacts | None

    def feed(self, line: str) -> list[Finding]:
        self.line_count += 1
        line = line.rstrip("\r\n")
        if self.vllm_version is None:
            for regex in self._version_regexes:
                match = regex.search(line)
                if match:
                    self.vllm_version = match["version"]
                    self._version = _parse_version(self.vllm_version)
        self._follow_life(line)
        text = LOG_PREFIX.sub("", line).strip()
        new = []
        for pattern in self._patterns:
            if not pattern.applies_to(self._version):
                continue
            if pattern.after is not None and pattern.after[0].search(line):
                self._after_seen.add(pattern.id)
            match = pattern.regex.search(line)
            if match is None:
                continue
            finding = _finding(pattern, match, self.line_count, text, pattern.id in self._after_seen)
            key = (finding.id, finding.message)
            if key not in self._seen:
                self._seen.add(key)
                new.append(finding)
        self.findings.extend(new)
        return new

    def _follow_life(self, line: str) -> None:
        life, number = self._life, self.line_count
        tag = PROCESS_TAG.match(line)
        proc = tag["proc"] if tag else ""
        body = LOG_PREFIX.sub("", line).rstrip()
        if self.ready_line is None and any(r.search(line) for r in life.ready):
            self.ready_line = number
        if self.stop_line is None and any(r.search(line) for r in life.stopping):
            self.stop_line = number
        stopped = self.stop_line is not None
        if not stopped:
            if self.ready_line is None and self.failed_line is None and any(r.search(body) for r in life.failed):
                self.failed_line, self.failed_text = number, body.strip()
            if self.ready_line is not None and self.died_line is None and any(r.search(body) for r in life.died):
                self.died_line = number
        for regex in life.engine_config:
            match = regex.search(line)
            if match:
                self.engine.update({k: v for k, v in match.groupdict().items() if v is not None})
                self.engine_line = self.engine_line or number
        # Tracebacks, per process (vLLM's processes interleave their lines).
        if body.strip() == TRACEBACK_START:
            self._frames[proc] = None
            return
        if proc not in self._frames:
            return
        if body.startswith((" ", "\t")) or not body.strip() or body.startswith(CHAIN_LINES):
            stripped = body.strip()
            if stripped and not stripped.startswith(("File ", "^", "~")):
                self._frames[proc] = stripped
            return
        match = EXCEPTION_LINE.match(body.strip())
        last_source = self._frames.pop(proc)
        if match is None:
            return
        text = body.strip()
        if match["message"] is None and last_source:
            text = f"{text} (at: {last_source})"
        self.exceptions.append(RaisedException(number, text, self.ready_line is not None, stopped))

    def _root_exception(self, *, after_ready: bool) -> RaisedException | None:
        candidates = [e for e in self.exceptions if e.after_ready == after_ready and not e.after_stop]
        if not candidates:
            return None
        wrappers = self._life.wrappers
        return next((e for e in candidates if not any(w.search(e.text) for w in wrappers)), candidates[0])

    def _life_finding(self, pattern_findings: list[Finding], process_exited: bool = False) -> Finding | None:
        """The error for a server that never became ready or whose engine died, or None."""
        life = self._life
        if self.ready_line is None:
            root = self._root_exception(after_ready=False)
            if root is None and self.failed_line is None and not (process_exited and self.stop_line is None):
                return None  # still starting, or stopped while starting: nothing says it failed
            finding_id, template = life.failed_id, life.failed_message
        elif self.died_line is not None:
            root = self._root_exception(after_ready=True)
            finding_id, template = life.died_id, life.died_message
        else:
            return None
        line = root.line if root else self.failed_line or self.died_line or 1
        quoted = root.text if root else (self.failed_text or life.exited_message)
        specific = [f for f in pattern_findings if f.severity == "error" and f.fix]
        # a pattern that matched the root line (or, else, any failure pattern) knows the fix
        known = next((f for f in specific if f.line == line), specific[0] if specific else None)
        fix = f"{known.fix} (finding {known.id})" if known else life.unknown_fix.format(line=line)
        return Finding(finding_id, "error", template.format(root=quoted[:MAX_TEXT]), line, fix, quoted[:MAX_TEXT])

    def _kv_finding(self) -> Finding | None:
        """KV cache at scale 1.0 inferred from the engine line and the checkpoint (serve cmd's rule)."""
        from fp4forge.serve.recommend import kv_cache_verdict, read_checkpoint_facts

        dtype = self.engine.get("kv_cache_dtype")
        if dtype is None or any(f.id == KV_SCALE_ONE_ID for f in self.findings):
            return None  # no engine line, or vLLM said it itself
        location = self.checkpoint or self.engine.get("model")
        if location not in self._facts:  # read once: diagnosis() may be asked for repeatedly
            facts = None
            if self.checkpoint is not None:
                facts = read_checkpoint_facts(self.checkpoint)  # asked for: an unreadable one is an error
            elif location and self.find_checkpoint and Path(location).is_dir():
                try:
                    facts = read_checkpoint_facts(location)
                except Fp4forgeError:
                    facts = None  # the log's path may name another machine's directory
            self._facts[location] = facts
        facts = self._facts[location]
        verdict = kv_cache_verdict(facts, dtype, quantization=self.engine.get("quantization"), model=location)
        if verdict is None:
            return None
        return Finding(self._life.kv_id, verdict.severity, verdict.message, self.engine_line or 1, verdict.check, "")

    def diagnosis(self, *, process_exited: bool = False) -> Diagnosis:
        """All findings, errors first. ``process_exited``: the caller saw the vLLM process exit
        before it was ready (``serve up``), which the log alone cannot say (a SIGKILL leaves no line)."""
        order = {s: i for i, s in enumerate(SEVERITIES)}
        findings = list(self.findings)
        for extra in (self._life_finding(findings, process_exited), self._kv_finding()):
            if extra is not None:
                findings.append(extra)
        findings = sorted(findings, key=lambda f: (order[f.severity], f.line))
        return Diagnosis(self.vllm_version, findings)

    @property
    def failed(self) -> bool:
        """True when the log shows a start-up failure or an engine death (not a requested stop)."""
        return self._life_finding([]) is not None


def diagnose(
    lines: Iterable[str], *, vllm_version: str | None = None, checkpoint: str | None = None, find_checkpoint: bool = True
) -> Diagnosis:
    """Findings of a whole log, errors first. The version comes from the log unless given; it is
    read before matching, so that version-restricted patterns apply from the first line.
    ``checkpoint`` (a local directory or repo) lets the doctor infer what the log cannot say (an
    FP8 KV cache at scale 1.0); by default the model path on the log's engine line is used when it
    is a local directory (``find_checkpoint=False``: never)."""
    lines = list(lines)
    doctor = LogDoctor(vllm_version or find_vllm_version(lines), checkpoint=checkpoint, find_checkpoint=find_checkpoint)
    for line in lines:
        doctor.feed(line)
    return doctor.diagnosis()


def iter_lines(text: str) -> Iterator[str]:
    # vLLM's resource tracker can leave NUL runs in a log it shares with a restarted server.
    # Split on "\n" only: progress bars write "\r", which str.splitlines() would count as a line
    # break, and findings' line numbers must match an editor's.
    lines = text.replace("\x00", "").split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    yield from (line.rstrip("\r") for line in lines)
