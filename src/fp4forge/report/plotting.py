"""matplotlib for files, not screens: every layer that draws PNGs gets pyplot from here."""

from __future__ import annotations

from typing import Any


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend, or None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def save_figure(fig: Any, path: Any, plt: Any) -> Any:
    """Lay the figure out, write it as a PNG at ``path`` (its folder made) and free it."""
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plain_log_scale(axis: Any) -> None:
    """A log-scale y axis whose tick labels are plain numbers (``6``, ``0.2``, ``20``), never
    ``6×10⁰``: matplotlib still chooses which ticks get a label, only the text changes."""
    from matplotlib.ticker import LogFormatter

    class PlainLogFormatter(LogFormatter):
        def __call__(self, x: float, pos: int | None = None) -> str:
            return f"{x:g}" if super().__call__(x, pos) else ""

    axis.set_yscale("log")
    axis.yaxis.set_major_formatter(PlainLogFormatter())
    axis.yaxis.set_minor_formatter(PlainLogFormatter(labelOnlyBase=False))
