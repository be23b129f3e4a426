"""Markdown building blocks shared by the reports and the model card."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any


def table(headers: list[str], rows: list[list[str]]) -> list[str]:
    """A GitHub-flavoured Markdown table, one string per line."""
    return ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers), *("| " + " | ".join(row) + " |" for row in rows)]


def table_with_notes(headers: list[str], rows: list[list[str]], notes: list[str]) -> str:
    """A Markdown table, then one ``- not run: …`` line per note, as one text."""
    lines = table(headers, rows)
    if notes:
        lines += ["", *(f"- not run: {note}" for note in notes)]
    return "\n".join(lines) + "\n"


def interval_bounds(interval: Mapping[str, Any] | None) -> tuple[float, float, float] | None:
    """``(low, high, level)`` of a stored interval (``{"low", "high", "level"}``, fidelity's
    ``metrics["intervals"]`` entries), None when it is absent or unreadable."""
    try:
        return float(interval["low"]), float(interval["high"]), float(interval.get("level", 0.95))  # type: ignore[index,union-attr]
    except (KeyError, TypeError, ValueError, AttributeError):
        return None


def interval_text(interval: Mapping[str, Any] | None, fmt: Callable[[float], str], *, cell: bool = False) -> str:
    """A stored interval, each bound by ``fmt``: ``[low, high]`` after a number in running text
    (empty when there is none), ``low – high`` as a table cell of its own (``–`` when none)."""
    bounds = interval_bounds(interval)
    if bounds is None:
        return "–" if cell else ""
    low, high = fmt(bounds[0]), fmt(bounds[1])
    return f"{low} – {high}" if cell else f"[{low}, {high}]"
