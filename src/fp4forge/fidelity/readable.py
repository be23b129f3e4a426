"""Whether the teacher can read the text fidelity is measured on (docs/fidelity.md#unreadable-text).

A model that predicts no better than chance has a perplexity of its vocabulary size (the uniform
distribution's). On text its teacher cannot read, KL and top-1 agreement compare two guesses, and
a small KL says nothing about the quantization. The line is drawn at half the vocabulary size:
a teacher at or above it is within one bit per token of knowing nothing about the text. Models
that read a text sit orders of magnitude below (the trained testbed: 1.7 on its own held-out text
against 4,096; a random testbed: 4,307 on any text).
"""

from __future__ import annotations

from typing import Any

from fp4forge.errors import UnreadableTextError

UNREADABLE_PERPLEXITY_SHARE = 0.5  # of the vocabulary size: one bit per token from uniform


def check_readable(teacher_perplexity: float, vocab_size: int | None, allow_unreadable: bool, *, file: str | None = None) -> dict[str, Any]:
    """The report's ``readability`` block; text the teacher cannot read raises
    :class:`UnreadableTextError` unless ``allow_unreadable`` (then the block carries the warning)."""
    if not vocab_size:
        return {"readable": None, "vocab_size": None, "share": UNREADABLE_PERPLEXITY_SHARE,
                "warning": "the config names no vocab_size: whether the teacher reads this text was not checked"}
    limit = UNREADABLE_PERPLEXITY_SHARE * vocab_size
    block: dict[str, Any] = {"readable": teacher_perplexity < limit, "vocab_size": int(vocab_size), "share": UNREADABLE_PERPLEXITY_SHARE,
                             "limit": limit, "teacher_perplexity": teacher_perplexity, "warning": None}
    if block["readable"]:
        return block
    reason = (f"the teacher cannot read this text: its perplexity {teacher_perplexity:,.0f} is at or above {UNREADABLE_PERPLEXITY_SHARE:g} x "
              f"its vocabulary size {vocab_size:,} ({limit:,.0f}; uniform guessing is {vocab_size:,}), so KL and top-1 agreement "
              "on it compare two guesses")
    if not allow_unreadable:
        raise UnreadableTextError(f"refused to score fidelity: {reason}; give text the model reads (docs/fidelity.md#unreadable-text; "
                                  "the override scores it with a warning)", file=file, option="allow_unreadable")
    block["warning"] = f"UNREADABLE TEXT, scored anyway: {reason}"
    return block
