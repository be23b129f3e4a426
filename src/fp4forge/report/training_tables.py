"""Tables for the trained testbed's training report (``fp4forge-training.json``)."""

from __future__ import annotations

from typing import Any

from rich.table import Table


def _fmt(value: float) -> str:
    return f"{value:.1f}" if value >= 10 else f"{value:.2f}"


def training_summary_rich(report: dict[str, Any]) -> Table:
    table = Table(title="trained tiny Laguna", show_header=False)
    table.add_column("what")
    table.add_column("value", justify="right")
    table.add_row("held-out perplexity (bf16, as shipped)", f"{report['heldout_perplexity']:.2f}")
    table.add_row("held-out perplexity of the untrained init", f"{report['untrained_heldout_perplexity']:.0f}")
    table.add_row("vocabulary size", str(report["vocab_size"]))
    table.add_row("held-out tokens scored", f"{report['heldout_tokens']:,}")
    table.add_row("training tokens seen", f"{report['train_tokens_seen']:,}")
    table.add_row("loss: first step / last 10 steps", f"{report['loss_first']:.3f} / {report['loss_last_10_mean']:.3f}")
    table.add_row("router bias |mean| (learned by load balancing)", f"{report['router_bias_abs_mean']:.4f}")
    timing = report.get("timing", {})
    if timing:
        table.add_row("training wall time", f"{timing['train_seconds']:.0f} s ({timing['seconds_per_step']:.2f} s/step, {report['training']['threads']} threads)")
    return table


def tail_stats_rich(report: dict[str, Any]) -> Table:
    """Per component: kurtosis (Gaussian = 3) and max|x|/RMS, median and max over its tensors."""
    table = Table(title="heavy tails per component (kurtosis: Gaussian = 3; median / max over tensors)")
    for column in ("kind", "component", "tensors", "kurtosis", "max/RMS", "untrained kurtosis", "untrained max/RMS"):
        table.add_column(column, justify="left" if column in ("kind", "component") else "right")
    untrained = report.get("untrained_weights", {})
    for kind, stats in (("weights", report["weights"]), ("activations", report["activations"])):
        for component, s in stats.items():
            before = untrained.get(component) if kind == "weights" else None
            table.add_row(
                kind,
                component,
                str(s["tensors"]),
                f"{_fmt(s['kurtosis_median'])} / {_fmt(s['kurtosis_max'])}",
                f"{_fmt(s['max_over_rms_median'])} / {_fmt(s['max_over_rms_max'])}",
                f"{_fmt(before['kurtosis_median'])} / {_fmt(before['kurtosis_max'])}" if before else "",
                f"{_fmt(before['max_over_rms_median'])} / {_fmt(before['max_over_rms_max'])}" if before else "",
            )
    return table
