"""Can the suite read an arm's answers? Refuse to score an arm whose turns it mostly cannot.

A turn is *unread* when the suite could not see an answer in it: it ended at ``max_tokens``
(``finish_reason: length``; the model was cut off, whatever it would have done next is unknown)
or it holds reasoning only (no content, no tool call: the served format put the whole answer,
well-formed tool calls included, in ``reasoning``, or the model never closed its reasoning).
Failed requests are counted apart (they are infrastructure, not answers).

When more than ``UNREADABLE_SHARE`` of an arm's answered turns are unread, scoring it would
measure the serving format (chat template, reasoning parser, token budget), not the model: a
model that never gets a tool call through scores the floor whatever it knows. That arm is
refused with ``UnreadableAnswersError`` (``allow_unreadable`` turns the refusal into a warning
that every report carries). docs/quality.md#unreadable-answers says what to change.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from fp4forge.errors import UnreadableAnswersError
from fp4forge.quality.scorer import LENGTH_FINISH, ModelTurn

UNREADABLE_SHARE = 0.5  # "mostly": more than half of the answered turns


@dataclass(frozen=True)
class AnswerHealth:
    """Turn counts of one run (or several runs of one arm, summed)."""

    turns: int = 0  # answered turns (a failed request is not an answer)
    truncated: int = 0  # finish_reason "length"
    reasoning_only: int = 0  # no content, no tool call, some reasoning
    empty: int = 0  # nothing at all: no content, no call, no reasoning
    unread: int = 0  # truncated or without content and calls (each turn counted once)
    with_calls: int = 0  # turns whose tool calls the server parsed

    @classmethod
    def of_turns(cls, turns: Iterable[ModelTurn]) -> AnswerHealth:
        counts = dict.fromkeys(("turns", "truncated", "reasoning_only", "empty", "unread", "with_calls"), 0)
        for turn in turns:
            if turn.error is not None:
                continue
            has_content = bool((turn.content or "").strip())
            truncated = turn.finish_reason == LENGTH_FINISH
            silent = not has_content and not turn.calls
            counts["turns"] += 1
            counts["truncated"] += truncated
            counts["reasoning_only"] += silent and bool((turn.reasoning or "").strip())
            counts["empty"] += silent and not (turn.reasoning or "").strip()
            counts["unread"] += truncated or silent
            counts["with_calls"] += bool(turn.calls)
        return cls(**counts)

    def __add__(self, other: AnswerHealth) -> AnswerHealth:
        return AnswerHealth(**{key: getattr(self, key) + getattr(other, key) for key in asdict(self)})

    @property
    def unread_share(self) -> float:
        return self.unread / self.turns if self.turns else 0.0

    @property
    def unreadable(self) -> bool:
        return self.turns > 0 and self.unread_share > UNREADABLE_SHARE

    def describe(self) -> str:
        return (f"{self.unread} of {self.turns} turns unread ({self.truncated} cut at max_tokens, "
                f"{self.reasoning_only} reasoning only, {self.empty} empty); {self.with_calls} with parsed tool calls")

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "unread_share": round(self.unread_share, 4), "unreadable": self.unreadable}


def arm_health(healths: Iterable[AnswerHealth]) -> AnswerHealth:
    total = AnswerHealth()
    for health in healths:
        total = total + health
    return total


def unreadable_reason(arm: str, health: AnswerHealth, max_tokens: Any = None) -> str:
    budget = f" (max_tokens {max_tokens})" if max_tokens is not None else ""
    return (f"arm {arm!r}: {health.describe()}{budget}; more than {UNREADABLE_SHARE:.0%} of its turns carry no answer the "
            "suite can read, so its score would measure the serving format (template, reasoning parser, token budget), "
            "not the model")


def refusal_block(arms: Sequence[tuple[str, AnswerHealth, Any]], allow_unreadable: bool) -> dict[str, Any]:
    """The ``answers`` block of a score or compare document: per arm counts, and the refusal."""
    reasons = [unreadable_reason(arm, health, budget) for arm, health, budget in arms if health.unreadable]
    return {
        "arms": {arm: health.to_dict() for arm, health, _ in arms},
        "unreadable": reasons,
        "refused": bool(reasons) and not allow_unreadable,
        "allowed": bool(reasons) and allow_unreadable,
        "threshold": UNREADABLE_SHARE,
    }


def refusal_error(doc: dict[str, Any], file: str | None = None) -> UnreadableAnswersError | None:
    """The error a document's refusal stands for (None when it scored)."""
    block = doc.get("answers") or {}
    if not block.get("refused"):
        return None
    return UnreadableAnswersError("refused to score: " + "; ".join(block["unreadable"])
                                  + " (docs/quality.md#unreadable-answers says what to change; the override scores it with a warning)",
                                  file=file, option="allow_unreadable")
