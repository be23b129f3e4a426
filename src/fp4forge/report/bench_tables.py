"""Presentation of `fp4forge bench`: rich tables for people, Markdown for model cards.

Input is the summary / compare dicts from ``fp4forge.bench.analyze``; no statistics here. A
bimodal shape never shows a median: it shows its modes with their shares.
"""

from __future__ import annotations

from typing import Any

from rich.console import RenderableType
from rich.table import Table
from rich.text import Text

OVERHEAD_STYLE = "dim"


def _ms(seconds: float | None) -> str:
    return "–" if seconds is None else f"{seconds * 1000:,.1f}"


def _rate(value: float | None) -> str:
    return "–" if value is None else f"{value:,.1f}"


def _ci_ms(ci: list[float] | None) -> str:
    return "" if not ci else f" [{ci[0] * 1000:,.1f}–{ci[1] * 1000:,.1f}]"


def _ci_rate(ci: list[float] | None) -> str:
    return "" if not ci else f" [{ci[0]:,.1f}–{ci[1]:,.1f}]"


def ttft_cell(entry: dict[str, Any]) -> str:
    """Median with CI, or the modes of a bimodal shape ("316 ms (29%) | 825 ms (71%)")."""
    if entry["bimodal"]:
        return "bimodal: " + " | ".join(f"{m['centre'] * 1000:,.1f} ({m['share']:.0%})" for m in entry["modes"])
    return _ms(entry["median_ttft_s"]) + _ci_ms(entry["median_ttft_ci_s"])


def ttft_range(entry: dict[str, Any]) -> str:
    block = entry["ttft_s"]
    if not block:
        return "–"
    return f"{block['min'] * 1000:,.1f} / {block['p10'] * 1000:,.1f} / {block['p90'] * 1000:,.1f} / {block['max'] * 1000:,.1f}"


def decode_cell(entry: dict[str, Any]) -> str:
    if entry["decode_bimodal"]:
        return "bimodal: " + " | ".join(f"{m['centre']:,.1f} ({m['share']:.0%})" for m in entry["decode_modes"])
    return _rate(entry["median_decode_tok_s"]) + _ci_rate(entry["median_decode_tok_s_ci"])


def failures_cell(entry: dict[str, Any]) -> str:
    if not entry["n_failed"]:
        return "0"
    return f"{entry['n_failed']} (" + ", ".join(f"{k} {v}" for k, v in sorted(entry["failures_by_kind"].items())) + ")"


def prefill_line(fit: dict[str, Any]) -> str:
    goodness = fit.get("goodness") or {}
    verdict = goodness.get("verdict")
    if fit.get("rate_tok_s") is None:
        text = f"load {fit['load']}: no prefill rate — {fit.get('reason')}"
        return text + (f"; {verdict}" if verdict and verdict != "no line fitted" else "")
    ci = fit.get("rate_ci_tok_s")
    ci_text = ""
    if ci:
        upper = "∞" if ci[1] is None else f"{ci[1]:,.0f}"
        ci_text = f" (95% CI {ci[0]:,.0f}–{upper})"
    overhead = [r["prompt_tokens"] for r in fit["regimes"] if r["regime"] != "compute-dominated"]
    text = (
        f"load {fit['load']}: prefill line {fit['rate_tok_s']:,.0f} tok/s{ci_text}, intercept "
        f"{fit['intercept_s'] * 1000:,.1f} ms, fitted over the medians at {fit['fit_prompt_tokens']} prompt tokens; "
        f"below the knee (overhead, not throughput): {overhead}"
    )
    return text + (f". Goodness of fit: {verdict}" if verdict else "")


def flatness_line(flat: dict[str, Any]) -> str:
    if flat.get("flat") is None and flat.get("verdict") is None:
        return f"load {flat['load']}: decode flatness needs >= 2 shapes"
    spread = (f"per-shape medians {flat['min_shape_median_tok_s']:,.2f}–{flat['max_shape_median_tok_s']:,.2f} tok/s "
              f"({flat['relative_spread']:.1%} of {flat['median_tok_s']:,.2f})")
    if "verdict" not in flat or flat.get("change_across_context_ci") is None:  # a summary from before the regression test
        return f"load {flat['load']}: decode across context — {spread}; no regression test recorded"
    lo, hi = flat["change_across_context_ci"]
    first, last = flat["context_range"]
    tested = (f"slope over all n={flat['n']} samples: {flat['change_across_context']:+.1%} from {first:,.0f} to {last:,.0f} "
              f"prompt tokens (95% CI {lo:+.1%} to {hi:+.1%}; R² {_r2(flat.get('r2'))})")
    verdict = flat["verdict"]
    if verdict == "flat":
        head = f"decode flat across context (the change's CI lies within ±{flat['tolerance']:.0%})"
    elif verdict == "cannot tell apart":
        head = (f"decode across context: cannot tell flat from changing (n={flat['n']}; the CI covers 0 and reaches past "
                f"±{flat['tolerance']:.0%})")
    else:
        head = f"decode {verdict} (the slope's CI excludes 0)"
    return f"load {flat['load']}: {head} — {tested}; {spread}"


