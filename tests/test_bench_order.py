"""Speed trends that survive the order of the run (docs/bench.md#order): the kept requests go
out in seeded random rounds over the shapes, and "decode rises/falls with context" or "TTFT is
curved" stands only when the send order is unrelated to context and the trend holds in both
halves of the run. Planted data (a drift over time, a real context effect) and two runs against
the fake server (tests/test_bench_client.py), whose "context-slow" model decodes slower with
longer prompts.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np

from fp4forge.bench import stats
from fp4forge.bench.analyze import analyze_dir, summarize_samples
from fp4forge.bench.runner import BenchConfig, LoadPoint, Shape, run_bench, schedule
from fp4forge.report.bench_tables import flatness_line
from tests.test_bench_client import fake_url  # noqa: F401 - the fake server fixture

LADDER = (100, 1000, 2000, 4000)
C1 = LoadPoint("sequential", concurrency=1)


def sample(seq: int, tokens: int, *, ttft: float = 0.1, decode: float = 30.0) -> dict[str, Any]:
    return {"seq": seq, "shape": f"p{tokens}-o32", "load": "c1", "prompt_tokens": tokens, "output_tokens": 32,
            "ttft_s": ttft, "decode_tok_s": decode, "e2e_s": ttft + 32 / decode, "ok": True, "warmup": False}


def ascending(rounds: int) -> list[int]:
    return [tokens for tokens in LADDER for _ in range(rounds)]


def shuffled(rounds: int, seed: int = 0) -> list[int]:
    rng = np.random.default_rng(seed)
    return [LADDER[i] for _ in range(rounds) for i in rng.permutation(len(LADDER))]


# -- the schedule -------------------------------------------------------------------------------
def test_rounds_are_seeded_permutations_of_every_shape() -> None:
    shapes = [Shape(t, 8) for t in LADDER]
    blocks = schedule(shapes, [C1], samples=7, repeats=3, seed=5)
    assert [b.round for b in blocks] == [1] * 4 + [2] * 4 + [3] * 4
    for r in (1, 2, 3):
        assert sorted(b.shape.prompt_tokens for b in blocks if b.round == r) == list(LADDER)
    assert [b.count for b in blocks if b.shape.prompt_tokens == 100] == [3, 2, 2]  # 7 samples over 3 rounds
    assert schedule(shapes, [C1], 7, 3, 5) == blocks  # seeded
    orders = {tuple(b.shape.prompt_tokens for b in schedule(shapes, [C1], 7, 3, seed)) for seed in range(6)}
    assert len(orders) > 1  # the seed changes the order


# -- the order test on planted data -------------------------------------------------------------
def test_drift_in_ascending_order_is_not_called_a_trend() -> None:
    # decode slows down over time only (a shared machine getting busier); the shapes ran shortest first
    tokens = ascending(6)
    samples = [sample(i, t, decode=32.0 - 0.2 * i) for i, t in enumerate(tokens)]
    flat = summarize_samples(samples)["decode_flatness"][0]
    assert flat["order_test"]["claim"] == stats.FALLS  # what the old test would have printed
    assert flat["verdict"] == stats.CANNOT_TELL and flat["flat"] is None
    assert flat["order_test"]["order_correlation"] > stats.ORDER_CORRELATION_LIMIT
    assert "follows context" in flatness_line(flat) and "cannot tell" in flatness_line(flat)


def test_a_context_effect_in_random_order_survives() -> None:
    rng = np.random.default_rng(3)
    tokens = shuffled(6)
    samples = [sample(i, t, decode=30.0 - 0.002 * t + rng.normal(0, 0.1)) for i, t in enumerate(tokens)]
    flat = summarize_samples(samples)["decode_flatness"][0]
    assert flat["verdict"] == stats.FALLS
    test = flat["order_test"]
    assert test["survives"] and test["first_half"] < 0 and test["second_half"] < 0
    assert abs(test["order_correlation"]) < stats.ORDER_CORRELATION_LIMIT


def test_a_trend_that_flips_between_the_halves_is_withheld() -> None:
    # randomized order; the first half falls steeply with context, the second rises gently
    tokens = shuffled(8, seed=1)
    middle = len(tokens) // 2
    samples = [sample(i, t, decode=(30.0 - 0.003 * t) if i < middle else (22.0 + 0.0005 * t)) for i, t in enumerate(tokens)]
    flat = summarize_samples(samples)["decode_flatness"][0]
    assert flat["order_test"]["claim"] in (stats.FALLS, stats.RISES)
    assert flat["verdict"] == stats.CANNOT_TELL
    assert "both halves" in flat["order_test"]["reason"]


def test_curved_ttft_only_in_a_randomized_run() -> None:
    rng = np.random.default_rng(2)

    def ttft(t: int) -> float:
        return 0.05 + t / 4000 + 2e-7 * t * t + rng.normal(0, 0.002)

    random_run = summarize_samples([sample(i, t, ttft=ttft(t)) for i, t in enumerate(shuffled(5))])
    curvature = random_run["prefill"][0]["goodness"]["curvature"]
    assert curvature["curved"] is True and curvature["order_test"]["survives"]
    ordered = summarize_samples([sample(i, t, ttft=ttft(t)) for i, t in enumerate(ascending(5))])
    goodness = ordered["prefill"][0]["goodness"]
    assert goodness["curvature"]["curved"] is False and goodness["curvature"]["curved_whole_run"] is True
    assert "cannot tell" in goodness["verdict"] and "follows context" in goodness["verdict"]


# -- two runs against the fake server ---------------------------------------------------------------
def bench_once(url: str, out: Path, order_seed: int) -> dict[str, Any]:
    config = BenchConfig(base_url=url, model="context-slow", out_dir=out, shapes=[Shape(16, 6), Shape(128, 6), Shape(256, 6)],
                         points=[C1], warmups=0, samples=6, order_seed=order_seed)
    asyncio.run(run_bench(config))
    return analyze_dir(out)


def test_two_runs_in_random_order_agree_on_the_trend_or_cannot_tell(fake_url: str, tmp_path: Path) -> None:  # noqa: F811
    verdicts = []
    for seed in (1, 2):
        summary = bench_once(fake_url, tmp_path / f"run{seed}", seed)
        assert summary["run"]["order"] == {"repeats": 6, "order_seed": seed}  # one kept request per shape per round
        assert summary["run"]["host"]["cores_logical"] >= 1 and summary["run"]["host"]["load_after"] is not None
        flat = summary["decode_flatness"][0]
        assert abs(summary["order"][0]["order_correlation"]) < stats.ORDER_CORRELATION_LIMIT
        verdicts.append(flat["verdict"])
    trends = {v for v in verdicts if v != stats.CANNOT_TELL}
    assert len(trends) <= 1, verdicts  # never "rises" in one run and "falls" (or "flat") in the other
    assert trends <= {stats.FALLS}, verdicts  # the fake server decodes slower with longer prompts


# -- host facts ---------------------------------------------------------------------------------
def test_server_warnings_before_and_during_the_run(tmp_path: Path) -> None:
    from fp4forge.bench.host import host_facts, log_size, server_warnings

    corpus = Path(__file__).parent / "doctor_corpus" / "cpu-healthy-served.log"
    log = tmp_path / "server.log"
    log.write_bytes(corpus.read_bytes())
    started = log_size(log)
    startup = [line for line in corpus.read_text().splitlines() if " WARNING " in line]
    with log.open("a") as handle:  # the server warns twice while the benchmark runs
        handle.write("(APIServer pid=1) WARNING 12-06 05:20:00 [scheduler.py:1] Sequence group 0 is preempted\n" * 2)
    block = server_warnings(log, started)
    assert block["before_run"]["count"] == len(startup) > 0
    assert block["during_run"] == {"count": 2, "distinct": 1, "messages": ["Sequence group 0 is preempted"]}
    assert server_warnings(None, None) is None
    assert server_warnings(tmp_path / "absent.log", None)["error"]
    facts = host_facts()
    assert facts["cores_logical"] >= 1 and facts["load_after"] is None
