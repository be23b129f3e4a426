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


def sleep(seconds: float) -> dict:
    import time

    time.sleep(seconds)
    return {}


def test_the_deadline_stops_what_still_runs() -> None:
    import time

    jobs = [Job("quick", echo, lambda done: (1,)), Job("slow", sleep, lambda done: (60,))]
    started = time.monotonic()
    notes = run_jobs(jobs, workers=2, budget_s=600, log=lambda line: None, on_finish=lambda: None, deadline_s=3)
    assert time.monotonic() - started < 30  # not the slow job's 60 s
    assert jobs[0].result == {"value": 1} and jobs[1].result is None
    assert notes == ["slow: stopped at the deadline of 0.1 min"]


def test_a_play_expects_its_own_arm_s_time() -> None:
    from fp4forge.lab.diagnostics.suite_resolution import expected_seconds

    def finished(name: str, seconds: float) -> Job:
        return Job(name, echo, lambda done: (), seconds=seconds)

    done = [finished("play:shipped:bf16:0", 10), finished("play:shipped:bf16:1", 12), finished("play:shipped:fp8:0", 40), finished("train:x", 300)]
    assert expected_seconds(Job("play:shipped:bf16:2", echo, lambda done: ()), done) == 12  # the median of its arm's runs
    assert expected_seconds(Job("play:shipped:w4a4:0", echo, lambda done: ()), done) == 40  # none of its arm yet: the slowest play
    assert expected_seconds(Job("student:x", echo, lambda done: ()), done) == 0


def test_curve_builds_parse_or_name_the_bad_item() -> None:
    import pytest

    from fp4forge.errors import ConfigError
    from fp4forge.lab.diagnostics.suite_resolution import parse_curve

    assert parse_curve("500x1@0, 2000x2@1") == ((500, 1, 0), (2000, 2, 1))
    for bad in ("500x1", "500@0", "0x1@0", "ax1@0"):
        with pytest.raises(ConfigError, match="STEPSxWIDTH@SEED|at least"):
            parse_curve(bad)


def _part(folder: Path, plays: dict[str, list[tuple[int, int]]], extra_jobs: list[dict], temperature: float = 0.7) -> Path:
    """An output folder as a run leaves it: jobs.json and the plays' archive."""
    import json

    from fp4forge.lab.diagnostics.suite_resolution import Job, pack_plays, save_jobs
    from fp4forge.quality.suite import load_suite

    jobs = []
    for name, points in plays.items():
        _, build, arm, seed = name.split(":")
        ids = [scenario.id for scenario in load_suite().scenarios[: len(points)]]  # the verdict reads their categories
        record = {"max": sum(m for _, m in points), "scenarios": [{"id": i, "earned": e, "max": m} for i, (e, m) in zip(ids, points)],
                  "earned": sum(e for e, _ in points), "seed": int(seed), "temperature": temperature, "cut_at_max_tokens": 0}
        path = folder / "work" / build / arm / f"run-{seed}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record))
        jobs.append(Job(name, echo, lambda done: (), result={"path": f"{build}/{arm}/run-{seed}.json"}))
    jobs += [Job(j["name"], echo, lambda done: (), result=j.get("result"), error=j.get("error")) for j in extra_jobs]
    pack_plays(folder / "work", folder / "plays.tar.gz")
    plan = {"temperature": temperature, "max_new_tokens": 8, "limit": 3}
    save_jobs(folder, jobs, {"device": "cpu", "plan": plan, "testbed": {"name": "t", "version": 1, "sha256": "ab" * 32}, "wall_seconds": 60.0})
    return folder


