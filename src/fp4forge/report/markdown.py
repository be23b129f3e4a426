"""Markdown building blocks shared by the reports and the model card."""

from __future__ import annotations


def table(headers: list[str], rows: list[list[str]]) -> list[str]:
    """A GitHub-flavoured Markdown table, one string per line."""
    return ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers), *("| " + " | ".join(row) + " |" for row in rows)]


def table_with_notes(headers: list[str], rows: list[list[str]], notes: list[str]) -> str:
    """A Markdown table, then one ``- not run: …`` line per note, as one text."""
    lines = table(headers, rows)
    if notes:
        lines += ["", *(f"- not run: {note}" for note in notes)]
    return "\n".join(lines) + "\n"
