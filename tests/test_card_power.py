"""The card carries what the quality comparison could have detected (docs/quality.md#power):
the floor's status, the fewest one-way discordant scenarios, the floor effect, the descriptive
categories and the flip list; "cannot order" lands among the non-claims, never as "no
regression". The oracle is the comparison document, read here with ``json``.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest

from fp4forge.quality.stats import compare_arms
from fp4forge.report.card import render_card

FIXTURE = Path(__file__).parent / "fixtures" / "card" / "ckpt"
COMPARE = "reports/quality-teacher/compare.json"


@pytest.fixture()
def ckpt(tmp_path: Path) -> Path:
    copy = tmp_path / "tiny-laguna-nvfp4"
    shutil.copytree(FIXTURE, copy)
    return copy


def quality_text(ckpt: Path) -> tuple[str, str]:
    markdown = render_card(ckpt).markdown
    parts = dict(zip(*[iter(re.split(r"^## (.+)$", markdown, flags=re.M)[1:])] * 2))
    return parts["Quality"], parts["What this card does not claim"]


def test_the_fixture_comparison_states_its_power_on_the_card(ckpt: Path) -> None:
    doc = json.loads((ckpt / COMPARE).read_text())
    power = doc["power"]
    text, non_claims = quality_text(ckpt)
    paired = text.split("### Against the BF16 teacher (paired)")[1]
    assert power["floor"]["measured"] is False  # the fixture's runs are greedy, twice
    assert f"A/A {power['floor']['why']}." in paired and "greedy is deterministic" in paired
    assert f"at least {power['min_discordant']} scenarios that differ all one way" in paired
    assert power["floor_effect"] and power["floor_effect"] in paired
    assert "Per category (descriptive)" in paired
    assert "Flip list: none" in paired
    rows = [line.split("|")[1:-1] for line in paired.split("Per category (descriptive)")[1].split("\n\n")[1].splitlines()]
    assert rows[0][-1].strip() == "within noise" and len(rows) == len(doc["categories"]) + 2
    assert all(row[-1].strip() == "–" for row in rows[2:])  # greedy twice: no category is called within or outside noise
    assert "greedy is deterministic" in non_claims
    assert f"The paired quality comparison (no difference) is not evidence of no regression: {power['text']}." in non_claims


def plant_comparison(ckpt: Path, **compare: Any) -> dict[str, Any]:
    """Replace the fixture's statistics with a comparison the stats module computes from runs."""
    doc = json.loads((ckpt / COMPARE).read_text())
    doc.update(compare_arms(**compare))
    (ckpt / COMPARE).write_text(json.dumps(doc))
    return doc


def test_cannot_order_names_what_the_suite_could_have_detected(ckpt: Path) -> None:
    categories = {f"s{i}": "alpha" for i in range(40)}
    a = {sid: (1, 2) for sid in categories}
    b = {**a, "s1": (2, 2), "s2": (2, 2), "s3": (0, 2)}  # 3 discordant: 2 favour B, 1 favours A
    sampled = [{"temperature": 0.7, "seed": 0}, {"temperature": 0.7, "seed": 1}]
    doc = plant_comparison(ckpt, runs_a=[a, a], runs_b=[b, b], categories=categories, n_boot=500,
                           requests={"A": sampled, "B": sampled})
    text, non_claims = quality_text(ckpt)
    assert doc["verdict"]["label"] == "cannot order the arms"
    assert "The paired quality comparison (cannot order the arms) is not evidence of no regression" in non_claims
    detectable = doc["power"]["detectable"]
    assert f"{detectable['one_way_share']:.1%} of scenarios" in text
    assert f"(with the observed 1 the other way: {doc['power']['min_discordant_given_minority']['majority']})" in text
    flips = re.search(r"Flip list \((\d+) scenarios", text)
    assert flips and int(flips[1]) == doc["discordant"] == 3
    assert all(f"`{f['id']}` ({f['category']}, favours {f['favours']}" in text for f in doc["flips"])
    at_observed = {row["q"]: row["power"] for row in doc["power"]["power_at_observed"]}
    assert f"{at_observed[1.0]:.2f} when 100% of discordant scenarios favour one arm" in text
    # the band the difference of means was held against: 0 points between A's runs, x sqrt((1/2 + 1/2) / 2)
    assert "A/A band: 0.0 points: the largest difference between two single runs of one arm (0) × 0.707 for the " \
           "difference of the means of 2 and 2 sampled runs." in text


def test_a_comparison_without_a_power_statement_says_so(ckpt: Path) -> None:
    doc = json.loads((ckpt / COMPARE).read_text())
    del doc["power"]
    (ckpt / COMPARE).write_text(json.dumps(doc))
    text, _ = quality_text(ckpt)
    assert "states no power" in text
