"""Presentation: rich tables for people, Markdown for model cards. No computation here."""

from __future__ import annotations

from rich.table import Table

from fp4forge.audit.byte_table import ByteTable



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
