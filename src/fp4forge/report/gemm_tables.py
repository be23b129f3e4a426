"""Presentation of the GEMM microbench (``fp4forge bench gemm``): tables and a plot, from its JSON."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.table import Table

from fp4forge.report.markdown import table_with_notes
from fp4forge.report.tables import rows_table
from fp4forge.report.plotting import plain_log_scale, save_figure

SUMMARY_M = (1, 16, 128, 1024, 8192)


def _index(data: dict[str, Any]) -> dict[tuple[str, int], dict[str, dict[str, Any]]]:
    by: dict[tuple[str, int], dict[str, dict[str, Any]]] = {}
    for r in data["results"]:
        by.setdefault((r["shape"], r["m"]), {})[r["kernel"]] = r
    return by


def gemm_rows(data: dict[str, Any], m_values: tuple[int, ...] = SUMMARY_M) -> tuple[list[str], list[list[str]]]:
    """One row per (shape, M): bf16 median µs, then each other kernel's median as a ratio to bf16
    (below 1: faster), and each kernel's relative output error against FP32."""
    kernels = [k for k in data["kernels"] if k != "bf16"]
    headers = ["shape", "N×K", "M", "bf16 µs"] + [f"{k} ×bf16" for k in kernels] + ["rel. error " + "/".join(["bf16", *kernels])]
    rows = []
    for (shape, m), cells in _index(data).items():
        if m not in m_values or "bf16" not in cells:
            continue
        base = cells["bf16"]
        ratios = [f"{cells[k]['median_us'] / base['median_us']:.2f}" if k in cells else "—" for k in kernels]
        errs = "/".join(f"{cells[k]['rel_error']:.3f}" for k in ["bf16", *kernels] if k in cells)
        rows.append([shape, f"{base['n']}×{base['k']}", str(m), f"{base['median_us']:.1f}", *ratios, errs])
    return headers, rows


def gemm_rich(data: dict[str, Any]) -> Table:
    headers, rows = gemm_rows(data)
    return rows_table(f"GEMM microbench — {data['device_name']}, torch {data['torch']} (median of samples; ratio < 1 is faster than bf16)", headers, rows)


def gemm_markdown(data: dict[str, Any]) -> str:
    headers, rows = gemm_rows(data)
    return table_with_notes(headers, rows, list(data.get("not_run", [])))


def gemm_plot(data: dict[str, Any], path: Path, plt: Any) -> Path | None:
    """Time per call against M, one panel per shape, one line per kernel, with the 10–90 % band."""
    if plt is None:
        return None
    shapes = list(dict.fromkeys(r["shape"] for r in data["results"]))
    cols = 4
    rows = -(-len(shapes) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3.2 * rows), squeeze=False)
    for ax, shape in zip(axes.flat, shapes):
        for kernel in data["kernels"]:
            pts = sorted((r["m"], r["median_us"], r["p10_us"], r["p90_us"]) for r in data["results"] if r["shape"] == shape and r["kernel"] == kernel)
            if not pts:
                continue
            m, med, lo, hi = zip(*pts)
            ax.plot(m, med, marker=".", label=kernel)
            ax.fill_between(m, lo, hi, alpha=0.2)
        ax.set_xscale("log", base=2)
        plain_log_scale(ax)
        ax.set_title(shape, fontsize=9)
        ax.set_xlabel("M (tokens)")
        ax.set_ylabel("µs per call")
    for ax in list(axes.flat)[len(shapes):]:
        ax.set_visible(False)
    axes.flat[0].legend(fontsize=7)
    fig.suptitle(f"GEMM time per call — {data['device_name']} (log-log; band: 10–90 % of samples)")
    return save_figure(fig, path, plt)
