"""Markdown building blocks shared by the reports and the model card."""

from __future__ import annotations


def table(headers: list[str], rows: list[list[str]]) -> list[str]:
    """A GitHub-flavoured Markdown table, one string per line."""
    return ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers), *("| " + " | ".join(row) + " |" for row in rows)]
