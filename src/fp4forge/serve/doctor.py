"""Read a vLLM log and say how the start-up went and what each telling line means: `fp4forge serve doctor`.

Two kinds of knowledge, both data. ``doctor_startup.toml`` is vLLM's start-up as ordered phases
(:mod:`fp4forge.serve.doctor_startup`): every log gets one verdict, printed first -- ready (with its
evidence line), failed at phase P (quoting the deepest relevant exception, not the wrapper that
re-raised it), died after ready, or cannot tell (the log ends at phase P). ``doctor_patterns.toml``
explains lines: one regex per kind of line, the vLLM versions that emit it, a severity, a meaning
and a fix, refined per captured value (``cases``); an error pattern may pin the phase its error
stops (``phase``) and say that the line alone means the start-up stopped (``fatal``). JSON form
(documented in docs/serve.md; other tools rely on these keys)::

    {"verdict": {"state", "phase", "phase_name", "line", "evidence", "summary"},
     "vllm_version": "0.32.0" | null,
     "findings": [{"id", "severity", "message", "line", "fix", "text"}]}

``line`` is the 1-based line number in the log; ``fix`` may be null; ``text`` is the log line.
A server that failed or died is always an error finding quoting the cause, whether or not a pattern
knows it. Served requests that got HTTP 4xx/5xx are findings too. With the checkpoint (given, or
read from the log's engine line when it is a local directory) the doctor also says whether the FP8
KV cache runs at scale 1.0, from the knowledge ``serve cmd`` uses
(:func:`fp4forge.serve.recommend.kv_cache_verdict`).
"""

from __future__ import annotations

import json
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

from fp4forge.errors import ConfigError, Fp4forgeError, NotAVllmLogError
from fp4forge.serve.doctor_startup import StartupTracker, Verdict, check_log_text, load_startup_table, split_prefix

SEVERITIES = ("error", "warning", "info")
PATTERNS_FILE = "doctor_patterns.toml"
# vLLM prefixes its lines with "(Proc pid=N) LEVEL MM-DD HH:MM:SS [file.py:N] " (serve/process.py
# strips it for its live status; the doctor reports lines without every prefix doctor_startup.toml knows).
LOG_PREFIX = re.compile(r"^(?:\(\S+ pid=\d+\) )?(?:DEBUG|INFO|WARNING|ERROR|CRITICAL) \d\d-\d\d \S+ \[[^\]]+\] ")
PROCESS_TAG = re.compile(r"^\((?P<proc>\S+ pid=\d+)\) ")
# Only the first match counts per (id, message): every vLLM process logs some lines again.
MAX_TEXT = 400
KV_SCALE_ONE_ID = "kv-scale-1.0"  # the pattern of vLLM's own scale-1.0 warning
# A request the API server answered (uvicorn's access line).
ACCESS_LINE = re.compile(r'"(?P<method>POST|GET|PUT|DELETE) (?P<path>/v1/[^ ?"]*)\S* HTTP/[\d.]+" (?P<status>\d{3})')
LIFECYCLE_TEXTS = ("failed_id", "failed_message", "died_id", "died_message", "unknown_fix", "http_id", "http_message",
                   "http_fix", "not_vllm_message")


@dataclass(frozen=True)
class Pattern:
    id: str
    regex: re.Pattern[str]
    severity: str
    message: str
    fix: str | None
    versions: SpecifierSet | None
    cases: dict[str, dict[str, dict[str, str]]] = field(default_factory=dict)
    phase: str | None = None  # the start-up phase this error stops (doctor_startup.toml)
    fatal: bool = False  # the line alone means the start-up (or the engine) stopped
    # (regex, overrides): once a line matched regex, later matches take these severity/message/fix
    after: tuple[re.Pattern[str], dict[str, str]] | None = None
    # overrides by the engine line's context ([context] engine_config groups), wherever that line comes:
    # {"quantization": {"None": {...}}} rewrites the finding of a log whose engine serves no quantization
    engine: dict[str, dict[str, dict[str, str]]] = field(default_factory=dict)

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
    verdict: Verdict

    def to_json(self) -> dict[str, Any]:
        return {"verdict": self.verdict.to_json(), "vllm_version": self.vllm_version,
                "findings": [f.to_json() for f in self.findings]}

    @property
    def worst(self) -> str | None:
        present = {f.severity for f in self.findings}
        return next((s for s in SEVERITIES if s in present), None)

    @property
    def verdict_line(self) -> str:
        """The one line every front end prints first (the CLI, the pipeline, the card)."""
        return self.verdict.summary

    def passes(self, *, partial: bool = False) -> bool:
        """Exit 0: the server came up (or, with ``partial``, the log ends before it could) and no
        finding is an error."""
        state_ok = self.verdict.state == "ready" or (partial and self.verdict.state == "cannot-tell")
        return state_ok and self.worst != "error"


