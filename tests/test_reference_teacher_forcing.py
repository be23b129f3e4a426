"""``fp4forge.fidelity.reference.teacher_forced_check`` on a hand-built bigram model (no server).

Oracle: a fake "model" whose logits at each position are a fixed row chosen by the token there
(a bigram table of exact binary fractions), so every gap, top-2 gap and argmax below is worked out
by hand, and reference logprobs come from ``math`` (log-sum-exp in float64), not from torch.
Covered: exact, near-tie within the margin, mismatch beyond it, positions after a divergence,
served logprobs (generated and prompt) against the drift tolerance and the exact prefix.
"""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch

from fp4forge.errors import ConfigError
from fp4forge.fidelity.reference import TeacherForcedCheck, check_continuation, teacher_forced_check

NEAR = 2.0 + 1 / 128  # 1/128 above 2.0: a near-tie gap exact in float32
# Row t = the logits that follow token t.
TABLE = [
    [1.0, 0.0, 0.0, 0.0],  # after 0: argmax 0, top-2 gap 1
    [0.0, 2.0, NEAR, -1.0],  # after 1: argmax 2, top-2 gap 1/128 (token 1 is a near-tie)
    [0.5, 0.0, 0.0, 1.0],  # after 2: argmax 3, top-2 gap 0.5 (token 0 is 0.5 behind)
    [0.0, 3.0, 0.0, 3.0],  # after 3: an exact tie of tokens 1 and 3 (argmax reports 1)
]
PROMPT = [3]
GREEDY = [1, 2, 3, 1]  # 3 -> 1 (tie, first) -> 2 -> 3 -> 1
MARGIN = 0.01


class Bigram(torch.nn.Module):
    """Logits at position i = TABLE[ids[i]]; records every call."""

    def __init__(self) -> None:
        super().__init__()
        self.table = torch.tensor(TABLE)
        self.calls: list[tuple[list[int], object]] = []

    def forward(self, input_ids: torch.Tensor, use_cache: object = None) -> SimpleNamespace:
        self.calls.append((input_ids[0].tolist(), use_cache))
        return SimpleNamespace(logits=self.table[input_ids])


def logprob(row: int, token: int) -> float:
    values = TABLE[row]
    return values[token] - math.log(sum(math.exp(v) for v in values))


def rows_of(served: list[int]) -> list[int]:
    return [*PROMPT, *served][:-1]


def test_exact_continuation() -> None:
    model = Bigram()
    check = teacher_forced_check(model, PROMPT, GREEDY, tie_margin=MARGIN)
    assert model.calls == [([3, 1, 2, 3, 1], False)]  # once, over prompt + served, no cache
    assert check.verdict == "exact"
    assert [t.reference for t in check.tokens] == [1, 2, 3, 1]
    assert [t.gap for t in check.tokens] == [0.0, 0.0, 0.0, 0.0]
    assert [t.top2_gap for t in check.tokens] == [0.0, 1 / 128, 0.5, 0.0]
    assert [t.logprob_delta for t in check.tokens] == [None] * 4
    assert check.near_ties == () and check.beyond_margin == () and check.max_logprob_delta is None


def test_a_tied_argmax_other_than_the_first_is_exact() -> None:
    """After token 3, tokens 1 and 3 share the max: serving 3 is a greedy choice, gap 0."""
    check = teacher_forced_check(Bigram(), PROMPT, [3], tie_margin=MARGIN)
    assert check.verdict == "exact"
    assert (check.tokens[0].served, check.tokens[0].reference, check.tokens[0].gap) == (3, 1, 0.0)


def test_near_tie_within_the_margin() -> None:
    served = [1, 1, 2, 3]  # position 1 takes token 1, 1/128 behind token 2
    check = teacher_forced_check(Bigram(), PROMPT, served, tie_margin=MARGIN)
    assert check.verdict == "near_tie"
    assert [(t.position, t.served, t.reference, t.gap) for t in check.near_ties] == [(1, 1, 2, 1 / 128)]
    assert check.beyond_margin == ()
    assert "#1 served 1 ref 2 gap 0.00781" in check.describe()
    # A margin at or under the gap makes it a mismatch: "below the margin" is strict.
    assert teacher_forced_check(Bigram(), PROMPT, served, tie_margin=1 / 128).verdict == "mismatch"


