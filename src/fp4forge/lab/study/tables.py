"""Tables, plots and the Markdown report of the quantization study (docs/study.md).

Input is the JSON the library writes (``FrontierResult.to_json()``, the study's ``study.json``),
so a saved run renders again without re-measuring.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.table import Table

from fp4forge.report.markdown import table as md_table, table_with_notes
from fp4forge.report.tables import rows_table
from fp4forge.report.plotting import plain_log_scale, save_figure


def _group(arm: dict[str, Any]) -> str:
    group = arm["group_size"]
    return "row" if group is None else ("tensor" if group == 0 else str(group))


# -- frontier ---------------------------------------------------------------------------------------
def frontier_rows(data: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    headers = ["component", "format", "bits", "group", "method", "bpp", "rel. error"]
    rows = [[a["component"], a["format"] + ("" if a.get("symmetric", True) else " asym"), str(a["bits"]), _group(a), a["method"],
             f"{a['bpp']:.3f}", f"{100 * a['rel_error']:.2f} %"] for a in data["arms"]]
    return headers, rows


def frontier_rich(data: dict[str, Any]) -> Table:
    headers, rows = frontier_rows(data)
    return rows_table(f"Compression frontier — {data['source']} (relative Frobenius weight error per component)", headers, rows, 5)


def frontier_markdown(data: dict[str, Any]) -> str:
    headers, rows = frontier_rows(data)
    return table_with_notes(headers, rows, [f"{s['component']} {s['arm']}: {s['reason']}" for s in data.get("skipped", [])])


def pareto(points: list[tuple[float, float, Any]]) -> list[tuple[float, float, Any]]:
    """The points no other point beats on both bits and error, by increasing bits."""
    front, best = [], float("inf")
    for bpp, err, item in sorted(points, key=lambda p: (p[0], p[1])):
        if err < best:
            front.append((bpp, err, item))
            best = err
    return front


def frontier_plot(data: dict[str, Any], path: Path, plt: Any) -> Path | None:
    """Relative weight error against bits per parameter, one panel per component, one marker per
    format, filled for searched scales (mse / four_over_six), the Pareto front as a line."""
    if plt is None or not data["arms"]:
        return None
    components = list(dict.fromkeys(a["component"] for a in data["arms"]))
    cols = min(3, len(components))
    rows = -(-len(components) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.8 * rows), squeeze=False)
    markers = {"nvfp4": "o", "mxfp4": "s", "fp8": "D", "int8": "^", "int4": "v", "int3": "<", "int2": ">"}
    for ax, component in zip(axes.flat, components):
        arms = [a for a in data["arms"] if a["component"] == component]
        for fmt in dict.fromkeys(a["format"] for a in arms):
            for searched in (False, True):
                pts = [(a["bpp"], 100 * a["rel_error"]) for a in arms if a["format"] == fmt and (a["method"] != "minmax") == searched]
                if pts:
                    x, y = zip(*pts)
                    ax.scatter(x, y, marker=markers.get(fmt, "x"), facecolors=None if searched else "none",
                               edgecolors="C%d" % list(markers).index(fmt) if fmt in markers else "k",
                               color="C%d" % list(markers).index(fmt) if fmt in markers else "k",
                               label=f"{fmt} {'searched' if searched else 'min-max'}", s=22)
        front = pareto([(a["bpp"], 100 * a["rel_error"], a) for a in arms])
        ax.plot([p[0] for p in front], [p[1] for p in front], color="grey", linewidth=0.8, zorder=0)
        plain_log_scale(ax)
        ax.set_title(component, fontsize=10)
        ax.set_xlabel("bits per parameter (scales included)")
        ax.set_ylabel("relative weight error (%)")
    for ax in list(axes.flat)[len(components):]:
        ax.set_visible(False)
    axes.flat[0].legend(fontsize=6, ncol=2)
    fig.suptitle(f"Compression frontier — {Path(str(data['source'])).name}\nhollow: min-max; filled: searched scales; line: Pareto front", fontsize=9)
    return save_figure(fig, path, plt)


# -- whole-model arms -------------------------------------------------------------------------------
def _ci(value: dict[str, Any]) -> str:
    lo, hi = value["ci95"]
    return f"{value['mean']:.4g} [{lo:.4g}, {hi:.4g}]"


def arms_rows(arms: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    headers = ["arm", "what", "bpp (quantized Linears)", "KL vs BF16 (mean, 95 % CI)", "top-1 agreement", "student ppl", "teacher ppl"]
    rows = []
    for arm in sorted(arms, key=lambda a: a["kl"]["mean"]):
        rows.append([arm["name"], arm["description"], f"{arm['bpp']:.2f}" if arm.get("bpp") is not None else "—", _ci(arm["kl"]),
                     f"{100 * arm['top1_agreement']:.1f} %", f"{arm['perplexity']['student']:.3f}", f"{arm['perplexity']['teacher']:.3f}"])
    return headers, rows


def arms_rich(arms: list[dict[str, Any]], title: str) -> Table:
    headers, rows = arms_rows(arms)
    t = Table(title=title)
    for i, h in enumerate(headers):
        t.add_column(h, justify="left" if i < 2 else "right")
    for row in rows:
        t.add_row(*row)
    return t


def arms_plot(arms: list[dict[str, Any]], path: Path, plt: Any) -> Path | None:
    """KL against bits per parameter with 95 % CIs, one point per whole-model arm."""
    usable = [a for a in arms if a.get("bpp") is not None]
    if plt is None or not usable:
        return None
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for arm in usable:
        lo, hi = arm["kl"]["ci95"]
        mean = arm["kl"]["mean"]
        ax.errorbar([arm["bpp"]], [mean], yerr=[[mean - lo], [hi - mean]], fmt="o", capsize=3)
        ax.annotate(arm["name"], (arm["bpp"], mean), textcoords="offset points", xytext=(5, 4), fontsize=7)
    plain_log_scale(ax)
    ax.set_xlabel("bits per parameter of the quantized Linears")
    ax.set_ylabel("KL(teacher || student) per token, nats")
    ax.set_title("Whole-model arms: KL against the BF16 teacher (95 % CI over samples)")
    return save_figure(fig, path, plt)


# -- the report -------------------------------------------------------------------------------------
def study_markdown(study: dict[str, Any]) -> str:
    """The study's Markdown report: only measured numbers; every part not measured is named."""
    lines = [f"# Quantization study — {study['source']}", ""]
    lines += [f"fp4forge {study['fp4forge_version']}, {study['finished_at']}. Every number below was measured by this run; parts that did not run are "
              "listed under *Not run* with the reason.", ""]
    frontier = study.get("frontier")
    if frontier:
        lines += ["## Compression frontier", "",
                  "Relative Frobenius error of the dequantized weights over each component (a fraction of the weights' norm), "
                  "against the bits each weight takes on disk with its scales.", ""]
        if study.get("plots", {}).get("frontier"):
            lines += [f"![frontier]({study['plots']['frontier']})", ""]
        summary = study.get("frontier_summary") or []
        if summary:
            lines += md_table(["component", "arm", "bpp", "rel. error"],
                              [[s["component"], s["arm"], f"{s['bpp']:.3f}", f"{100 * s['rel_error']:.2f} %"] for s in summary])
            lines.append("")
        lines += ["<details><summary>every frontier arm</summary>", "", frontier_markdown(frontier), "</details>", ""]
    arms = study.get("arms") or []
    if arms:
        lines += ["## Whole-model arms (fidelity against the BF16 teacher)", "",
                  f"{study['fidelity']['samples']} samples × {study['fidelity']['seq_len']} tokens, KL per predicted token; the 95 % "
                  "interval is a percentile bootstrap over samples. Ordered by KL.", ""]
        if study.get("plots", {}).get("arms"):
            lines += [f"![arms]({study['plots']['arms']})", ""]
        headers, rows = arms_rows(arms)
        lines += md_table(headers, rows)
        lines.append("")
        for comparison in study.get("comparisons", []):
            lines.append(f"- {comparison}")
        if study.get("comparisons"):
            lines.append("")
    for section in study.get("sections", []):
        lines += [f"## {section['title']}", "", section["markdown"].rstrip(), ""]
    lines += ["## Not run", ""]
    not_run = study.get("not_run") or []
    lines += [f"- **{n['part']}**: {n['reason']}" for n in not_run] if not_run else ["Every part ran."]
    return "\n".join(lines) + "\n"