@dataclass(frozen=True)
class Lifecycle:
    """The doctor's own findings about the server's life (texts in ``[lifecycle]``)."""

    failed_id: str
    failed_message: str
    died_id: str
    died_message: str
    unknown_fix: str
    http_id: str
    http_message: str
    http_fix: str
    not_vllm_message: str
    engine_config: tuple[re.Pattern[str], ...]  # named groups: model, quantization, kv_cache_dtype
    kv_id: str


class _Missing(dict):
    def __missing__(self, key: str) -> str:
        return "{" + key + "}"


EVIDENCE_FILE = "_vllm_startup_markers.json"


@lru_cache(maxsize=1)
def release_evidence() -> tuple[tuple[str, ...], dict[str, list[str]]]:
    """The vLLM releases read by scripts/vllm_startup_markers.py, and per pattern id the ones whose
    own source prints the pattern's line; a line a serving library prints (torch's exceptions,
    uvicorn's) is that library's, whichever vLLM runs it, so it has no vLLM releases here."""
    doc = json.loads(resources.files("fp4forge.serve").joinpath(EVIDENCE_FILE).read_text(encoding="utf-8"))
    printed = {row["where"].removeprefix("pattern."): [] if row["libraries"] else row["vllm"]
               for row in doc["markers"] if row["where"].startswith("pattern.")}
    return tuple(doc["releases"]), printed


def derived_versions(printed: list[str], releases: tuple[str, ...]) -> SpecifierSet:
    """The releases a line is printed by, as a range between the releases read: after the last one
    read that does not print it, before the first one after that stopped printing it (a release
    between two read ones is given the benefit of the doubt)."""
    ordered = sorted(releases, key=Version)
    first, last = ordered.index(min(printed, key=Version)), ordered.index(max(printed, key=Version))
    parts = [f">{ordered[first - 1]}"] if first > 0 else []
    parts += [f"<{ordered[last + 1]}"] if last + 1 < len(ordered) else []
    return SpecifierSet(",".join(parts))


def _versions(entry: dict[str, Any]) -> SpecifierSet | None:
    """From vLLM's own sources where they print the line; a hand-written `vllm` only for lines no
    vLLM source holds (the plugin's, torch's and CUDA's messages)."""
    releases, printed = release_evidence()
    if printed.get(entry["id"]):
        return derived_versions(printed[entry["id"]], releases)
    return SpecifierSet(entry["vllm"]) if entry.get("vllm") else None


def _compile(entry: dict[str, Any]) -> Pattern:
    try:
        versions = _versions(entry)
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
        engine=entry.get("engine", {}),
        phase=entry.get("phase"),
        fatal=bool(entry.get("fatal")),
    )


@lru_cache(maxsize=1)
def _load_table() -> dict[str, Any]:
    text = resources.files("fp4forge.serve").joinpath(PATTERNS_FILE).read_text(encoding="utf-8")
    return tomllib.loads(text)


@lru_cache(maxsize=1)
def load_patterns() -> tuple[list[re.Pattern[str]], tuple[Pattern, ...]]:
    data = _load_table()
    version_regexes = [re.compile(r) for r in data["version"]["regexes"]]
    patterns = tuple(_compile(entry) for entry in data["pattern"])
    phases = {p.id for p in load_startup_table().phases}
    if unknown := sorted({p.phase for p in patterns if p.phase} - phases):
        raise ConfigError(f"{PATTERNS_FILE}: patterns name unknown phases {unknown}")
    return version_regexes, patterns


@lru_cache(maxsize=1)
def load_lifecycle() -> Lifecycle:
    data = _load_table()
    life, context = data["lifecycle"], data["context"]
    try:
        engine_config = tuple(re.compile(r) for r in context["engine_config"])
        return Lifecycle(**{key: life[key] for key in LIFECYCLE_TEXTS}, engine_config=engine_config, kv_id=context["kv_id"])
    except (re.error, KeyError) as error:
        raise ConfigError(f"{PATTERNS_FILE}: [lifecycle]/[context] is invalid: {error}") from error


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