def test_mismatch_beyond_the_margin() -> None:
    served = [1, 2, 0, 0]  # position 2 takes token 0, 0.5 behind token 3
    check = teacher_forced_check(Bigram(), PROMPT, served, tie_margin=MARGIN)
    assert check.verdict == "mismatch"
    assert [(t.position, t.reference, t.gap) for t in check.beyond_margin] == [(2, 3, 0.5)]
    assert "beyond margin [#2 served 0 ref 3 gap 0.5]" in check.describe()
    assert teacher_forced_check(Bigram(), PROMPT, served, tie_margin=0.75).verdict == "near_tie"


def test_every_position_is_checked_after_a_divergence() -> None:
    """A near-tie at 1, then the reference continues from the served token: 0.5 gap at 3."""
    check = teacher_forced_check(Bigram(), PROMPT, [1, 1, 2, 0], tie_margin=MARGIN)
    assert [t.position for t in check.near_ties] == [1]
    assert [t.position for t in check.beyond_margin] == [3]
    assert check.verdict == "mismatch"


def test_logprob_deltas_against_the_tolerance() -> None:
    served = [1, 1, 2, 3]
    exact_lp = [logprob(row, tok) for row, tok in zip(rows_of(served), served)]
    offsets = [0.0, 1e-3, -2e-3, 5e-4]
    served_lp = [lp + off for lp, off in zip(exact_lp, offsets)]
    within = teacher_forced_check(Bigram(), PROMPT, served, served_lp, tie_margin=MARGIN, logprob_tolerance=3e-3)
    assert [t.logprob_delta for t in within.tokens] == pytest.approx([abs(o) for o in offsets], abs=1e-6)
    assert within.max_logprob_delta == pytest.approx(2e-3, abs=1e-6)
    assert within.verdict == "near_tie" and within.logprob_outliers == ()
    beyond = teacher_forced_check(Bigram(), PROMPT, served, served_lp, tie_margin=MARGIN, logprob_tolerance=1.5e-3)
    assert beyond.verdict == "mismatch"
    assert beyond.logprob_outliers == (2,)
    assert "logprob outliers [#2 0.002]" in beyond.describe()
    # Exact tokens but a wrong logprob are a mismatch too; without a tolerance, deltas are only reported.
    greedy_lp = [logprob(row, tok) + 0.1 for row, tok in zip(rows_of(GREEDY), GREEDY)]
    assert teacher_forced_check(Bigram(), PROMPT, GREEDY, greedy_lp, tie_margin=MARGIN, logprob_tolerance=0.01).verdict == "mismatch"
    reported = teacher_forced_check(Bigram(), PROMPT, GREEDY, greedy_lp, tie_margin=MARGIN)
    assert reported.verdict == "exact" and reported.max_logprob_delta == pytest.approx(0.1, abs=1e-6)


def test_to_json() -> None:
    served = [1, 1, 2, 0]
    lp = [logprob(row, tok) for row, tok in zip(rows_of(served), served)]
    doc = json.loads(json.dumps(teacher_forced_check(Bigram(), PROMPT, served, lp, tie_margin=MARGIN, logprob_tolerance=1e-4).to_json()))
    assert doc["verdict"] == "mismatch"
    assert (doc["near_ties"], doc["beyond_margin"], doc["logprob_outliers"]) == ([1], [3], [])
    assert doc["tie_margin"] == MARGIN and doc["logprob_tolerance"] == 1e-4
    assert (doc["exact_tolerance"], doc["exact_prefix"], doc["prompt_logprob_deltas"]) == (None, None, [])
    assert doc["tokens"][3] == {"position": 3, "served": 0, "reference": 3, "gap": 0.5, "top2_gap": 0.5,
                                "logprob_delta": pytest.approx(0.0, abs=1e-6)}


