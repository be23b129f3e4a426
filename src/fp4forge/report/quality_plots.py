"""Plots of quality documents (PNG): ``category_scores.png`` (score per category per arm, bars =
mean over runs, whiskers = min-max over runs: the within-arm noise band) and
``divergence_histogram.png`` (first divergent token of greedy replicates).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fp4forge.report.plotting import pyplot

CATEGORY_PLOT = "category_scores.png"
DIVERGENCE_PLOT = "divergence_histogram.png"


def plot_category_scores(doc: dict[str, Any], path: Path) -> bool:
    """Per category, each arm's mean fraction of points, whiskers spanning its runs (the noise band)."""
    plt = pyplot()
    if plt is None:
        return False
    rows = list(doc["categories"].items())
    path.parent.mkdir(parents=True, exist_ok=True)
    figure, axis = plt.subplots(figsize=(max(8.0, 0.6 * len(rows) + 2), 4.8))
    width = 0.38
    for offset, arm, colour in ((-width / 2, "a", "tab:blue"), (width / 2, "b", "tab:orange")):
        means, lows, highs = [], [], []
        for _, row in rows:
            scale = row["max"] or 1
            runs = [value / scale for value in row[arm]]
            mean = row[f"mean_{arm}"] / scale
            means.append(mean)
            lows.append(mean - min(runs))
            highs.append(max(runs) - mean)
        label = f"{arm.upper()} ({doc['arms'][arm.upper()]['label']}, {doc['runs'][arm.upper()]} run(s))"
        axis.bar([i + offset for i in range(len(rows))], means, width, yerr=[lows, highs], capsize=3, color=colour, alpha=0.85, label=label)
    axis.set_xticks(range(len(rows)), [name for name, _ in rows], rotation=40, ha="right", fontsize=8)
    axis.set_ylim(0, 1.05)
    axis.set_ylabel("earned / max")
    axis.set_title(f"Score per category (whiskers: min–max over an arm's runs). {doc['verdict']['label']}", fontsize=9)
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True


def plot_divergence_histogram(doc: dict[str, Any], path: Path) -> bool:
    """First position where a greedy replicate leaves the first replicate's tokens; 'never' last."""
    plt = pyplot()
    if plt is None:
        return False
    greedy = doc["greedy"]
    histogram = {int(k): v for k, v in greedy["first_divergence_histogram"].items()}
    never = greedy["replicate_pairs"] - greedy["diverged"]
    positions = list(range(doc["max_tokens"]))
    path.parent.mkdir(parents=True, exist_ok=True)
    figure, axis = plt.subplots(figsize=(8.0, 3.8))
    axis.bar(positions, [histogram.get(p, 0) for p in positions], color="tab:red", label="diverged at this token")
    axis.bar([len(positions) + 1], [never], color="tab:green", label="never diverged")
    axis.set_xlabel(f"first divergent generated token (the bar at {len(positions) + 1}: identical through {doc['max_tokens']} tokens)")
    axis.set_ylabel("replicates")
    stable = doc["teacher_forced"]["bitwise_stable_fraction"]
    stable_text = "–" if stable is None else f"{stable:.1%}"
    axis.set_title(f"Greedy replicates vs the first ({doc['replicates']} per prompt, {doc['sequences']} prompts); "
                   f"teacher-forced bitwise-stable positions {stable_text}", fontsize=9)
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True
