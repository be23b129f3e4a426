"""Plots readable at a glance: log axes labelled with plain numbers (never ``6×10⁰``), and the
bytes plot's right-hand labels inside the figure. Read back from matplotlib's own drawn figure."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from fp4forge.report import card
from fp4forge.report.plotting import pyplot
from fp4forge.lab.study.tables import frontier_plot

PLAIN_NUMBER = re.compile(r"^\d+(\.\d+)?$")


class KeepFigures:
    """pyplot, except that closed figures are kept for inspection."""

    def __init__(self) -> None:
        self.plt, self.figures = pyplot(), []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.plt, name)

    def close(self, figure: Any) -> None:
        self.figures.append(figure)


def _arm(component: str, fmt: str, bpp: float, rel: float) -> dict[str, Any]:
    return {"component": component, "format": fmt, "bits": 4, "group_size": 16, "method": "minmax", "symmetric": True, "bpp": bpp, "rel_error": rel}


def test_frontier_ticks_are_plain_percentages(tmp_path: Path) -> None:
    keep = KeepFigures()
    # errors of 5.5 % to 9.5 %: less than a decade, where matplotlib's default writes 6×10⁰
    arms = [_arm("attention", "nvfp4", 4.5, 0.095), _arm("attention", "int4", 4.25, 0.07), _arm("attention", "fp8", 8.25, 0.055)]
    assert frontier_plot({"source": "x", "arms": arms}, tmp_path / "f.png", keep) is not None
    (figure,) = keep.figures
    figure.canvas.draw()
    axis = figure.axes[0]
    labels = [t.get_text() for t in axis.get_yticklabels(minor=True) + axis.get_yticklabels() if t.get_text()]
    visible = [t.get_text() for t in axis.get_yticklabels(minor=True) if t.get_text() and axis.get_ylim()[0] <= t.get_position()[1] <= axis.get_ylim()[1]]
    assert len(visible) >= 2, labels
    assert all(PLAIN_NUMBER.match(label) for label in labels), labels


def test_bytes_plot_labels_stay_inside_the_axes(tmp_path: Path, monkeypatch) -> None:
    keep = KeepFigures()
    monkeypatch.setattr(card, "pyplot", lambda: keep)
    components = [{"name": "routed_experts", "bytes": 70, "share": 0.7, "bpp": 4.5}, {"name": "lm_head", "bytes": 30, "share": 0.3, "bpp": 16.0}]
    assert card._plot_bytes({"components": components, "total": {"bpp": 6.2}}, tmp_path / "b.png") is not None
    (figure,) = keep.figures
    renderer = figure.canvas.get_renderer()
    figure.canvas.draw()
    axes_box = figure.axes[0].get_window_extent(renderer)
    for text in figure.axes[0].texts:
        assert text.get_window_extent(renderer).x1 <= axes_box.x1, f"label {text.get_text()!r} runs past the axes"
