"""Presentation of `fp4forge audit` and `fp4forge diff`: rich tables for people, Markdown for
model cards and issues. No computation here."""

from __future__ import annotations

from rich.console import RenderableType
from rich.padding import Padding
from rich.table import Table
from rich.text import Text

from fp4forge.audit.diff import STATUSES, DiffReport
from fp4forge.audit.findings import AuditReport, rule_table

SEVERITY_STYLES = {"error": "bold red", "warning": "yellow", "info": "cyan"}
DIFF_LISTED = 40  # differing tensors shown in the human table (all of them are in --json)


def summary_line(report: AuditReport) -> str:
    s = report.summary
    verdict = "FAIL" if s["errors"] else "PASS"
    return f"{verdict}: {s['errors']} error(s), {s['warnings']} warning(s), {s['infos']} info — {report.checkpoint}"


def findings_rich(report: AuditReport) -> list[RenderableType]:
    """One block per finding: severity, rule and file on a line, then what / why / fix."""
    blocks: list[RenderableType] = [Text(f"fp4forge audit — {report.checkpoint}", style="bold")]
    for finding in report.findings:
        head = Text(f"{finding.severity.upper():<8}", style=SEVERITY_STYLES[finding.severity])
        head.append(finding.rule, style="bold")
        if finding.file:
            head.append(f"  {finding.file}", style="dim")
        body = Text(finding.what + ".")
        body.append(f"\nWhy: {finding.why}", style="dim")
        body.append(f"\nFix: {finding.fix}", style="green")
        blocks += [Text(""), head, Padding(body, (0, 0, 0, 8))]
    return blocks


def findings_markdown(report: AuditReport) -> str:
    lines = [f"## fp4forge audit: `{report.checkpoint}`", "", summary_line(report), ""]
    if report.findings:
        lines += ["| severity | rule | finding | file |", "|---|---|---|---|"]
        for f in report.findings:
            message = f.message.replace("|", "\\|").replace("\n", " ")
            lines.append(f"| {f.severity} | `{f.rule}` | {message} | {f.file or ''} |")
    return "\n".join(lines) + "\n"


def rules_rich() -> Table:
    table = Table(title="fp4forge audit rules (src/fp4forge/audit/rules.toml; --json or --markdown for the rationale)")
    for column in ("id", "severity", "category"):
        table.add_column(column, no_wrap=True)
    table.add_column("what it checks", ratio=1)
    for spec in rule_table().values():
        table.add_row(spec.id, Text(spec.severity, style=SEVERITY_STYLES[spec.severity]), spec.category, spec.title)
    return table


def diff_rich(report: DiffReport) -> list[Table]:
    counts = Table(title=f"fp4forge diff — A: {report.a}  B: {report.b}")
    counts.add_column("component")
    for status in STATUSES:
        counts.add_column(status.replace("_", " "), justify="right")
    for component, row in sorted(report.components.items()):
        counts.add_row(component, *(f"{row[s]:,}" for s in STATUSES))
    counts.add_row("total", *(f"{report.summary[s]:,}" for s in STATUSES), style="bold")
    tables = [counts]
    listed = [e for e in report.entries if e.status != "identical"]
    if listed:
        detail = Table(title=f"Tensors that differ ({len(listed):,}" + (f", first {DIFF_LISTED} shown; all with --json)" if len(listed) > DIFF_LISTED else ")"))
        for column in ("tensor", "status", "reason", "max |a−b|", "max rel"):
            detail.add_column(column, justify="right" if column.startswith("max") else "left")
        for entry in listed[:DIFF_LISTED]:
            detail.add_row(entry.name, entry.status.replace("_", " "), entry.reason or "", _number(entry.max_abs), _number(entry.max_rel))
        tables.append(detail)
    return tables


def diff_markdown(report: DiffReport) -> str:
    header = ["component", *STATUSES]
    lines = ["## fp4forge diff", "", f"A: `{report.a}`  ", f"B: `{report.b}`", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for component, row in sorted(report.components.items()):
        lines.append(f"| {component} | " + " | ".join(f"{row[s]:,}" for s in STATUSES) + " |")
    lines.append("| **total** | " + " | ".join(f"**{report.summary[s]:,}**" for s in STATUSES) + " |")
    return "\n".join(lines) + "\n"


def _number(value: float | None) -> str:
    return "" if value is None else f"{value:.4g}"
