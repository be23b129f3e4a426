"""The offline suite plays every scenario's turn in one batched generation: a scenario's answers
are the ones it gets played alone (left padding, cache and seeded draws do not leak between rows),
the batcher hands out each conversation's replies in order, and the Gumbel-max draws follow
softmax(logits / T)."""

from __future__ import annotations

import threading

import pytest
import torch

from fp4forge.lab.diagnostics.offline_suite import TurnBatcher, gumbel_noise, play, request_seed
from fp4forge.quality.runner import Reply


def _reply(text: str) -> Reply:
    return Reply({"role": "assistant", "content": text}, "stop", None, 0.0, None)


def test_batches_hold_every_waiting_conversation_and_replies_go_back_in_order() -> None:
    batches: list[list[tuple[int, int]]] = []

    def answer(batch):  # type: ignore[no-untyped-def]
        batches.append([key for key, _ in batch])
        return [_reply(f"{key[0]}.{key[1]}:{body['say']}") for key, body in batch]

    def player(turns: int):  # type: ignore[no-untyped-def]
        return lambda post: [post({"say": t}).message["content"] for t in range(turns)]

    results = TurnBatcher(answer).run([player(3), player(1), player(0), player(2)])
    assert results == [["0.0:0", "0.1:1", "0.2:2"], ["1.0:0"], [], ["3.0:0", "3.1:1"]]
    # one batch per turn, each with every conversation still talking, in player order
    assert batches == [[(0, 0), (1, 0), (3, 0)], [(0, 1), (3, 1)], [(0, 2)]]


def test_a_failure_stops_the_run_and_is_raised() -> None:
    def answer(batch):  # type: ignore[no-untyped-def]
        raise RuntimeError("generation broke")

    with pytest.raises(RuntimeError, match="generation broke"):
        TurnBatcher(answer).run([lambda post: post({}), lambda post: post({})])

    def broken(post):  # type: ignore[no-untyped-def]
        raise ValueError("scenario broke")

    with pytest.raises(ValueError, match="scenario broke"):
        TurnBatcher(lambda batch: [_reply("x") for _ in batch]).run([broken, lambda post: post({})])
    assert threading.active_count() < 20  # no conversation left waiting


def test_gumbel_max_draws_follow_the_softmax_and_each_row_its_own_seed() -> None:
    logits = torch.tensor([2.0, 0.5, 0.0, -1.0])
    temperature = 0.7
    noise = gumbel_noise([request_seed(3, "s", 0)], 40_000, 4, "cpu")[0]
    drawn = torch.bincount((logits / temperature + noise).argmax(dim=-1), minlength=4) / 40_000
    assert torch.allclose(drawn, torch.softmax(logits / temperature, dim=0), atol=0.01)
    pair = gumbel_noise([11, 12], 5, 7, "cpu")
    assert torch.equal(pair[1], gumbel_noise([12], 5, 7, "cpu")[0]) and not torch.equal(pair[0], pair[1])
    assert request_seed(0, "a", 1) != request_seed(0, "a", 2) != request_seed(1, "a", 2)


def test_a_scenario_played_in_a_batch_answers_as_played_alone() -> None:
    from transformers import AutoTokenizer, LagunaForCausalLM

    from fp4forge.quality.suite import load_suite
    from fp4forge.testbed.shipped import shipped_testbed

    source = shipped_testbed().path
    model = LagunaForCausalLM.from_pretrained(source, dtype=torch.float32).eval()  # F32: no batch-shape rounding
    tokenizer = AutoTokenizer.from_pretrained(source)
    # prompts of different lengths: the shorter one is left-padded in the batch; sampled, so each
    # row's draws must be its own too
    scenarios = [load_suite().scenarios[i] for i in (0, 40)]
    together = play(model, tokenizer, scenarios, "cpu", 12, 0.7, seed=5)
    for played, scenario in zip(together["scenarios"], scenarios):
        assert played == play(model, tokenizer, [scenario], "cpu", 12, 0.7, seed=5)["scenarios"][0]
    assert together["scenarios"][0]["texts"] != together["scenarios"][1]["texts"]
