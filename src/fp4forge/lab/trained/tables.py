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
    if report["loss_first"] is None:
        table.add_row("training", "none: the untrained init (--steps 0)")
    else:
        table.add_row("loss: first step / last 10 steps", f"{report['loss_first']:.3f} / {report['loss_last_10_mean']:.3f}")
    table.add_row("router bias |mean| (learned by load balancing)", f"{report['router_bias_abs_mean']:.4f}")
    timing = report.get("timing", {})
    if timing and timing.get("seconds_per_step") is not None:
        table.add_row("training wall time", f"{timing['train_seconds']:.0f} s ({timing['seconds_per_step']:.2f} s/step, {report['training']['threads']} threads)")
    return table


def _pair(stats: dict[str, float], key: str) -> str:
    return f"{_fmt(stats[key + '_median'])}/{_fmt(stats[key + '_max'])}"


def tail_stats_rich(report: dict[str, Any]) -> list[Table]:
    """Per component: kurtosis (Gaussian = 3) and max|x|/RMS, as median/max over its tensors."""
    weights = Table(title="weights: kurtosis (Gaussian = 3) and max/RMS, median/max over tensors")
    for column in ("component", "n", "kurtosis", "max/RMS", "init kurtosis", "init max/RMS"):
        weights.add_column(column, justify="left" if column == "component" else "right", no_wrap=True)
    untrained = report.get("untrained_weights", {})
    for component, stats in report["weights"].items():
        before = untrained.get(component)
        weights.add_row(
            component, str(stats["tensors"]), _pair(stats, "kurtosis"), _pair(stats, "max_over_rms"),
            _pair(before, "kurtosis") if before else "", _pair(before, "max_over_rms") if before else "",
        )
    activations = Table(title="activations (Linear inputs, one held-out batch): kurtosis and max/RMS, median/max over layers")
    for column in ("component", "layers", "kurtosis", "max/RMS"):
        activations.add_column(column, justify="left" if column == "component" else "right", no_wrap=True)
    for component, stats in report["activations"].items():
        activations.add_row(component, str(stats["tensors"]), _pair(stats, "kurtosis"), _pair(stats, "max_over_rms"))
    return [weights, activations]
