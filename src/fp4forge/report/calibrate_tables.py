"""Presentation of calibration, KV-scale and fidelity results: rich tables, no computation."""

from __future__ import annotations

from typing import Any

from rich.table import Table

from fp4forge.report.markdown import interval_text

SEVERITY_STYLE = {"error": "red", "warning": "yellow", "info": "cyan"}


def _num(value: float | list[float] | None, fmt: str = "{:.6g}") -> str:
    if value is None:
        return "—"
    if isinstance(value, list):
        return "[" + ", ".join(fmt.format(v) for v in value) + "]"
    return fmt.format(value)


def calibration_rich(summary: dict[str, Any], out_path: str) -> Table:
    table = Table(title=f"Calibration statistics → {out_path}", show_header=False)
    table.add_column("what")
    table.add_column("value", justify="right")
    rows = [
        ("statistics tensors", f"{summary['tensors']:,}"),
        ("tokens", f"{summary['tokens']:,}"),
        ("seconds", f"{summary['seconds']:.1f}"),
        ("tokens / s", f"{summary['tokens_per_s']:.1f}"),
        ("MoE coverage policy", str(summary.get("moe_policy"))),
        ("experts without tokens", f"{len(summary.get('experts_without_tokens') or [])} (given their layer peers' max)"),
        ("activation batches spilled to disk", f"{summary['spilled_batches']:,}"),
    ]
    for row in rows:
        table.add_row(*row)
    return table


def kv_rich(report: dict[str, Any]) -> list[Table]:
    title = f"KV-cache scales — {report['checkpoint']} (layout {report['layout'] or 'none'}; FP8 KV {'declared' if report['declared'] else 'not declared'})"
    layers = Table(title=title)
    for column in ("layer", "k_scale", "v_scale", "k amax", "v amax"):
        layers.add_column(column, justify="left" if column == "layer" else "right")
    for row in report["layers"]:
        layers.add_row(row["layer"], _num(row["k_scale"]), _num(row["v_scale"]), _num(row["k_amax"], "{:.4g}"), _num(row["v_amax"], "{:.4g}"))
    tables = [layers]
    if report["findings"]:
        findings = Table(title="Findings")
        for column in ("severity", "rule", "finding", "layers"):
            findings.add_column(column)
        for f in report["findings"]:
            shown = ", ".join(f["layers"][:4]) + (f" (+{len(f['layers']) - 4})" if len(f["layers"]) > 4 else "")
            fix = f" Fix: {f['fix']}" if f.get("fix") else ""
            findings.add_row(f"[{SEVERITY_STYLE[f['severity']]}]{f['severity']}[/]", f.get("rule", ""), f["message"] + "." + fix, shown or "—")
        tables.append(findings)
    return tables


def fidelity_rich(report: dict[str, Any]) -> list[Table]:
    metrics = report["metrics"]
    kl = metrics["kl"]
    head = Table(title=f"Fidelity — student {report['student']} vs teacher {report['teacher']} ({report['numerics']})", show_header=False)
    head.add_column("metric")
    head.add_column("value", justify="right")
    intervals = metrics.get("intervals", {})
    level = next(iter(intervals.values()), {}).get("level", 0.95)
    ppl = metrics["perplexity"]
    rows = [
        ("predicted positions", f"{metrics['positions']:,}"),
        (f"bootstrap units ({level:.0%} intervals)", f"{metrics['documents']} documents, {metrics['tokens']:,} tokens"),
        (f"KL(teacher‖student) mean / median / p99 [{kl['estimator']}]", f"{kl['mean']:.6f} / {kl['median']:.6f} / {kl['p99']:.6f}"),
        ("KL mean interval", interval_text(intervals.get("kl"), "{:.6f}".format)),
        ("top-1 agreement", f"{metrics['top1_agreement'] * 100:.2f} % {interval_text(intervals.get('top1_agreement'), '{:.2%}'.format)}"),
        ("perplexity teacher", f"{ppl['teacher']:.4g} {interval_text(intervals.get('teacher_perplexity'), '{:.4g}'.format)}"),
        ("perplexity student", f"{ppl['student']:.4g} {interval_text(intervals.get('student_perplexity'), '{:.4g}'.format)}"),
        ("KV cache", report["kv_cache"]),
        ("MoE input scales", report["moe_input_scale"]),
    ]
    readability = metrics.get("readability") or {}
    if readability.get("readable") is False:
        rows.insert(0, ("[bold red]UNREADABLE TEXT[/bold red]", "[bold red]scored anyway: see the warning[/bold red]"))
    elif readability.get("warning"):  # not checked (no vocab_size): say so, without calling the text unreadable
        rows.insert(0, ("readability", readability["warning"]))
    if "kl_cache_estimate" in metrics:
        est = metrics["kl_cache_estimate"]
        rows.append(("KL cache estimate (same run) mean / median / p99", f"{est['mean']:.6f} / {est['median']:.6f} / {est['p99']:.6f}"))
    for row in rows:
        head.add_row(*row)
    tables = [head]
    if report["layers"]:
        layers = Table(title="Per-layer output relative error ‖student − teacher‖ / ‖teacher‖")
        for column in ("layer", "accumulated", "local (teacher input)"):
            layers.add_column(column, justify="left" if column == "layer" else "right")
        for row in report["layers"]:
            layers.add_row(row["layer"], f"{row['relative_error']:.4f}", f"{row['local_relative_error']:.4f}")
        tables.append(layers)
    return tables