def test_the_report_reads_both_parts_and_refuses_what_cannot_be_compared(tmp_path: Path) -> None:
    import pytest

    from fp4forge.errors import ConfigError
    from fp4forge.lab.diagnostics.suite_resolution_report import write_report

    a = [(1, 2), (3, 3), (0, 4)]
    b = [(2, 2), (3, 3), (0, 4)]
    resolution = _part(tmp_path / "res", {"play:shipped:bf16:0": a, "play:shipped:bf16:1": b, "play:shipped:fp8:0": b},
                       [{"name": "student:shipped:fp8", "result": {"bpp": 8.0, "numerics": "w4a4"}},
                        {"name": "play:shipped:fp8:1", "error": "stopped at the deadline of 7.0 min"}])
    facts = {"steps": 500, "width": 2, "seed": 1, "parameters": 2_000_000, "heldout_perplexity": 1.5, "heldout_assistant_perplexity": 1.4,
             "expert_kurtosis_median": 3.5, "expert_kurtosis_max": 4.0, "expert_max_over_rms_median": 5.0, "train_seconds": 9.0}
    curve = _part(tmp_path / "curve", {"play:s500-w2@1:bf16:0": a, "play:s500-w2@1:int2-g32-mse:0": b}, [{"name": "train:s500-w2@1", "result": facts}])
    doc = write_report(tmp_path / "out", [resolution, curve])
    rows = {r["arm"]: r for r in doc["resolution"]}
    assert rows["bf16"]["points_per_run"] == [4, 5] and rows["fp8"]["points_per_run"] == [5] and rows["fp8"]["bpp"] == 8.0
    assert rows["fp8"]["vs_bf16"]["sign_test"]["favours_b"] == 1  # the first scenario: 2 against BF16's mean 1.5
    assert rows["int2-g32-mse"]["runs"] == 0
    # seeded samples: BF16's band (5 - 4 = 1 point) scaled to its 2 runs' mean against fp8's one run
    floor = rows["fp8"]["vs_bf16"]["power"]["floor"]
    assert floor["arms"]["A"]["kind"] == "sampled" and floor["applied_band"]["points"] == pytest.approx(((1 / 2 + 1) / 2) ** 0.5)
    assert [p["build"] for p in doc["curve"]] == ["s500-w2@1"]  # no shipped facts described: no shipped point
    assert doc["curve"][0]["int2-g32-mse"]["points_per_run"] == [5] and doc["curve"][0]["expert_kurtosis_max"] == 4.0
    assert doc["meta"]["not_run"] == ["play:shipped:fp8:1: stopped at the deadline of 7.0 min"]
    text = (tmp_path / "out" / "resolution.md").read_text()
    assert "| `fp8` | 8.00 | 1 | 5.0 | 5–5 | 0 / 1 |" in text and "| s500-w2@1 | 2.0 M | 1.500 | 3.50 / 4.00 | 4.0 (1) | 5.0 (1) | 0 / 1 |" in text
    with pytest.raises(ConfigError, match="a seed played twice"):
        write_report(tmp_path / "out", [resolution, resolution])
    hotter = _part(tmp_path / "hot", {"play:shipped:bf16:2": a}, [], temperature=1.0)
    with pytest.raises(ConfigError, match="temperature"):
        write_report(tmp_path / "out", [resolution, hotter])


def test_the_merged_report_is_replaced_whole_or_not_at_all(tmp_path: Path, monkeypatch) -> None:
    """A report that fails after its Markdown is written leaves the earlier pair as it was."""
    import json

    import pytest

    from fp4forge.lab.diagnostics import suite_resolution_report
    from fp4forge.lab.diagnostics.suite_resolution_report import write_report

    part = _part(tmp_path / "res", {"play:shipped:bf16:0": [(1, 2)]}, [])
    write_report(tmp_path / "out", [part])
    before = {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()}
    assert sorted(before) == ["resolution.json", "resolution.md"]

    def broken_dumps(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(suite_resolution_report, "json", type("J", (), {"dumps": staticmethod(broken_dumps), "loads": json.loads}))
    with pytest.raises(OSError, match="disk full"):
        write_report(tmp_path / "out", [_part(tmp_path / "res2", {"play:shipped:bf16:0": [(2, 2)]}, [])])
    assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()} == before  # no new Markdown, no temp file
