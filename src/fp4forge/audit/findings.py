"""Findings of `fp4forge audit`: the rule table, one finding per (rule, problem), grouping of
many instances into one readable finding, the summary and the JSON document.

JSON document (``AuditReport.to_json()``; other tools rely on these keys)::

    {
      "checkpoint": "<path, repo id or URL as given>",
      "findings": [
        {"rule": "<rule id>", "severity": "error|warning|info",
         "message": "<what is wrong. why it matters at serve time. Fix: how>",
         "file": "<shard or file name, or null when several or none>",
         "tensors": ["<tensor name>", ...],          # every tensor involved, not just the examples
         "title": "<the rule's title>", "count": <instances grouped into this finding>}
      ],
      "summary": {"errors": <n>, "warnings": <n>, "infos": <n>},
      "audit": {"format": "...", "vllm_version": "...", "deep": false, "layout": "...|null"}
    }

Exit codes: 0 no errors (warnings allowed), 1 at least one error, 2 the input could not be audited.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from typing import Any

from fp4forge.errors import DataFileError
from fp4forge.checkpoint.names import natural_key  # noqa: F401 (re-exported: the checks sort with it)

SEVERITIES = ("error", "warning", "info")
EXAMPLES_SHOWN = 3


@dataclass(frozen=True)
class Rule:
    id: str
    severity: str
    category: str
    title: str
    rationale: str
    fix: str


@lru_cache(maxsize=1)
def rule_table() -> dict[str, Rule]:
    """Every rule, in table order, from ``rules.toml``."""
    text = resources.files("fp4forge.audit").joinpath("rules.toml").read_text(encoding="utf-8")
    rules: dict[str, Rule] = {}
    for entry in tomllib.loads(text)["rule"]:
        rule = Rule(**entry)
        if rule.severity not in SEVERITIES:
            raise DataFileError(f"rule {rule.id!r} has severity {rule.severity!r}", file="rules.toml")
        if rule.id in rules:
            raise DataFileError(f"rule {rule.id!r} defined twice", file="rules.toml")
        rules[rule.id] = rule
    return rules


def rule(rule_id: str) -> Rule:
    return rule_table()[rule_id]


@dataclass(frozen=True)
class Issue:
    """One instance of a rule, as a check finds it; ``group`` is the phrase shared by the
    instances that are reported together (e.g. "routed experts lacking input_global_scale"),
    ``subject`` the module or tensor this instance is about, ``detail`` an optional note on it."""

    rule: str
    group: str
    subject: str
    tensors: tuple[str, ...] = ()
    file: str | None = None
    detail: str | None = None
    note: str | None = None  # said once per finding, after the examples (e.g. why it matters here)


@dataclass
class Finding:
    rule: str
    severity: str
    title: str
    what: str
    why: str
    fix: str
    file: str | None = None
    tensors: list[str] = field(default_factory=list)
    count: int = 1

    @property
    def message(self) -> str:
        return f"{self.what}. {self.why}{FIX_MARK}{self.fix}"

    def to_json(self) -> dict[str, Any]:
        return {
            "rule": self.rule,
            "severity": self.severity,
            "message": self.message,
            "file": self.file,
            "tensors": self.tensors,
            "title": self.title,
            "count": self.count,
        }


FIX_MARK = " Fix: "  # joins a finding's what and why to its fix in ``message``


def split_fix(message: str) -> tuple[str, str | None]:
    """A finding's ``message`` as (what is wrong and why, the fix or None)."""
    what, mark, fix = message.rpartition(FIX_MARK)
    return (what, fix) if mark else (message, None)


def _example(issue: Issue) -> str:
    return f"{issue.subject} ({issue.detail})" if issue.detail else issue.subject


def examples_text(items: list[str], shown: int = EXAMPLES_SHOWN) -> str:
    """`a, b, c, … (+1,997 more)`."""
    head = ", ".join(items[:shown])
    return head if len(items) <= shown else f"{head}, … (+{len(items) - shown:,} more)"


def group_issues(issues: list[Issue]) -> list[Finding]:
    """One finding per (rule, group): the count, the first examples, every tensor."""
    grouped: dict[tuple[str, str], list[Issue]] = {}
    for issue in issues:
        grouped.setdefault((issue.rule, issue.group), []).append(issue)
    findings = []
    for (rule_id, group), members in grouped.items():
        spec = rule(rule_id)
        members.sort(key=lambda m: natural_key(m.subject))
        subjects = list(dict.fromkeys(_example(m) for m in members))
        what = f"{group} ({len(subjects):,}): {examples_text(subjects)}" if len(subjects) > 1 else f"{group}: {subjects[0]}"
        notes = list(dict.fromkeys(m.note for m in members if m.note))
        if notes:
            what += ". " + " ".join(notes)
        files = {m.file for m in members}
        findings.append(
            Finding(
                rule=rule_id,
                severity=spec.severity,
                title=spec.title,
                what=what,
                why=spec.rationale,
                fix=spec.fix,
                file=files.pop() if len(files) == 1 else None,
                tensors=list(dict.fromkeys(t for m in members for t in m.tensors)),
                count=len(subjects),
            )
        )
    rank = {s: i for i, s in enumerate(SEVERITIES)}
    order = {rule_id: i for i, rule_id in enumerate(rule_table())}
    return sorted(findings, key=lambda f: (rank[f.severity], order[f.rule]))


@dataclass
class AuditReport:
    checkpoint: str
    findings: list[Finding]
    format: str = "auto"
    vllm_version: str = ""
    deep: bool = False
    layout: str | None = None

    @property
    def summary(self) -> dict[str, int]:
        return {
            "errors": sum(f.severity == "error" for f in self.findings),
            "warnings": sum(f.severity == "warning" for f in self.findings),
            "infos": sum(f.severity == "info" for f in self.findings),
        }

    @property
    def exit_code(self) -> int:
        return 1 if self.summary["errors"] else 0

    def to_json(self) -> dict[str, Any]:
        return {
            "checkpoint": self.checkpoint,
            "findings": [f.to_json() for f in self.findings],
            "summary": self.summary,
            "audit": {"format": self.format, "vllm_version": self.vllm_version, "deep": self.deep, "layout": self.layout},
        }


RULES_BEGIN = "<!-- rules:begin (generated from src/fp4forge/audit/rules.toml; do not edit by hand) -->"
RULES_END = "<!-- rules:end -->"


def rules_markdown() -> str:
    """The rule list of docs/audit.md, generated from rules.toml: one line per rule."""
    lines = ["| id | severity | category | what it checks |", "|---|---|---|---|"]
    for spec in rule_table().values():
        lines.append(f"| `{spec.id}` | {spec.severity} | {spec.category} | {spec.title} |")
    return "\n".join(lines) + "\n"


def sync_rules_doc(text: str) -> str:
    """``text`` with the block between RULES_BEGIN and RULES_END replaced by rules_markdown()."""
    head, begin, rest = text.partition(RULES_BEGIN)
    _, end, tail = rest.partition(RULES_END)
    if not begin or not end:
        raise DataFileError(f"the document has no {RULES_BEGIN!r} … {RULES_END!r} block")
    return f"{head}{RULES_BEGIN}\n{rules_markdown()}{RULES_END}{tail}"


if __name__ == "__main__":  # python -m fp4forge.audit.findings docs/audit.md
    import sys
    from pathlib import Path

    target = Path(sys.argv[1])
    target.write_text(sync_rules_doc(target.read_text(encoding="utf-8")), encoding="utf-8")
