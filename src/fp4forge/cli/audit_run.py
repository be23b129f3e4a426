"""`fp4forge audit` itself, without typer: the typer command (``fp4forge.cli.audit``) and a
plain command line's fast path (``fp4forge.cli.fast``) call ``run_audit`` with the same values,
which become the job's one :class:`AuditOptions` here. Importing typer and pydantic costs a JSON
audit ~0.4 s; nothing here imports them."""

from __future__ import annotations

import sys

from fp4forge.audit.options import audit_options
from fp4forge.cli.common import emit_json as _emit
from fp4forge.cli.common import error_text, fail
from fp4forge.errors import ExitCode, Fp4forgeError


def run_audit(location: str | None, *, as_json: bool = False, markdown: bool = False, list_rules: bool = False, **given: object) -> None:
    """Audit ``location`` and print the report; exits with the audit's code (SystemExit).
    ``given``: :class:`AuditOptions`' fields by name."""
    if list_rules:
        _print_rules(as_json, markdown)
        return
    if location is None:
        raise _fail("give a checkpoint (PATH_OR_REPO), or --list-rules", as_json)
    try:
        options = audit_options(**given)
        from fp4forge.audit.engine import audit_checkpoint

        report = audit_checkpoint(location, options)
    except Fp4forgeError as exc:
        raise _fail(f"could not audit: {error_text(exc)}", as_json, checkpoint=location) from None
    except (OSError, MemoryError, RecursionError) as exc:  # hostile input the checks did not foresee
        raise _fail(f"could not audit: {type(exc).__name__}: {exc}", as_json, checkpoint=location) from None
    _print_report(report, as_json, markdown)
    # SystemExit, not typer.Exit: `app(standalone_mode=False)` (fp4forge.cli.main) returns a
    # typer.Exit's code instead of exiting with it, and the exit code is this command's answer.
    raise SystemExit(report.exit_code)


def _fail(message: str, as_json: bool, **context: object) -> SystemExit:
    """Exit 2 with a one-line message (and a JSON error document when --json)."""
    return fail(message, ExitCode.UNUSABLE, as_json, **context)


def _print_rules(as_json: bool, markdown: bool) -> None:
    from dataclasses import asdict

    from fp4forge.audit.findings import rule_table, rules_markdown

    if as_json:
        _emit({"rules": [asdict(r) for r in rule_table().values()]})
    elif markdown:
        sys.stdout.write(rules_markdown())
    else:
        from rich.console import Console

        from fp4forge.report.audit_tables import rules_rich

        Console().print(rules_rich())


def _print_report(report, as_json: bool, markdown: bool) -> None:
    if as_json:  # no rich, no tables: their imports cost a JSON run ~0.2 s
        _emit(report.to_json())
        return
    from rich.console import Console

    from fp4forge.report.audit_tables import findings_markdown, findings_rich, summary_line

    if markdown:
        sys.stdout.write(findings_markdown(report))
    else:
        console = Console()
        for block in findings_rich(report) if report.findings else []:
            console.print(block)
        style = "bold red" if report.summary["errors"] else "bold green"
        console.print(summary_line(report), style=style, highlight=False)