def _finding(pattern: Pattern, groups: dict[str, str], number: int, text: str, after_seen: bool,
             engine: dict[str, str] | None = None) -> Finding:
    severity, message, fix = pattern.severity, pattern.message, pattern.fix
    overrides = [table.get(groups.get(group, ""), table.get("*")) for group, table in pattern.cases.items()]
    if after_seen and pattern.after is not None:
        overrides.append({"fix": None, **pattern.after[1]})
    overrides += [table.get((engine or {}).get(key, "")) for key, table in pattern.engine.items()]
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
        fix=fix.format_map(values) if fix else None,  # "" in the table: no fix
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
        self.startup = StartupTracker()  # the phases, the exceptions, how the server's life ended
        self.explained: dict[int, str | None] = {}  # line -> phase of every line an error pattern explains
        self.fatal: list[tuple[int, str]] = []  # lines that by themselves stop a start-up
        self.requests: dict[str, list[tuple[int, int]]] = {}  # path -> (line, HTTP status) of each answer
        self.checkpoint = checkpoint
        self.find_checkpoint = find_checkpoint  # read the log's model path when it is a local directory
        self.engine: dict[str, str] = {}  # model, quantization, kv_cache_dtype from the engine line
        self.engine_line: int | None = None
        self._facts: dict[str | None, Any] = {}  # checkpoint location -> CheckpointFacts | None
        self._engine_bound: list[tuple[Pattern, dict[str, str], int, str, bool]] = []  # findings the engine line refines

    def feed(self, line: str) -> list[Finding]:
        self.line_count += 1
        line = line.rstrip("\r\n")
        if self.vllm_version is None:
            self._read_version(line)
        self.startup.feed(self.line_count, line)
        self._follow_context(line)
        body = split_prefix(line)[1]  # without the process tag and vLLM's (or torch's) prefix
        text = body.strip()
        new = []
        for pattern in self._patterns:
            if not pattern.applies_to(self._version):
                continue
            if pattern.after is not None and pattern.after[0].search(line):
                self._after_seen.add(pattern.id)
            match = pattern.regex.search(line)
            if match is None:
                continue
            groups = {k: v for k, v in match.groupdict().items() if v is not None}
            finding = _finding(pattern, groups, self.line_count, text, pattern.id in self._after_seen, self.engine)
            if pattern.engine:  # the engine line may come later: diagnosis() renders it again then
                self._engine_bound.append((pattern, groups, self.line_count, text, pattern.id in self._after_seen))
            if finding.severity == "error":
                self.explained.setdefault(self.line_count, pattern.phase)
                if pattern.fatal and not body.startswith((" ", "\t")):  # not a traceback's source line
                    self.fatal.append((self.line_count, body.strip()))
            key = (finding.id, finding.message)
            if key not in self._seen:
                self._seen.add(key)
                new.append(finding)
        self.findings.extend(new)
        return new

    def _read_version(self, line: str) -> None:
        for regex in self._version_regexes:
            match = regex.search(line)
            if match:
                self.vllm_version = match["version"]
                self._version = _parse_version(self.vllm_version)

    def _follow_context(self, line: str) -> None:
        for regex in self._life.engine_config:
            match = regex.search(line)
            if match:
                self.engine.update({k: v for k, v in match.groupdict().items() if v is not None})
                self.engine_line = self.engine_line or self.line_count
        if match := ACCESS_LINE.search(line):
            self.requests.setdefault(match["path"], []).append((self.line_count, int(match["status"])))

    def verdict(self, *, process_exited: bool = False) -> Verdict:
        """How the start-up went (see StartupTracker.verdict)."""
        return self.startup.verdict(self.explained, self.fatal, process_exited=process_exited)

    def _life_finding(self, verdict: Verdict) -> Finding | None:
        """The error for a server that failed to start or whose engine died, or None."""
        life = self._life
        if verdict.state not in ("failed", "died"):
            return None
        line = verdict.line or 1
        specific = [f for f in self.findings if f.severity == "error" and f.fix]
        # a pattern that matched the cause's lines (or, else, any failure pattern) knows the fix
        near = range(line, line + 3)
        known = next((f for f in specific if f.line in near), specific[0] if specific else None)
        fix = f"{known.fix} (finding {known.id})" if known else life.unknown_fix.format(line=line)
        if verdict.state == "failed":
            message = life.failed_message.format(phase=verdict.phase or "unknown", phase_name=verdict.phase_name or "unknown",
                                                 root=verdict.evidence[:MAX_TEXT])
            return Finding(life.failed_id, "error", message, line, fix, verdict.evidence[:MAX_TEXT])
        message = life.died_message.format(root=verdict.evidence[:MAX_TEXT])
        return Finding(life.died_id, "error", message, line, fix, verdict.evidence[:MAX_TEXT])

    def _engine_refined(self) -> list[Finding]:
        """The findings, those whose pattern depends on the engine line rendered with it (the line may
        follow theirs: the plugin announces itself before the engine says what it serves)."""
        refined = {}
        for pattern, groups, number, text, after_seen in self._engine_bound:
            refined[(pattern.id, number)] = _finding(pattern, groups, number, text, after_seen, self.engine)
        out, seen = [], set()
        for finding in self.findings:
            finding = refined.get((finding.id, finding.line), finding)
            if (finding.id, finding.message) not in seen:
                seen.add((finding.id, finding.message))
                out.append(finding)
        return out

    def _request_findings(self) -> list[Finding]:
        """Served requests answered with HTTP 4xx/5xx: an error when a server error (5xx) or when no
        request to that endpoint succeeded, a warning when some did."""
        life, out = self._life, []
        chat_fix = next((f.fix for f in self.findings if f.id == "chat-template-missing"), None)
        for path, answers in self.requests.items():
            failed = [(n, status) for n, status in answers if status >= 400]
            if not failed:
                continue
            statuses = ", ".join(sorted({str(status) for _, status in failed}))
            every = len(failed) == len(answers)
            severity = "error" if every or any(status >= 500 for _, status in failed) else "warning"
            message = life.http_message.format(failed=len(failed), total=len(answers), path=path, statuses=statuses,
                                               line=failed[0][0])
            fix = chat_fix if chat_fix and "chat" in path else life.http_fix.format(line=failed[0][0])
            out.append(Finding(life.http_id, severity, message, failed[0][0], fix, ""))
        return out

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
        # the cache is FP8 by the engine line, and nothing here says whether its scales are calibrated:
        # a warning that names what to check (serve cmd's rule says info: it may not be FP8 at all)
        severity = "warning" if facts is None and dtype.startswith("fp8") else verdict.severity
        return Finding(self._life.kv_id, severity, verdict.message, self.engine_line or 1, verdict.check, "")

    def diagnosis(self, *, process_exited: bool = False) -> Diagnosis:
        """The verdict and all findings, errors first. ``process_exited``: the caller saw the vLLM
        process exit before it was ready (``serve up``), which the log alone cannot say (a SIGKILL
        leaves no line)."""
        order = {s: i for i, s in enumerate(SEVERITIES)}
        verdict = self.verdict(process_exited=process_exited)
        findings = self._engine_refined() + self._request_findings()
        for extra in (self._life_finding(verdict), self._kv_finding()):
            if extra is not None:
                findings.append(extra)
        findings = sorted(findings, key=lambda f: (order[f.severity], f.line))
        return Diagnosis(self.vllm_version, findings, verdict)

    def check_is_vllm_log(self) -> None:
        """Raise NotAVllmLogError when nothing in the lines fed so far is vLLM's."""
        if not (self.startup.vllm_evidence or self.startup.reached >= 0 or self.explained):
            raise NotAVllmLogError(self._life.not_vllm_message.format(lines=self.line_count), kind="not-vllm")

    @property
    def failed(self) -> bool:
        """True when the log shows a start-up failure or an engine death (not a requested stop)."""
        return self.verdict().state in ("failed", "died")


