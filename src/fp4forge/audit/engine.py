"""`fp4forge audit`: open a checkpoint (local, HF repo id or https `/resolve/` base), run every
check against its headers (plus the few small scale tensors, which are bytes, not gigabytes; all
values with ``deep=True``) and return one ``AuditReport``.

    report = audit_checkpoint("path/or/org/repo", options)  # options: an AuditOptions (deep, fmt, vllm_version, ...)
    report.exit_code   # 0 no errors, 1 errors; unreadable input raises an Fp4forgeError (exit 2)

The checks live in ``checks_integrity`` (files, index, values), ``checks_declarations``
(quantization_config vs tensors), ``checks_names`` (tensors vs the architecture, and the
serving engine's known blind spots) and ``checks_server_files`` (tokenizer, chat template,
generation config, dtype, tied embeddings, processor files). Each is ``run(ctx) -> list[Issue]``; the rules they report
are the table in ``rules.toml``. The JSON document is described in ``findings.py``.
"""

from __future__ import annotations

from pathlib import Path

from fp4forge.audit import checks_declarations, checks_integrity, checks_names, checks_server_files, deep_scan
from fp4forge.audit.context import AuditContext
from fp4forge.audit.findings import AuditReport, Issue, group_issues
from fp4forge.audit.options import AuditOptions
from fp4forge.checkpoint.declarations import read_declaration
from fp4forge.checkpoint.layout import layout_or_inferred
from fp4forge.checkpoint.reader import gc_paused, open_checkpoint_lenient

CHECKS = (checks_integrity, checks_declarations, checks_names, checks_server_files)
#: The checks that read values with --deep (``deep_scan.deep_values``); the others read headers.
READS_VALUES = (checks_integrity, checks_declarations)


# -- the audit ------------------------------------------------------------------------------------
def audit_checkpoint(location: str | Path, options: AuditOptions = AuditOptions()) -> AuditReport:
    """Audit one checkpoint. Raises an Fp4forgeError (exit code 2) when it cannot be read at all."""
    with gc_paused():  # headers and name tables over 10^5 tensors: one collection after, not several
        return _audit(location, options)


def _audit(location: str | Path, options: AuditOptions) -> AuditReport:
    ckpt, rejected = open_checkpoint_lenient(location)
    issues = checks_integrity.unsafe_index_issues(rejected)
    # Every architecture gets a layout: its table, else the one derived from its transformers model
    # class, else one inferred from tensor names (config_issues says so); the per-Linear checks
    # run on all three.
    layout = layout_or_inferred(ckpt.config) if ckpt.config else None
    ctx = AuditContext(
        ckpt=ckpt,
        layout=layout,
        declaration=read_declaration(ckpt.config, ckpt.extra_json),
        deep=options.deep,
        fmt=options.fmt,
        vllm_version=options.version,
        trust_remote_code=options.trust_remote_code,
        device=options.device,
    )
    try:
        issues += _run_checks(ctx)
        issues = checks_integrity.without_knock_on(issues, ckpt)
        issues = checks_server_files.without_knock_on(issues, ctx)
    finally:
        deep_scan.stop(ctx)
        close = getattr(ckpt.source, "close", None)
        if close is not None:
            close()
    return AuditReport(
        checkpoint=str(location),
        findings=group_issues(issues),
        format=options.fmt,
        vllm_version=options.vllm_version,
        deep=options.deep,
        layout=layout.name if layout else None,
    )


def _run_checks(ctx: AuditContext) -> list[Issue]:
    """Every check's issues, in CHECKS order. With --deep the values are read on a background
    thread from the start (``deep_scan.start``) while the checks that read only headers run
    (transformers' import among them); then the value checks wait for the scan. The checks share
    nothing but the context's caches, so the order they run in changes no finding."""
    if not ctx.deep:
        return [issue for check in CHECKS for issue in check.run(ctx)]
    deep_scan.start(ctx)
    found = {check: check.run(ctx) for check in sorted(CHECKS, key=READS_VALUES.__contains__)}
    return [issue for check in CHECKS for issue in found[check]]