def _r2(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}"


SUMMARY_COLUMNS = (
    "shape",
    "load",
    "n",
    "TTFT ms median [95% CI] or modes",
    "TTFT ms min / p10 / p90 / max",
    "decode tok/s median [95% CI]",
    "prefill regime",
    "failed",
)


def summary_rows(summary: dict[str, Any]) -> list[list[str]]:
    return [
        [
            e["shape"],
            e["load"],
            str(e["n"]),
            ttft_cell(e),
            ttft_range(e),
            decode_cell(e),
            e["prefill_regime"] or "–",
            failures_cell(e),
        ]
        for e in summary["shapes"]
    ]


def notes(summary: dict[str, Any]) -> list[str]:
    lines = [prefill_line(f) for f in summary["prefill"]] + [flatness_line(f) for f in summary["decode_flatness"]]
    totals = summary["totals"]
    lines.append(
        f"{totals['requests']} requests: {totals['kept_ok']} kept, {totals['warmups']} warmups discarded, "
        f"{totals['failed']} failed {totals['failures_by_kind'] or ''}".rstrip()
    )
    caveated = sorted({c for e in summary["shapes"] if e["ttft_s"] for c in e["ttft_s"]["caveats"] if c.startswith("p")})
    if caveated:
        lines.append("percentile caveats: " + "; ".join(caveated))
    run = summary.get("run") or {}
    if run.get("aborted"):
        lines.append(f"ABORTED: {run['aborted']}")
    return lines


def summary_rich(summary: dict[str, Any]) -> list[RenderableType]:
    run = summary.get("run") or {}
    title = f"fp4forge bench — {run.get('model') or ''} {run.get('url') or ''}".strip()
    table = Table(title=title)
    for column in SUMMARY_COLUMNS:
        table.add_column(column, no_wrap=column in ("shape", "load", "n"))
    for entry, row in zip(summary["shapes"], summary_rows(summary)):
        style = OVERHEAD_STYLE if entry["prefill_regime"] == "overhead, not throughput" else None
        cells: list[Text | str] = [Text(c, style="bold red") if c.startswith("bimodal") else c for c in row]
        table.add_row(*cells, style=style)
    return [table, *(Text(line) for line in notes(summary))]


def summary_markdown(summary: dict[str, Any]) -> str:
    run = summary.get("run") or {}
    lines = [f"## fp4forge bench: `{run.get('model') or 'run'}`", ""]
    lines += ["| " + " | ".join(SUMMARY_COLUMNS) + " |", "|" + "---|" * len(SUMMARY_COLUMNS)]
    for row in summary_rows(summary):
        lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |")
    lines.append("")
    lines += [f"- {line}" for line in notes(summary)]
    return "\n".join(lines) + "\n"


# -- compare ------------------------------------------------------------------------------------
COMPARE_COLUMNS = ("load", "shape", "n A / B", "TTFT B/A [95% CI]", "TTFT verdict", "decode B/A [95% CI]", "decode verdict")


def _ratio_cell(metric: dict[str, Any]) -> str:
    if metric["ratio"] is None:
        return "–"
    return f"{metric['ratio']:.3f} [{metric['ci'][0]:.3f}–{metric['ci'][1]:.3f}]"


def compare_rows(doc: dict[str, Any]) -> list[list[str]]:
    return [
        [
            row["load"],
            row["shape"],
            f"{row['n_a']} / {row['n_b']}",
            _ratio_cell(row["ttft"]),
            row["ttft"]["verdict"],
            _ratio_cell(row["decode_tok_s"]),
            row["decode_tok_s"]["verdict"],
        ]
        for row in doc["cells"]
    ]


def compare_rich(doc: dict[str, Any]) -> list[RenderableType]:
    table = Table(title=f"fp4forge bench compare — A: {doc.get('a')}  B: {doc.get('b')}  ({doc['ratio']})")
    for column in COMPARE_COLUMNS:
        table.add_column(column)
    for row in compare_rows(doc):
        table.add_row(*row)
    extra = [Text(doc["ci"], style="dim")]
    if doc["only_in_a"] or doc["only_in_b"]:
        extra.append(Text(f"unmatched cells — only in A: {doc['only_in_a']}; only in B: {doc['only_in_b']}", style="yellow"))
    return [table, *extra]


def compare_markdown(doc: dict[str, Any]) -> str:
    lines = [f"## fp4forge bench compare: A `{doc.get('a')}` vs B `{doc.get('b')}`", "", f"Ratio: {doc['ratio']}; {doc['ci']}.", ""]
    lines += ["| " + " | ".join(COMPARE_COLUMNS) + " |", "|" + "---|" * len(COMPARE_COLUMNS)]
    lines += ["| " + " | ".join(row) + " |" for row in compare_rows(doc)]
    return "\n".join(lines) + "\n"