def diagnose(
    lines: Iterable[str], *, vllm_version: str | None = None, checkpoint: str | None = None, find_checkpoint: bool = True,
    strict: bool = False,
) -> Diagnosis:
    """The verdict and the findings of a whole log, errors first. The version comes from the log
    unless given; it is read before matching, so that version-restricted patterns apply from the
    first line. ``checkpoint`` (a local directory or repo) lets the doctor infer what the log cannot
    say (an FP8 KV cache at scale 1.0); by default the model path on the log's engine line is used
    when it is a local directory (``find_checkpoint=False``: never). ``strict``: raise
    NotAVllmLogError for lines with nothing of vLLM in them (check the text with
    :func:`check_log_text` first for empty and binary input)."""
    lines = list(lines)
    doctor = LogDoctor(vllm_version or find_vllm_version(lines), checkpoint=checkpoint, find_checkpoint=find_checkpoint)
    for line in lines:
        doctor.feed(line)
    if strict:
        doctor.check_is_vllm_log()
    return doctor.diagnosis()


def diagnose_text(text: str, **options: Any) -> Diagnosis:
    """``diagnose`` of a whole log's text, refusing what is not a vLLM log (NotAVllmLogError:
    empty, binary, or no vLLM line)."""
    check_log_text(text)
    return diagnose(iter_lines(text), strict=True, **options)


def iter_lines(text: str) -> Iterator[str]:
    # vLLM's resource tracker can leave NUL runs in a log it shares with a restarted server.
    # Split on "\n" only: progress bars write "\r", which str.splitlines() would count as a line
    # break, and findings' line numbers must match an editor's.
    lines = text.replace("\x00", "").split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    yield from (line.rstrip("\r") for line in lines)
