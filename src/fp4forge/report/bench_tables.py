"""Presentation of `fp4forge bench`: rich tables for people, Markdown for model cards.

Input is the summary / compare dicts from ``fp4forge.bench.analyze``; no statistics here. A
bimodal shape never shows a median: it shows its modes with their shares.
"""

from __future__ import annotations

from typing import Any

from rich.console import RenderableType
from rich.table import Table
from rich.text import Text

from fp4forge.bench import stats

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


# -- the fits' claims: one text per fit, printed alike in the notes and the plots' legends ------------
def prefill_claim(fit: dict[str, Any]) -> str:
    """The prefill line as a claim: rate, intercept and its R² over its shapes' samples; a rate whose
    slope's CI reaches 0 (no upper bound) is said not to be established."""
    r2 = (fit.get("goodness") or {}).get("r2_line")
    ci = fit.get("rate_ci_tok_s")
    unbounded = " (not established: the slope's 95% CI reaches 0, TTFT is not shown to grow with the prompt)" if ci and ci[1] is None else ""
    return (f"line {fit['rate_tok_s']:,.0f} tok/s{unbounded}, intercept {fit['intercept_s'] * 1000:,.1f} ms"
            + (f", R² {stats.format_r2(r2)}" if r2 is not None else ""))


def quadratic_claim(curvature: dict[str, Any]) -> str:
    return f"quadratic (curved), R² {stats.format_r2(curvature['r2_quadratic'])}"


def flatness_claim(flat: dict[str, Any]) -> str:
    """The decode line as a claim: the change across the measured context with its CI and R²."""
    lo, hi = flat["change_across_context_ci"]
    first, last = flat["context_range"]
    return (f"{flat['change_across_context']:+.1%} from {first:,.0f} to {last:,.0f} prompt tokens "
            f"(95% CI {lo:+.1%} to {hi:+.1%}; R² {stats.format_r2(flat.get('r2'))})")


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
        f"load {fit['load']}: prefill {prefill_claim(fit)}{ci_text}, fitted over the medians at {fit['fit_prompt_tokens']} "
        f"prompt tokens; below the knee (overhead, not throughput): {overhead}"
    )
    return text + (f". Goodness of fit: {verdict}" if verdict else "")


def flatness_line(flat: dict[str, Any]) -> str:
    if flat.get("flat") is None and flat.get("verdict") is None:
        return f"load {flat['load']}: decode flatness needs >= 2 shapes"
    spread = (f"per-shape medians {flat['min_shape_median_tok_s']:,.2f}–{flat['max_shape_median_tok_s']:,.2f} tok/s "
              f"({flat['relative_spread']:.1%} of {flat['median_tok_s']:,.2f})")
    if "verdict" not in flat or flat.get("change_across_context_ci") is None:  # a summary from before the regression test
        return f"load {flat['load']}: decode across context — {spread}; no regression test recorded"
    tested = f"slope over all n={flat['n']} samples: {flatness_claim(flat)}"
    verdict, order = flat["verdict"], flat.get("order_test") or {}
    if verdict == "flat":
        head = f"decode flat across context (the change's CI lies within ±{flat['tolerance']:.0%})"
    elif verdict == "cannot tell apart" and order.get("claim"):
        head = f"decode across context: cannot tell (the whole run's slope says \"{order['claim']}\", but {order['reason']})"
    elif verdict == "cannot tell apart":
        head = (f"decode across context: cannot tell flat from changing (n={flat['n']}; the CI covers 0 and reaches past "
                f"±{flat['tolerance']:.0%})")
    else:
        head = f"decode {verdict} (the slope's CI excludes 0; {order.get('reason', 'order not tested')})"
    return f"load {flat['load']}: {head} — {tested}; {spread}"


def host_line(run: dict[str, Any]) -> str:
    """Where and under what load the run was measured (``run.json``'s host facts)."""
    host = run.get("host")
    if not host:
        return "host: not recorded (a run by an older fp4forge): CPU, cores and load are unknown"
    gpus = host.get("gpus")
    gpu_text = "GPU unknown (no nvidia-smi)" if gpus is None else ("no GPU" if not gpus else "GPU " + ", ".join(gpus))
    load = [("before", host.get("load_before")), ("after", host.get("load_after"))]
    load_text = ", ".join(f"{v[0]:.2f} {k}" for k, v in load if v) or "unknown"
    text = (f"host: {host.get('cpu_model') or 'CPU model unknown'}, {host.get('cores_usable')} of {host.get('cores_logical')} "
            f"cores usable, {gpu_text}; 1-minute load average {load_text}")
    return text + server_warnings_text(host.get("server_warnings"))


def server_warnings_text(block: dict[str, Any] | None) -> str:
    if not block:
        return "; the server's log was not given: its warnings are not recorded"
    if block.get("error"):
        return f"; the server's log could not be read ({block['error']})"
    during = block["during_run"]
    text = f"; the server logged {block['before_run']['count']} warnings before the run and {during['count']} during it"
    return text + (": " + " | ".join(during["messages"][:3]) if during["messages"] else "")


def order_lines(summary: dict[str, Any]) -> list[str]:
    """How the requests were ordered, and whether trend claims could be tested against time."""
    run = summary.get("run") or {}
    order = run.get("order") or {}
    rounds = f"{order['repeats']} rounds over the shapes, each in a random order (seed {order['order_seed']})" if order else "order not recorded"
    lines = []
    for entry in summary.get("order", []):
        r = entry["order_correlation"]
        lines.append(f"load {entry['load']}: send order: {rounds}; r = " + ("–" if r is None else f"{r:+.2f}")
                     + f" between a request's position and its prompt length (a trend claim needs |r| < "
                       f"{stats.ORDER_CORRELATION_LIMIT} and the trend in both halves of the run)")
    return lines


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
    lines += order_lines(summary) + [host_line(summary.get("run") or {})]
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
