"""The card and the bench plots print the same statistics: every number in a plot's legend is
in the card's Performance section, and every R² the card states is drawn (a fit printed in
the text is the fit on the plot, docs/bench.md#fits). The plots' legends are read from the
figures the plot functions return; the card text from ``render_card``.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fp4forge.bench.analyze import analyze_dir
from fp4forge.report import bench_plots
from fp4forge.report.card import render_card

CARD_FIXTURE = Path(__file__).parent / "fixtures" / "card" / "ckpt"
REAL_RUN = Path(__file__).parent / "fixtures" / "bench_cpu_run"
NUMBER = re.compile(r"[-+]?\d[\d,]*(?:\.\d+)?")
R2 = re.compile(r"R² (\d\.\d+)")
LADDER = (100, 1000, 2000, 4000)


def curved_run() -> list[dict[str, Any]]:
    """TTFT curved in context, decode falling with it, shapes in random rounds."""
    rng = np.random.default_rng(4)
    order = [LADDER[i] for _ in range(6) for i in rng.permutation(len(LADDER))]
    samples = []
    for seq, tokens in enumerate(order):
        ttft = 0.05 + tokens / 4000 + 2e-7 * tokens * tokens + rng.normal(0, 0.002)
        decode = 30.0 - 0.002 * tokens + rng.normal(0, 0.1)
        samples.append({"seq": seq, "shape": f"p{tokens}-o32", "load": "c1", "prompt_tokens": tokens, "output_tokens": 32,
                        "ttft_s": ttft, "decode_tok_s": decode, "e2e_s": ttft + 32 / decode, "ok": True, "warmup": False})
    return samples


def legends_and_card(tmp_path: Path, samples_jsonl: str, monkeypatch: pytest.MonkeyPatch) -> tuple[list[str], str, str]:
    pytest.importorskip("matplotlib")
    ckpt = tmp_path / "ckpt"
    shutil.copytree(CARD_FIXTURE, ckpt)
    bench = ckpt / "reports" / "bench"
    shutil.rmtree(bench)
    bench.mkdir()
    (bench / "samples.jsonl").write_text(samples_jsonl)
    labels: list[str] = []

    def spy(draw: Any) -> Any:
        def drawn(plt: Any, cells: Any, summary: Any) -> Any:
            figure = draw(plt, cells, summary)
            for axis in figure.axes if figure is not None else []:
                legend = axis.get_legend()
                labels.extend(t.get_text() for t in (legend.get_texts() if legend else []))
                labels.extend(t.get_text() for t in axis.texts)  # annotations (mode shares)
            return figure
        return drawn

    for name in ("_plot_ttft_distribution", "_plot_ttft_vs_prompt", "_plot_decode_vs_context"):
        monkeypatch.setattr(bench_plots, name, spy(getattr(bench_plots, name)))
    summary = analyze_dir(bench, presenter=bench_plots.BENCH_PRESENTER)
    assert summary["plots"] and labels
    parts = re.split(r"^## ", render_card(ckpt).markdown, flags=re.M)
    section = {part.split("\n", 1)[0]: part for part in parts}
    return labels, section["Performance"], section["What this card does not claim"]


@pytest.mark.parametrize("run", ["real", "curved"])
def test_every_number_in_the_plots_is_on_the_card(run: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    text = (REAL_RUN / "samples.jsonl").read_text() if run == "real" else "".join(json.dumps(s) + "\n" for s in curved_run())
    labels, card, non_claims = legends_and_card(tmp_path, text, monkeypatch)
    for label in labels:
        for number in NUMBER.findall(label.split(":", 1)[1] if label.startswith("c1:") else label):
            assert number in card, f"{number!r} of the plot's {label!r} is not on the card"
    plotted = {value for label in labels for value in R2.findall(label)}
    stated = set(R2.findall(card))
    assert plotted and plotted == stated  # each R² the card states is a fit drawn with that number
    assert "host: not recorded" in card and "speed was measured on (CPU, cores, load) was not recorded" in non_claims
    trend_withheld = "No speed trend across context is claimed" in non_claims
    if run == "curved":  # random rounds: the trends stand
        assert any("quadratic (curved)" in label for label in labels) and "TTFT is curved" in card
        assert any("falls with context" in label for label in labels)
        assert not trend_withheld
    else:  # the real run went shortest prompt first
        assert trend_withheld and "r = +0.98" in card