# Prompt 0 1 3: prompt token 1 follows 0 (row 0), token 3 follows 1 (row 1); then served 1 2
# follow 3 and 1 (rows 3 and 1). Scored positions: the two prompt tokens, then the two served.
LONG_PROMPT = [0, 1, 3]
LONG_SERVED = [1, 2]


def long_logprobs(offsets: list[float]) -> tuple[list[float], list[float]]:
    rows, tokens = [0, 1, 3, 1], [1, 3, *LONG_SERVED]
    values = [logprob(r, t) + o for r, t, o in zip(rows, tokens, offsets)]
    return values[:2], values[2:]


def long_check(offsets: list[float], **kwargs: int) -> TeacherForcedCheck:
    prompt_lp, served_lp = long_logprobs(offsets)
    return teacher_forced_check(
        Bigram(), LONG_PROMPT, LONG_SERVED, served_lp, prompt_logprobs=prompt_lp,
        tie_margin=MARGIN, logprob_tolerance=1e-2, exact_tolerance=1e-5, **kwargs,
    )


def test_prompt_logprobs_and_the_exact_prefix() -> None:
    exact = long_check([0.0, 0.0, 0.0, 0.0])
    assert exact.verdict == "exact" and exact.exact_prefix == 4
    assert exact.prompt_logprob_deltas == pytest.approx([0.0, 0.0], abs=1e-6)
    assert [t.reference for t in exact.tokens] == [1, 2] and [t.gap for t in exact.tokens] == [0.0, 0.0]
    # Exact for one position, then drifting (as after a flipped rounding): a near-tie, not exact.
    drift = long_check([0.0, 3e-3, -4e-3, 1e-3])
    assert drift.verdict == "near_tie" and drift.exact_prefix == 1 and drift.near_ties == ()
    assert drift.logprob_deltas == pytest.approx([0.0, 3e-3, 4e-3, 1e-3], abs=1e-6)
    assert "exact on 1 of 4 scored positions, then 0.003" in drift.describe()
    # Demanding a longer exact prefix than there is makes it a mismatch...
    assert long_check([0.0, 3e-3, -4e-3, 1e-3], min_exact_prefix=2).verdict == "mismatch"
    # ...and so does a continuation that differs from the very first scored position (other numerics).
    other = long_check([2e-3, 3e-3, -4e-3, 1e-3])
    assert other.exact_prefix == 0 and other.verdict == "mismatch"
    # Drift beyond logprob_tolerance on a prompt position is an outlier (index among scored positions).
    assert long_check([0.0, 0.02, 0.0, 0.0]).logprob_outliers == (1,)


def test_bad_arguments() -> None:
    with pytest.raises(ConfigError, match="prompt logprobs"):
        teacher_forced_check(Bigram(), LONG_PROMPT, LONG_SERVED, prompt_logprobs=[0.0], tie_margin=MARGIN)
    with pytest.raises(ConfigError, match="exact_tolerance needs"):
        teacher_forced_check(Bigram(), PROMPT, GREEDY, tie_margin=MARGIN, exact_tolerance=1e-5)
    with pytest.raises(ConfigError, match="served logprobs"):
        teacher_forced_check(Bigram(), PROMPT, GREEDY, [0.0], tie_margin=MARGIN)
    with pytest.raises(ConfigError, match="tie_margin"):
        teacher_forced_check(Bigram(), PROMPT, GREEDY, tie_margin=0.0)
    with pytest.raises(ConfigError, match="non-empty"):
        teacher_forced_check(Bigram(), [], GREEDY, tie_margin=MARGIN)
    with pytest.raises(ConfigError, match="no served tokens"):
        teacher_forced_check(Bigram(), PROMPT, [], tie_margin=MARGIN)
    with pytest.raises(ConfigError, match="logits must be"):
        check_continuation(torch.zeros(3, 4), GREEDY, tie_margin=MARGIN)
