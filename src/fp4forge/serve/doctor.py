"""Read a vLLM startup log and say what each telling line means: `fp4forge serve doctor`.

The knowledge is data (``doctor_patterns.toml``): one regex per kind of line, the vLLM versions
that emit it, a severity, a meaning and a fix, refined per captured value (``cases``). This module
only matches lines against that table. JSON form (documented in docs/serve.md; other tools rely on
these keys)::

    {"vllm_version": "0.32.0" | null,
     "findings": [{"id", "severity", "message", "line", "fix", "text"}]}

``line`` is the 1-based line number in the log; ``fix`` may be null; ``text`` is the log line.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from importlib import resources
from typing import Any

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from fp4forge.errors import ConfigError

SEVERITIES = ("error", "warning", "info")
PATTERNS_FILE = "doctor_patterns.toml"
# vLLM prefixes its lines with "(Proc pid=N) LEVEL MM-DD HH:MM:SS [file.py:N] "; matched lines
# are reported without it.
LOG_PREFIX = re.compile(r"^(?:\(\S+ pid=\d+\) )?(?:DEBUG|INFO|WARNING|ERROR|CRITICAL) \d\d-\d\d \S+ \[[^\]]+\] ")
# Only the first match counts per (id, message): every vLLM process logs some lines again.
MAX_TEXT = 400


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
def load_patterns() -> tuple[list[re.Pattern[str]], tuple[Pattern, ...]]:
    text = resources.files("fp4forge.serve").joinpath(PATTERNS_FILE).read_text(encoding="utf-8")
    data = tomllib.loads(text)
    version_regexes = [re.compile(r) for r in data["version"]["regexes"]]
    return version_regexes, tuple(_compile(entry) for entry in data["pattern"])


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
    values = _Missing(groups)
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

    def __init__(self, vllm_version: str | None = None) -> None:
        self.vllm_version = vllm_version
        self._version = _parse_version(vllm_version)
        self._version_regexes, self._patterns = load_patterns()
        self._seen: set[tuple[str, str]] = set()
        self._after_seen: set[str] = set()  # ids of patterns whose `after` context has appeared
        self.findings: list[Finding] = []
        self.line_count = 0

    def feed(self, line: str) -> list[Finding]:
        self.line_count += 1
        line = line.rstrip("\r\n")
        if self.vllm_version is None:
            for regex in self._version_regexes:
                match = regex.search(line)
                if match:
                    self.vllm_version = match["version"]
                    self._version = _parse_version(self.vllm_version)
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

    def diagnosis(self) -> Diagnosis:
        order = {s: i for i, s in enumerate(SEVERITIES)}
        findings = sorted(self.findings, key=lambda f: (order[f.severity], f.line))
        return Diagnosis(self.vllm_version, findings)


def diagnose(lines: Iterable[str], *, vllm_version: str | None = None) -> Diagnosis:
    """Findings of a whole log, errors first. The version comes from the log unless given; it is
    read before matching, so that version-restricted patterns apply from the first line."""
    lines = list(lines)
    doctor = LogDoctor(vllm_version or find_vllm_version(lines))
    for line in lines:
        doctor.feed(line)
    return doctor.diagnosis()


def iter_lines(text: str) -> Iterator[str]:
    # vLLM's resource tracker can leave NUL runs in a log it shares with a restarted server.
    yield from text.replace("\x00", "").splitlines()
