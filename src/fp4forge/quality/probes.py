"""Probes over the OpenAI-compatible API: KL between arms, and determinism at temperature 0.

**KL (teacher-forced).** The same fixed token sequences are scored on each arm through
``/v1/completions`` with token-id prompts: vLLM's ``prompt_logprobs=k`` (default) or
``echo=true`` + ``logprobs=k``. At each position both arms return the logprobs of their top-k
tokens (and of the actual next token). With S = the tokens *both* arms returned there,

    KL_S = sum_{v in S} p_v log(p_v / q_v) + p_R log(p_R / q_R),  p_R = 1 - sum_S p_v, q_R = 1 - sum_S q_v

is a **lower bound** on KL(P || Q) (grouping the rest of the vocabulary into one outcome cannot
increase KL: log-sum inequality). It is reported as that, never as the KL. With ``top_k=-1`` on a
server started with ``--max-logprobs -1`` both arms return the whole vocabulary and the same sum
is the exact KL. ``q_R`` is floored at
1e-12 to absorb float rounding, which can only lower the bound. Also reported: top-1 agreement and
the change in probability of the actual token. *Within-arm* = the same arm scored twice;
*between-arm* = arm A as P, arm B as Q. Both arms must share a tokenizer (checked).

**Determinism.** The same request N times: (1) teacher-forced, the fraction of positions whose
returned logprobs are bitwise identical in every replicate; (2) greedy generation (temperature 0,
``ignore_eos``), the first position where each replicate's tokens differ from the first
replicate's, with the top-1/top-2 logprob gap there (near-ties explain flips). Replicate 0 is the
first time the server sees the prompt (cold prefix cache, if caching is on); the others are warm.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from fp4forge.endpoint import Endpoint
from fp4forge.errors import ProbeError
from fp4forge.quality.suite import Scenario

if TYPE_CHECKING:
    import httpx

MODES = ("prompt_logprobs", "echo")
REST_FLOOR = 1e-12
TOKENIZER_PROBE_TEXTS = (
    "def main():\n    return {'city': 'Lyon', 'unit': 'celsius'}\n",
    "The quick brown fox jumps over 13 lazy dogs; naïve café — 東京.",
)


# A position: (actual token id, {token id: logprob}) with the actual token always in the dict.
Position = tuple[int, dict[int, float]]


# -- requests -----------------------------------------------------------------------------------
# ``client``: the connection pool the probe's calls share (None: each endpoint's own).
def tokenize_text(client: httpx.Client | None, endpoint: Endpoint, text: str) -> list[int]:
    return list(endpoint.via(client).tokenize({"prompt": text, "add_special_tokens": False})["tokens"])


def tokenize_chat(client: httpx.Client | None, endpoint: Endpoint, scenario: Scenario) -> list[int]:
    """The scenario's opening conversation, rendered by the server's own chat template."""
    body = {"messages": scenario.initial_messages(), "tools": scenario.request_tools(), "add_generation_prompt": True}
    return list(endpoint.via(client).tokenize(body)["tokens"])


def same_tokenizer(client: httpx.Client | None, arm_a: Endpoint, arm_b: Endpoint) -> bool:
    return all(tokenize_text(client, arm_a, text) == tokenize_text(client, arm_b, text) for text in TOKENIZER_PROBE_TEXTS)


def _token_key(key: str | int) -> int:
    text = str(key)
    return int(text.split(":", 1)[1]) if text.startswith("token_id:") else int(text)


def score_sequence(client: httpx.Client | None, endpoint: Endpoint, token_ids: Sequence[int], top_k: int, mode: str = "prompt_logprobs") -> list[Position]:
    """Teacher-forced logprobs for positions 1..len-1 of ``token_ids`` (position 0 has no context)."""
    endpoint_ = endpoint.via(client)
    base = {"model": endpoint.model, "prompt": list(token_ids), "max_tokens": 1, "temperature": 0.0}
    if mode == "prompt_logprobs":
        choice = endpoint_.complete({**base, "prompt_logprobs": top_k})["choices"][0]
        entries = choice.get("prompt_logprobs")
        if entries is None:
            raise ProbeError(f"{endpoint.label}: the server returned no prompt_logprobs (not vLLM? try the echo mode)", option="mode")
        positions = []
        for index in range(1, len(token_ids)):
            entry = entries[index] or {}
            logprobs = {_token_key(k): float(v["logprob"]) for k, v in entry.items()}
            positions.append((int(token_ids[index]), logprobs))
        return positions
    if mode == "echo":
        body = {**base, "echo": True, "logprobs": top_k, "return_tokens_as_token_ids": True}
        logprobs = endpoint_.complete(body)["choices"][0]["logprobs"]
        positions = []
        for index in range(1, len(token_ids)):
            top = {_token_key(k): float(v) for k, v in (logprobs["top_logprobs"][index] or {}).items()}
            actual = int(token_ids[index])
            if actual not in top and logprobs["token_logprobs"][index] is not None:
                top[actual] = float(logprobs["token_logprobs"][index])
            positions.append((actual, top))
        return positions
    raise ProbeError(f"mode must be one of {MODES}, got {mode!r}")


def generate_greedy(client: httpx.Client | None, endpoint: Endpoint, token_ids: Sequence[int], max_tokens: int, top_k: int) -> tuple[list[int], list[dict[int, float]]]:
    """Greedy continuation (temperature 0, EOS ignored so every replicate has the same length)."""
    body = {
        "model": endpoint.model, "prompt": list(token_ids), "max_tokens": max_tokens, "temperature": 0.0,
        "logprobs": top_k, "return_tokens_as_token_ids": True, "ignore_eos": True,
    }
    logprobs = endpoint.via(client).complete(body)["choices"][0]["logprobs"]
    tokens = [_token_key(t) for t in logprobs["tokens"]]
    tops = [{_token_key(k): float(v) for k, v in (entry or {}).items()} for entry in logprobs["top_logprobs"]]
    return tokens, tops


# -- KL -----------------------------------------------------------------------------------------
def topk_kl_lower_bound(p: dict[int, float], q: dict[int, float]) -> tuple[float, int]:
    """KL_S(P || Q) over the tokens both returned, plus one remainder outcome; (bound, |S|)."""
    shared = p.keys() & q.keys()
    kl = 0.0
    p_sum = q_sum = 0.0
    for token in shared:
        p_v, log_p, log_q = math.exp(p[token]), p[token], q[token]
        kl += p_v * (log_p - log_q)
        p_sum += p_v
        q_sum += math.exp(log_q)
    p_rest = 1.0 - p_sum
    q_rest = max(1.0 - q_sum, REST_FLOOR)
    if p_rest > REST_FLOOR:
        kl += p_rest * math.log(p_rest / q_rest)
    return max(kl, 0.0), len(shared)


def top1(logprobs: dict[int, float]) -> int:
    return min(logprobs, key=lambda token: (-logprobs[token], token))


def compare_positions(reference: list[list[Position]], candidate: list[list[Position]]) -> dict[str, Any]:
    """KL lower bound, top-1 agreement and delta-p over aligned teacher-forced positions."""
    kls, shared_sizes, agree, delta_p = [], [], [], []
    for seq_p, seq_q in zip(reference, candidate):
        for (actual, p), (_, q) in zip(seq_p, seq_q):
            kl, size = topk_kl_lower_bound(p, q)
            kls.append(kl)
            shared_sizes.append(size)
            agree.append(top1(p) == top1(q))
            delta_p.append(math.exp(q.get(actual, -math.inf)) - math.exp(p.get(actual, -math.inf)))
    return summarize_kl(kls, shared_sizes, agree, delta_p)


def summarize_kl(kls: list[float], shared_sizes: list[int], agree: list[bool], delta_p: list[float]) -> dict[str, Any]:
    if not kls:
        return {"positions": 0}
    values = np.asarray(kls)
    return {
        "positions": len(kls),
        "kl_lower_bound_mean": float(values.mean()),
        "kl_lower_bound_se": float(values.std(ddof=1) / math.sqrt(len(kls))) if len(kls) > 1 else 0.0,
        "kl_lower_bound_percentiles": {str(p): float(np.percentile(values, p)) for p in (50, 90, 99)},
        "kl_lower_bound_max": float(values.max()),
        "top1_agreement": float(np.mean(agree)),
        "mean_abs_delta_p": float(np.mean(np.abs(delta_p))),
        "mean_shared_tokens": float(np.mean(shared_sizes)),
        "zero_kl_positions": int(np.sum(values == 0.0)),
    }


def suite_sequences(client: httpx.Client | None, endpoint: Endpoint, scenarios: Sequence[Scenario], count: int) -> list[list[int]]:
    """Token ids of ``count`` scenario openings, one per category first, rendered by the server."""
    by_category: dict[str, list[Scenario]] = {}
    for scenario in scenarios:
        by_category.setdefault(scenario.category, []).append(scenario)
    ordered = [s for group in round_robin(list(by_category.values())) for s in group]
    return [tokenize_chat(client, endpoint, scenario) for scenario in ordered[:count]]


def round_robin(groups: list[list[Scenario]]) -> list[list[Scenario]]:
    """[[first of each group], [second of each group], ...]."""
    rounds = max((len(g) for g in groups), default=0)
    return [[g[i] for g in groups if i < len(g)] for i in range(rounds)]


def kl_probe(client: httpx.Client | None, arm_a: Endpoint, arm_b: Endpoint, sequences: list[list[int]], top_k: int = 20, mode: str = "prompt_logprobs") -> dict[str, Any]:
    """Within-arm (each arm twice) and between-arm (A as reference) teacher-forced comparisons."""
    if not same_tokenizer(client, arm_a, arm_b):
        raise ProbeError(f"{arm_a.label} and {arm_b.label} tokenize the probe texts differently: KL over token ids would compare different things")
    passes = {
        label: [[score_sequence(client, endpoint, seq, top_k, mode) for seq in sequences] for _ in range(2)]
        for label, endpoint in (("A", arm_a), ("B", arm_b))
    }
    within_a = compare_positions(passes["A"][0], passes["A"][1])
    within_b = compare_positions(passes["B"][0], passes["B"][1])
    between = compare_positions(passes["A"][0], passes["B"][0])
    between_repeat = compare_positions(passes["A"][1], passes["B"][1])
    estimator = ("exact KL(A || B) over the full vocabulary (logprobs=-1)" if top_k == -1 else
                 f"top-{top_k} lower bound on KL(A || B): tokens both arms returned plus one remainder outcome")
    return {
        "estimator": estimator,
        "mode": mode,
        "top_k": top_k,
        "sequences": len(sequences),
        "sequence_tokens": [len(s) for s in sequences],
        "arms": {"A": arm_a.describe(), "B": arm_b.describe()},
        "within_a": within_a,
        "within_b": within_b,
        "between": between,
        "between_repeat": between_repeat,
        "verdict": kl_verdict(within_a, within_b, between),
    }


def kl_verdict(within_a: dict[str, Any], within_b: dict[str, Any], between: dict[str, Any]) -> str:
    """Between-arm vs within-arm, on both signals: the KL bound and top-1 agreement."""
    if not between.get("positions"):
        return "no positions scored"
    within_kl = max(within_a["kl_lower_bound_mean"], within_b["kl_lower_bound_mean"])
    within_top1 = min(within_a["top1_agreement"], within_b["top1_agreement"])
    between_kl, between_top1 = between["kl_lower_bound_mean"], between["top1_agreement"]
    numbers = (f"KL bound between {between_kl:.4g} vs within {within_kl:.4g}; "
               f"top-1 agreement between {between_top1:.3f} vs within {within_top1:.3f}")
    if between_kl <= within_kl and between_top1 >= within_top1:
        text = f"the arms cannot be told apart over this API: they differ from each other no more than from themselves ({numbers})"
    else:
        text = f"the arms differ by more than each differs from itself ({numbers})"
    if between.get("mean_shared_tokens", 0.0) < 2.0:
        text += (f"; caution: the arms' top-k sets share {between['mean_shared_tokens']:.1f} tokens per position on average, "
                 "so the KL bound is close to vacuous here and top-1 agreement is the informative number")
    return text


# -- determinism --------------------------------------------------------------------------------
def first_divergence(reference: Sequence[int], other: Sequence[int]) -> int | None:
    for index, (a, b) in enumerate(zip(reference, other)):
        if a != b:
            return index
    return None if len(reference) == len(other) else min(len(reference), len(other))


def top2_gap(logprobs: dict[int, float]) -> float | None:
    values = sorted(logprobs.values(), reverse=True)
    return values[0] - values[1] if len(values) > 1 else None


def teacher_forced_stability(replicates: list[list[Position]]) -> dict[str, Any]:
    """Positions whose returned logprobs (every token, every float) are identical in all replicates."""
    positions = len(replicates[0]) if replicates else 0
    stable = sum(1 for i in range(positions) if all(rep[i] == replicates[0][i] for rep in replicates[1:]))
    first_differs = positions > 0 and len(replicates) > 2 and replicates[0] != replicates[1] and all(r == replicates[1] for r in replicates[2:])
    return {"positions": positions, "bitwise_stable": stable, "cold_replicate_alone_differs": first_differs}


def greedy_divergence(replicates: list[tuple[list[int], list[dict[int, float]]]]) -> dict[str, Any]:
    reference_tokens, reference_tops = replicates[0]
    divergences, gaps = [], []
    for tokens, _ in replicates[1:]:
        where = first_divergence(reference_tokens, tokens)
        divergences.append(where)
        if where is not None and where < len(reference_tops):
            gaps.append(top2_gap(reference_tops[where]))
    prefix = min((d for d in divergences if d is not None), default=len(reference_tokens))
    stable = sum(1 for i in range(prefix) if all(tops[i] == reference_tops[i] for _, tops in replicates[1:] if i < len(tops)))
    return {
        "generated_tokens": len(reference_tokens),
        "first_divergence": divergences,
        "top2_gap_at_divergence": gaps,
        "unique_completions": len({tuple(tokens) for tokens, _ in replicates}),
        "bitwise_stable_positions": stable,
        "compared_positions": prefix,
    }


def determinism_probe(client: httpx.Client | None, endpoint: Endpoint, sequences: list[list[int]], *, replicates: int = 8,
                      max_tokens: int = 32, top_k: int = 5, mode: str = "prompt_logprobs") -> dict[str, Any]:
    """The same requests ``replicates`` times, strictly one after another (concurrency 1)."""
    if replicates < 2:
        raise ProbeError("a determinism probe needs at least 2 replicates")
    forced, greedy = [], []
    for seq in sequences:
        forced.append(teacher_forced_stability([score_sequence(client, endpoint, seq, top_k, mode) for _ in range(replicates)]))
        greedy.append(greedy_divergence([generate_greedy(client, endpoint, seq, max_tokens, top_k) for _ in range(replicates)]))
    positions = sum(f["positions"] for f in forced)
    stable = sum(f["bitwise_stable"] for f in forced)
    divergences = [d for g in greedy for d in g["first_divergence"]]
    diverged = [d for d in divergences if d is not None]
    histogram = Counter(diverged)
    gaps = [gap for g in greedy for gap in g["top2_gap_at_divergence"] if gap is not None]
    return {
        "endpoint": endpoint.describe(),
        "replicates": replicates,
        "sequences": len(sequences),
        "max_tokens": max_tokens,
        "top_k": top_k,
        "mode": mode,
        "teacher_forced": {
            "positions": positions,
            "bitwise_stable": stable,
            "bitwise_stable_fraction": stable / positions if positions else None,
            "sequences_where_only_the_cold_replicate_differs": sum(f["cold_replicate_alone_differs"] for f in forced),
            "per_sequence": forced,
        },
        "greedy": {
            "replicate_pairs": len(divergences),
            "diverged": len(diverged),
            "diverged_fraction": len(diverged) / len(divergences) if divergences else None,
            "diverged_within_2_tokens": sum(1 for d in diverged if d < 2),
            "first_divergence_histogram": {str(k): histogram[k] for k in sorted(histogram)},
            "median_first_divergence": float(np.median(diverged)) if diverged else None,
            "median_top2_gap_at_divergence": float(np.median(gaps)) if gaps else None,
            "generated_positions": sum(g["compared_positions"] for g in greedy),
            "bitwise_stable_generated_positions": sum(g["bitwise_stable_positions"] for g in greedy),
            "per_sequence": greedy,
        },
    }
