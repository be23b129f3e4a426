"""`fp4forge audit` and `fp4forge diff`, added to the main Typer app by ``register(app)``.

    fp4forge audit PATH_OR_REPO [--json] [--markdown] [--deep] [--format auto|compressed-tensors|modelopt]
                   [--vllm-version V] [--trust-remote-code] [--device auto|cpu|cuda|cuda:N]
    fp4forge audit --list-rules [--json] [--markdown]
    fp4forge diff A B [--json] [--markdown] [--values]

Exit codes. audit: 0 no errors (warnings allowed), 1 at least one error, 2 the input could not be
audited. diff: 0 identical, 1 differences, 2 a checkpoint could not be read. Exit 2 always comes
with a one-line message on stderr (and, with --json, a {"error": ...} document on stdout).
"""

from __future__ import annotations

import sys
from typing import Optional

import typer

from fp4forge.audit.options import AUDIT_FORMATS, AuditOptions, DiffOptions
from fp4forge.cli.audit_run import _fail, run_audit
from fp4forge.cli.common import emit_json as _emit
from fp4forge.cli.common import error_text
from fp4forge.errors import Fp4forgeError


def register(app: typer.Typer) -> None:
    app.command("audit")(audit_command)
    app.command("diff")(diff_command)


def audit_command(
    location: Optional[str] = typer.Argument(None, metavar="PATH_OR_REPO", help="Checkpoint directory, .safetensors file, HF repo id, or https://…/resolve/<rev> URL."),
    as_json: bool = typer.Option(False, "--json", help="One JSON document: checkpoint, findings, summary."),
    markdown: bool = typer.Option(False, "--markdown", help="A Markdown report (for issues and model cards)."),
    deep: bool = typer.Option(AuditOptions.deep, "--deep", help="Also read every value: NaN/Inf weights, zero matrices, block scales, scale statistics."),
    fmt: str = typer.Option(AuditOptions.fmt, "--format", help=f"{', '.join(AUDIT_FORMATS)}: the format the checkpoint must be in."),
    vllm_version: str = typer.Option(AuditOptions.vllm_version, "--vllm-version", help="vLLM version the checkpoint will be served with (selects known blind spots)."),
    trust_remote_code: bool = typer.Option(AuditOptions.trust_remote_code, "--trust-remote-code", help="Allow the model's own code when building its expected tensor names."),
    list_rules: bool = typer.Option(False, "--list-rules", help="Print every rule the audit applies and exit."),
    device: str = typer.Option(AuditOptions.device, "--device", help="Where --deep reduces the values: auto (CUDA when available, else every CPU core) | cpu | cuda | cuda:N; the findings are the same."),
) -> None:
    """Will this checkpoint load, and load right? Integrity, declarations vs tensors, names vs the architecture."""
    run_audit(location, as_json=as_json, markdown=markdown, deep=deep, fmt=fmt, vllm_version=vllm_version, trust_remote_code=trust_remote_code, list_rules=list_rules, device=device)


def diff_command(
    a: str = typer.Argument(..., metavar="A", help="First checkpoint (directory, repo id or /resolve/ URL)."),
    b: str = typer.Argument(..., metavar="B", help="Second checkpoint."),
    as_json: bool = typer.Option(False, "--json", help="One JSON document: summary, per component, differing tensors."),
    markdown: bool = typer.Option(False, "--markdown", help="A Markdown table of the counts."),
    values: bool = typer.Option(DiffOptions.values, "--values", help="Max abs / rel difference of differing tensors of equal shape (float32)."),
) -> None:
    """Which tensors two checkpoints share byte for byte (blake2b per tensor, streamed)."""
    from rich.console import Console

    from fp4forge.audit.diff import diff_checkpoints
    from fp4forge.report.audit_tables import diff_markdown, diff_rich
    from fp4forge.report.tables import fit_table

    try:
        report = diff_checkpoints(a, b, DiffOptions(values=values))
    except Fp4forgeError as exc:
        raise _fail(f"could not diff: {error_text(exc)}", as_json, a=a, b=b) from None
    if as_json:
        _emit(report.to_json())
    elif markdown:
        sys.stdout.write(diff_markdown(report))
    else:
        console = Console()
        for table in diff_rich(report):
            console.print(fit_table(table, console))
    raise SystemExit(report.exit_code)
