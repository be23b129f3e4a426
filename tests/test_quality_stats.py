"""Statistics against values computed by hand (or from independently computed power tables)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import httpx
import numpy as np
import pytest

from fp4forge.quality.stats import (
    binomial_cdf_half,
    compare_arms,
    mcnemar,
    minimum_detectable_effect,
    noise_floor,
    paired_bootstrap_ci,
    sign_flip_p,
    sign_test,
    sign_test_power,
    smallest_significant_discordance,
    wilson_interval,
)


# -- exact binomial tails -----------------------------------------------------------------------
def test_binomial_tails_by_hand() -> None:
    assert binomial_cdf_half(0, 5) == 1 / 32
    assert binomial_cdf_half(1, 5) == 6 / 32  # C(5,0) + C(5,1)
    assert binomial_cdf_half(2, 10) == (1 + 10 + 45) / 1024
    assert binomial_cdf_half(10, 10) == 1.0
    assert binomial_cdf_half(-1, 4) == 0.0


@pytest.mark.parametrize(("b", "c", "p"), [
    (1, 4, 0.375),  # 2 * 6/32: the published card's W4A4-vs-W4A16 sign test (4 of 5 discordant one way)
    (2, 3, 1.0),  # min(1, 2 * 16/32): the card's other p
    (0, 6, 2 / 64),  # the smallest all-one-way split that is significant at 0.05
    (0, 5, 2 / 32),  # 0.0625: five one-way discordances are not enough
    (1, 9, 2 * 11 / 1024),
    (0, 0, 1.0),
])
def test_sign_test_exact_values(b: int, c: int, p: float) -> None:
    assert sign_test(b, c) == pytest.approx(p, abs=1e-15)
    assert sign_test(c, b) == sign_test(b, c)


def test_mcnemar_exact_and_continuity_corrected() -> None:
    result = mcnemar(1, 9)
    assert result.exact_p == pytest.approx(22 / 1024)
    assert result.chi2 == pytest.approx((abs(1 - 9) - 1) ** 2 / 10)  # 4.9
    assert result.chi2_p == pytest.approx(math.erfc(math.sqrt(4.9 / 2)))  # chi-square 1 df survival
    assert result.chi2_p == pytest.approx(0.026857, abs=1e-6)
    assert mcnemar(3, 3).chi2 == 0.0  # the continuity correction stops at zero instead of giving (0 - 1)^2 / 6
    assert mcnemar(0, 0).exact_p == 1.0


def test_smallest_significant_discordance_is_six() -> None:
    assert smallest_significant_discordance(0.05) == 6
    assert smallest_significant_discordance(0.01) == 8  # 2/2^8 = 0.0078


# -- power (exact binomial tables computed independently of this code) ------------------------------
@pytest.mark.parametrize(("psi", "q", "power"), [
    (0.1, 0.7, 0.08), (0.1, 1.0, 0.70), (0.2, 0.8, 0.53), (0.2, 0.9, 0.85), (0.3, 0.8, 0.75), (0.3, 0.9, 0.97),
])
def test_sign_test_power_matches_the_reference_table(psi: float, q: float, power: float) -> None:
    assert sign_test_power(69, psi, q) == pytest.approx(power, abs=0.005)


def test_power_edge_cases() -> None:
    assert sign_test_power(69, 0.0, 1.0) == 0.0  # no discordance: nothing to detect
    assert sign_test_power(5, 1.0, 1.0) == 0.0  # 5 one-way discordances never reach p < 0.05
    assert sign_test_power(6, 1.0, 1.0) == pytest.approx(1.0)


@pytest.mark.parametrize(("sd", "mde"), [(0.2, 0.067), (0.3, 0.101), (0.4, 0.135), (0.5, 0.169)])
def test_minimum_detectable_effect_for_69(sd: float, mde: float) -> None:
    assert minimum_detectable_effect(69, sd) == pytest.approx(mde, abs=0.0006)


def test_wilson_interval_zero_of_ten() -> None:
    low, high = wilson_interval(0, 10)
    z = 1.959963984540054
    assert low == pytest.approx(0.0, abs=1e-12) and high == pytest.approx(z * z / (10 + z * z))  # 0.2775


# -- bootstrap and permutation ------------------------------------------------------------------
def test_bootstrap_of_a_constant_difference_is_a_point() -> None:
    assert paired_bootstrap_ci([0.25] * 30, n_boot=2000, seed=1) == pytest.approx((0.25, 0.25))


def test_bootstrap_on_a_constructed_binary_case() -> None:
    # 40 pairs: 10 differences of +1, 30 ties. Mean 0.25; bootstrap SE ~ sqrt(p(1-p)/n) = 0.0685.
    diffs = [1.0] * 10 + [0.0] * 30
    low, high = paired_bootstrap_ci(diffs, n_boot=20_000, seed=0)
    half = 1.96 * math.sqrt(0.25 * 0.75 / 40)
    assert low == pytest.approx(0.25 - half, abs=0.03) and high == pytest.approx(0.25 + half, abs=0.03)
    assert low > 0.0  # ten one-way differences: the CI excludes 0 ...
    assert sign_test(0, 10) < 0.01  # ... and so does the sign test
    assert paired_bootstrap_ci(diffs, n_boot=20_000, seed=0) == (low, high)  # seeded: reproducible
    # Percentiles of a resampled mean can only take values k/40.
    assert all(abs(v * 40 - round(v * 40)) < 1e-9 for v in (low, high))


def test_sign_flip_permutation_exact() -> None:
    assert sign_flip_p([1, 1, 1, 1, 1]) == pytest.approx(2 / 32)  # only all-plus and all-minus reach |sum| = 5
    assert sign_flip_p([0, 0, 0]) == 1.0
    assert sign_flip_p([1, -1]) == 1.0
    # Zeros are dropped before enumerating.
    assert sign_flip_p([0.5, 0.5, 0.5, 0, 0]) == pytest.approx(2 / 8)


# -- noise floor and verdict --------------------------------------------------------------------
CATEGORIES = {f"s{i}": ("alpha" if i < 10 else "beta") for i in range(20)}


def run_of(earned: dict[str, int], default: int = 1, maximum: int = 2) -> dict[str, tuple[int, int]]:
    return {sid: (earned.get(sid, default), maximum) for sid in CATEGORIES}


def test_noise_floor_counts_flips_and_moved_categories() -> None:
    runs = [run_of({}), run_of({"s1": 2, "s12": 0}), run_of({"s1": 2})]
    floor = noise_floor(runs, CATEGORIES)
    assert floor["flipping_scenarios"] == ["s1", "s12"]
    assert floor["total_per_run"] == [20, 20, 21]
    assert floor["spread_points"] == 1 and floor["band_points"] == 1
    assert floor["categories"]["alpha"]["earned_per_run"] == [10, 11, 11]
    assert floor["categories"]["beta"]["spread"] == 1 and floor["categories_moved"] == 2
    assert [p["discordant"] for p in floor["pairs"]] == [2, 1, 1]
    assert noise_floor([run_of({})], CATEGORIES)["measured"] is False


def test_identical_arms_are_no_difference() -> None:
    result = compare_arms([run_of({}), run_of({})], [run_of({})], CATEGORIES, n_boot=500)
    assert result["discordant"] == 0 and result["verdict"]["label"] == "no difference"


def test_gap_inside_the_noise_floor_is_not_ordered() -> None:
    # Arm A moves 3 points between its own runs; B is 2 points higher: inside the floor.
    runs_a = [run_of({}), run_of({"s1": 2, "s2": 2, "s3": 2})]
    runs_b = [run_of({"s4": 2, "s5": 2}), run_of({"s4": 2, "s5": 2, "s6": 2})]
    result = compare_arms(runs_a, runs_b, CATEGORIES, n_boot=2000)
    assert result["verdict"]["ordering"] == "none"
    reasons = " ".join(result["verdict"]["reasons"])
    assert "within the noise floor" in reasons and "sign test p" in reasons
    assert result["categories"]["alpha"]["within_noise"] is True


def test_clear_difference_outside_the_floor_is_ordered() -> None:
    # A is stable (identical runs); B gains a point on 12 of 20 scenarios in both its runs.
    gains = {f"s{i}": 2 for i in range(12)}
    runs_a = [run_of({}), run_of({})]
    runs_b = [run_of(gains), run_of(gains)]
    result = compare_arms(runs_a, runs_b, CATEGORIES, n_boot=2000)
    assert result["sign_test"]["p"] == pytest.approx(sign_test(0, 12))
    assert result["bootstrap_ci"][0] > 0
    assert result["verdict"]["ordering"] == "B>A", result["verdict"]
    assert len(result["flips"]) == 12 and result["flips_also_within_arm"] == 0


def test_single_runs_never_order_the_arms() -> None:
    gains = {f"s{i}": 2 for i in range(12)}
    result = compare_arms([run_of({})], [run_of(gains)], CATEGORIES, n_boot=2000)
    assert result["sign_test"]["p"] < 0.001
    assert result["verdict"]["ordering"] == "none"
    assert "no A/A noise floor" in result["verdict"]["text"]


def test_flip_list_marks_scenarios_that_also_flip_within_an_arm() -> None:
    runs_a = [run_of({}), run_of({"s1": 2})]
    runs_b = [run_of({"s1": 2, "s2": 0}), run_of({"s1": 2, "s2": 0})]
    result = compare_arms(runs_a, runs_b, CATEGORIES, n_boot=500)
    flips = {f["id"]: f for f in result["flips"]}
    assert set(flips) == {"s1", "s2"}
    assert flips["s1"]["flips_within_a"] and flips["s1"]["favours"] == "B"
    assert not flips["s2"]["flips_within_a"] and flips["s2"]["favours"] == "A"
    assert result["flips_also_within_arm"] == 1
    assert result["mcnemar_fully_correct"]["b"] == 0 and result["mcnemar_fully_correct"]["c"] == 1  # s1 passes every B run only


def test_power_block_is_computed_for_the_observed_discordance() -> None:
    runs_b = [run_of({"s1": 2, "s2": 2})]
    result = compare_arms([run_of({})], runs_b, CATEGORIES, n_boot=500)
    psis = {row["psi"] for row in result["power"]["sign_test"]}
    assert 0.1 in psis  # observed 2/20 coincides with 0.1
    assert result["power"]["min_discordant"] == 6
    assert result["power"]["mde_80"] == pytest.approx(minimum_detectable_effect(20, float(np.std([0.5, 0.5] + [0] * 18, ddof=1))))


# -- probes: the KL bound and the determinism counters --------------------------------------------
from fp4forge.quality.probes import (  # noqa: E402 - grouped with the tests that use them
    Endpoint,
    compare_positions,
    determinism_probe,
    first_divergence,
    greedy_divergence,
    kl_probe,
    teacher_forced_stability,
    topk_kl_lower_bound,
)
from fp4forge.report.quality_files import write_determinism, write_kl  # noqa: E402


def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max()
    return shifted - np.log(np.exp(shifted).sum())


def exact_kl(log_p: np.ndarray, log_q: np.ndarray) -> float:
    return float(np.sum(np.exp(log_p) * (log_p - log_q)))


def top_k(log_p: np.ndarray, k: int, also: int) -> dict[int, float]:
    chosen = set(np.argsort(-log_p)[:k].tolist()) | {also}
    return {int(t): float(log_p[t]) for t in chosen}


def test_topk_kl_is_exact_on_the_full_vocabulary_and_a_lower_bound_otherwise() -> None:
    rng = np.random.default_rng(7)
    for _ in range(200):
        log_p = log_softmax(rng.normal(0, 2.0, 64))
        log_q = log_softmax(rng.normal(0, 2.0, 64))
        full_p = {t: float(v) for t, v in enumerate(log_p)}
        full_q = {t: float(v) for t, v in enumerate(log_q)}
        exact = exact_kl(log_p, log_q)
        assert topk_kl_lower_bound(full_p, full_q)[0] == pytest.approx(exact, rel=1e-9, abs=1e-12)
        actual = int(rng.integers(64))
        bound, shared = topk_kl_lower_bound(top_k(log_p, 5, actual), top_k(log_q, 5, actual))
        assert 0.0 <= bound <= exact + 1e-12 and shared >= 1


def test_topk_kl_of_identical_distributions_is_zero() -> None:
    p = {1: math.log(0.5), 2: math.log(0.3)}
    assert topk_kl_lower_bound(p, dict(p)) == (0.0, 2)


def test_compare_positions_counts_top1_agreement() -> None:
    seq_p = [[(1, {1: math.log(0.6), 2: math.log(0.4)}), (2, {1: math.log(0.3), 2: math.log(0.7)})]]
    seq_q = [[(1, {1: math.log(0.6), 2: math.log(0.4)}), (2, {1: math.log(0.8), 2: math.log(0.2)})]]
    summary = compare_positions(seq_p, seq_q)
    assert summary["positions"] == 2 and summary["top1_agreement"] == 0.5 and summary["zero_kl_positions"] == 1
    expected = 0.3 * math.log(0.3 / 0.8) + 0.7 * math.log(0.7 / 0.2)
    assert summary["kl_lower_bound_mean"] == pytest.approx(expected / 2)


def test_kl_verdict_uses_both_signals_and_flags_a_vacuous_bound() -> None:
    from fp4forge.quality.probes import kl_verdict

    def block(kl: float, top1: float, shared: float = 20.0) -> dict[str, float]:
        return {"positions": 10, "kl_lower_bound_mean": kl, "top1_agreement": top1, "mean_shared_tokens": shared}

    # The published card's case (docs/laguna-card.md#noise-floor-and-arm-comparison): between-arm KL
    # (0.266) below within-arm (0.308).
    assert kl_verdict(block(0.308, 0.9), block(0.2, 0.95), block(0.266, 0.92)).startswith("the arms cannot be told apart")
    assert kl_verdict(block(0.1, 0.9), block(0.1, 0.9), block(0.3, 0.8)).startswith("the arms differ")
    vacuous = kl_verdict(block(0.0, 1.0), block(0.0, 1.0), block(1e-5, 0.0, shared=1.0))
    assert vacuous.startswith("the arms differ") and "close to vacuous" in vacuous


def test_divergence_counters() -> None:
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 9, 3]) == 1
    assert first_divergence([1, 2, 3], [1, 2]) == 2
    tops = [{1: -0.1, 2: -2.0}, {2: -0.5, 3: -0.6}, {3: -0.2}]
    replicates = [([1, 2, 3], tops), ([1, 2, 3], tops), ([1, 3, 3], [tops[0], {3: -0.55, 2: -0.56}, tops[2]])]
    result = greedy_divergence(replicates)
    assert result["first_divergence"] == [None, 1] and result["unique_completions"] == 2
    assert result["top2_gap_at_divergence"] == [pytest.approx(0.1)]  # replicate 0's near-tie at token 1
    assert result["compared_positions"] == 1 and result["bitwise_stable_positions"] == 1
    forced = teacher_forced_stability([[(1, {1: -0.1})], [(1, {1: -0.1})], [(1, {1: -0.1})]])
    assert forced == {"positions": 1, "bitwise_stable": 1, "cold_replicate_alone_differs": False}
    cold = teacher_forced_stability([[(1, {1: -0.2})], [(1, {1: -0.1})], [(1, {1: -0.1})]])
    assert cold["bitwise_stable"] == 0 and cold["cold_replicate_alone_differs"]


class FakeCompletions:
    """/v1/completions and /tokenize with scripted nondeterminism: the ``drift_from``-th request on
    (drifting) adds 1e-6 to one logprob and, for generation, changes token 2."""

    def __init__(self, drift_from: int | None) -> None:
        self.calls = 0
        self.drift_from = drift_from

    def handle(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        if request.url.path == "/tokenize":
            text = body.get("prompt", "")
            return httpx.Response(200, json={"tokens": [ord(c) % 50 for c in text] or [1, 2, 3]})
        self.calls += 1
        drift = self.drift_from is not None and self.calls >= self.drift_from
        prompt = body["prompt"]
        top = lambda i: {f"token_id:{prompt[i]}": -0.5 - (1e-6 if drift and i == 1 else 0.0), "token_id:49": -1.5}  # noqa: E731
        if body["max_tokens"] == 1:
            entries = [None] + [top(i) for i in range(1, len(prompt))] + [{"token_id:7": -0.1}]
            tokens = [f"token_id:{t}" for t in prompt] + ["token_id:7"]
            logprobs = [None] + [-0.5] * (len(prompt) - 1) + [-0.1]
            return httpx.Response(200, json={"choices": [{"logprobs": {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": entries}}]})
        generated = [5, 6, 9 if drift else 7, 8][: body["max_tokens"]]
        return httpx.Response(200, json={"choices": [{"logprobs": {
            "tokens": [f"token_id:{t}" for t in generated], "token_logprobs": [-0.1] * len(generated),
            "top_logprobs": [{f"token_id:{t}": -0.1, "token_id:1": -0.2} for t in generated]}}]})


def test_determinism_probe_counts_against_a_fake_server(tmp_path: Path) -> None:
    fake = FakeCompletions(drift_from=3)
    with httpx.Client(transport=httpx.MockTransport(fake.handle)) as client:
        doc = determinism_probe(client, Endpoint("http://fake", "m"), [[1, 2, 3, 4]], replicates=3, max_tokens=4, top_k=2, mode="echo")
    forced, greedy = doc["teacher_forced"], doc["greedy"]
    assert forced["positions"] == 3 and forced["bitwise_stable"] == 2  # the third request drifted at position 1
    # Generation requests are calls 4-6, all drifting: identical to each other.
    assert greedy["diverged"] == 0 and greedy["bitwise_stable_generated_positions"] == 4
    fake = FakeCompletions(drift_from=6)
    with httpx.Client(transport=httpx.MockTransport(fake.handle)) as client:
        doc = determinism_probe(client, Endpoint("http://fake", "m"), [[1, 2, 3, 4]], replicates=3, max_tokens=4, top_k=2, mode="echo")
    assert doc["greedy"]["first_divergence_histogram"] == {"2": 1} and doc["greedy"]["diverged_within_2_tokens"] == 0
    written = write_determinism(doc, tmp_path)
    assert set(written) >= {"determinism.json", "determinism.md"}
    assert "**1 of 2 replicates diverge**" in (tmp_path / "determinism.md").read_text()


def test_kl_probe_of_one_server_against_itself_is_zero(tmp_path: Path) -> None:
    fake = FakeCompletions(drift_from=None)
    with httpx.Client(transport=httpx.MockTransport(fake.handle)) as client:
        doc = kl_probe(client, Endpoint("http://fake", "m", "A"), Endpoint("http://fake/v1", "m", "B"), [[1, 2, 3], [4, 5, 6, 7]], top_k=2, mode="echo")
    assert doc["between"]["positions"] == 5 and doc["between"]["kl_lower_bound_mean"] == 0.0 and doc["between"]["top1_agreement"] == 1.0
    assert doc["verdict"].startswith("the arms cannot be told apart")
    write_kl(doc, tmp_path)
    assert "lower bound" in (tmp_path / "kl.md").read_text()


def test_kl_probe_refuses_arms_with_different_tokenizers() -> None:
    from fp4forge.quality.probes import ProbeError

    def handle(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        offset = 1 if "b" in str(request.url) else 0
        return httpx.Response(200, json={"tokens": [len(body["prompt"]) + offset]})

    with httpx.Client(transport=httpx.MockTransport(handle)) as client, pytest.raises(ProbeError, match="tokenize"):
        kl_probe(client, Endpoint("http://a", "m"), Endpoint("http://b", "m"), [[1, 2]])
