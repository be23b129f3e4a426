"""Presentation: rich tables for people, Markdown for model cards. No computation here."""

from __future__ import annotations

from typing import Any

from rich.cells import cell_len
from rich.table import Table
from rich.text import Text

from fp4forge.audit.byte_table import ByteTable


def _plain(cell: Any) -> str:
    return cell.plain if isinstance(cell, Text) else str(cell)


def fit_table(table: Table, console: Any) -> Table | Text:
    """``table`` as ``console`` can show it with its first column (the names) whole: names are
    never cut with an ellipsis, the other columns' headers wrap instead; when even that does not fit
    the width (80 columns in a CI log or a pipe), one plain block per row: the name on its own line,
    then "header: value" for the other non-empty cells."""
    names = table.columns[0]
    names.no_wrap, names.overflow = True, "ignore"
    names.min_width = max((cell_len(_plain(c)) for c in names._cells), default=0)
    for column in table.columns[1:]:  # wrapped at spaces, never cut: at least the longest word wide
        words = [w for cell in (column.header, *column._cells) for w in _plain(cell).split()]
        column.min_width = max(map(cell_len, words), default=0)
    # each column: its minimum, one space of padding either side and a rule between columns
    if sum(c.min_width + 3 for c in table.columns) + 1 <= console.width:
        return table
    headers = [_plain(c.header) for c in table.columns]
    lines = Text(_plain(table.title) + "\n" if table.title else "")
    for row in zip(*(c._cells for c in table.columns)):
        lines.append(_plain(row[0]) + "\n", style="bold")
        details = [f"{h}: {_plain(c)}" for h, c in zip(headers[1:], row[1:]) if _plain(c)]
        lines.append(("    " + ", ".join(details) + "\n") if details else "")
    if table.caption:
        lines.append(_plain(table.caption) + "\n")
    lines.rstrip()
    return lines


def rows_table(title: str, headers: list[str], rows: list[list[str]], left_columns: int = 1) -> Table:
    """A rich table of text rows: the first ``left_columns`` columns (names) left, numbers right."""
    t = Table(title=title)
    for i, h in enumerate(headers):
        t.add_column(h, justify="left" if i < left_columns else "right")
    for row in rows:
        t.add_row(*row)
    return t


def _fmt_bpp(bpp: float | None) -> str:
    return "—" if bpp is None else f"{bpp:.2f}"



def byte_table_rows(table: ByteTable) -> list[list[str]]:
    rows = []
    for c in table.components:
        rows.append([c.name, f"{c.tensors:,}", f"{c.bytes:,}", f"{c.params:,}", _fmt_bpp(c.bpp), f"{c.share * 100:.1f} %"])
    rows.append(["total", f"{sum(c.tensors for c in table.components):,}", f"{table.total_bytes:,}", f"{table.total_params:,}", _fmt_bpp(table.bpp), "100.0 %"])
    return rows


HEADERS = ["component", "tensors", "bytes", "params", "bits/param", "share of bytes"]


def byte_table_rich(table: ByteTable) -> list[Table]:
    layout = f"layout {table.layout}" + (", inferred from tensor names: no table for this architecture" if table.layout_inferred else "")
    main = Table(title=f"Where the bytes are — {table.checkpoint} ({layout})")
    for i, h in enumerate(HEADERS):
        main.add_column(h, justify="left" if i == 0 else "right")
    rows = byte_table_rows(table)
    for row in rows[:-1]:
        main.add_row(*row)
    main.add_row(*rows[-1], style="bold")
    dtypes = Table(title="By dtype")
    for h in ("dtype", "tensors", "bytes"):
        dtypes.add_column(h, justify="left" if h == "dtype" else "right")
    for dtype, entry in table.dtypes.items():
        dtypes.add_row(dtype, f"{entry['tensors']:,}", f"{entry['bytes']:,}")
    return [main, dtypes]


def byte_table_markdown(table: ByteTable) -> str:
    lines = ["| " + " | ".join(HEADERS) + " |", "|" + "---|" * len(HEADERS)]
    for row in byte_table_rows(table):
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", "| dtype | tensors | bytes |", "|---|---|---|"]
    for dtype, entry in table.dtypes.items():
        lines.append(f"| {dtype} | {entry['tensors']:,} | {entry['bytes']:,} |")
    if table.not_understood:
        lines += ["", f"Headline: **not understood** ({table.not_understood}); the params column counts stored elements."]
    else:
        lines += ["", f"Headline: **{_fmt_bpp(table.bpp)} bits per parameter**"
                  + (f"; routed experts alone: **{_fmt_bpp(table.experts_bpp)}**." if table.experts_bpp is not None else ".")]
    if table.layout_inferred:
        lines += ["", f"Components inferred from tensor names ({table.layout}): no layout table for this architecture."]
    return "\n".join(lines) + "\n"


def quantize_summary_rich(summary) -> Table:
    table = Table(title=f"quantized -> {summary.output} ({summary.layout_format}, recipe {summary.recipe})")
    for h in ("component:scheme", "linears", "mean rel. error", "max rel. error"):
        table.add_column(h, justify="left" if h.startswith("component") else "right")
    for key, entry in (summary.weight_error.get("by_component") or {}).items():
        table.add_row(key, f"{entry['linears']:,}", f"{entry['mean']:.4f}", f"{entry['max']:.4f}")
    table.caption = (
        f"{summary.tensors_written:,} tensors, {summary.bytes_written / 2**20:,.1f} MiB written, "
        f"{summary.bytes_read / 1e9:.3f} GB read in {summary.seconds:.1f} s ({summary.read_gb_per_s:.3f} GB/s)"
        + (f"; resumed after {summary.resumed_units} finished units" if summary.resumed_units else "")
        + (f"; NVFP4 element kernel: {summary.element_kernel}" if getattr(summary, "element_kernel", "") else "")
    )
    return table
