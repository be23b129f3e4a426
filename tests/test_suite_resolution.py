"""The resolution probe's own logic (its GPU run is a measurement, not a test): its minimum
detectable effect against a hand computation, and its job pool's order, failures and budget."""

from __future__ import annotations

import math
from pathlib import Path
from statistics import NormalDist

from fp4forge.lab.diagnostics.suite_resolution import Job, run_jobs
from fp4forge.lab.diagnostics.suite_resolution_report import noise_only_mde


def _run(points: list[tuple[int, int]]) -> dict:
    return {"max": sum(m for _, m in points), "scenarios": [{"id": f"s{i}", "earned": e, "max": m} for i, (e, m) in enumerate(points)]}


def test_minimum_detectable_effect_from_the_sampling_noise() -> None:
    runs = [_run([(1, 2), (3, 3), (0, 4)]), _run([(2, 2), (3, 3), (2, 4)]), _run([(0, 2), (3, 3), (1, 4)])]
    # per-scenario score variances (ddof 1) over the three runs, by hand: 1/4, 0, 1/16
    var = (0.25 + 0.0 + 0.0625) / 3
    sd = math.sqrt(2 * var / 3)
    mde = (NormalDist().inv_cdf(0.975) + NormalDist().inv_cdf(0.8)) * sd / math.sqrt(3)
    found = noise_only_mde(runs)
    assert found is not None and math.isclose(found["sd_diff"], sd) and math.isclose(found["mean_fraction"], mde)
    assert math.isclose(found["points_of_max"], mde * 9) and found["smallest_significant_discordance"] == 6
    still = noise_only_mde([runs[0], runs[0]])
    assert still is not None and still["mean_fraction"] is None  # no run moved: nothing to scale
    assert noise_only_mde(runs[:1]) is None


def echo(value: int) -> dict:
    return {"value": value}


def fail() -> dict:
    raise ValueError("planted")


def test_the_pool_runs_what_it_can_and_names_what_it_did_not(tmp_path: Path) -> None:
    saved = []
    jobs = [
        Job("a", echo, lambda done: (1,)),
        Job("b", fail, lambda done: ()),
        Job("c", echo, lambda done: (done["a"]["value"] + 1,), deps=("a",), round=1),
        Job("d", echo, lambda done: (0,), deps=("b",), round=1),
    ]
    notes = run_jobs(jobs, workers=2, budget_s=600, log=lambda line: None, on_finish=lambda: saved.append(1))
    by_name = {j.name: j for j in jobs}
    assert by_name["c"].result == {"value": 2}  # its arguments come from the job it needs
    assert by_name["b"].error.startswith("ValueError: planted") and by_name["d"].result is None
    assert any(n.startswith("d: not run: a job it needs failed") for n in notes) and any(n.startswith("b: ValueError") for n in notes)
    assert len(saved) == 3  # after every finished job
    late = [Job("e", echo, lambda done: (0,))]
    assert run_jobs(late, workers=1, budget_s=-1, log=lambda line: None, on_finish=lambda: None) == ["e: not started within the budget of 0.0 min"]
