"""A small byte-level BPE tokenizer with Laguna's (poolside) chat control tokens.

Trained locally and deterministically on Python's own stdlib sources, which every machine that
runs fp4forge has, so the testbed needs no download. The chat format mirrors Laguna's
("poolside_v1") framing closely enough that vLLM's ``poolside_v1`` reasoning and tool parsers
work on it; see ``chat_template.jinja`` for the format itself.
"""

from __future__ import annotations

import functools
import json
import sysconfig
from importlib import resources
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from fp4forge.errors import ConfigError

VOCAB_SIZE = 4096

# Laguna reuses one control token as BOS and EOS; the chat template opens every transcript with it.
EOS_TOKEN = "〈|EOS|〉"
BOS_TOKEN = EOS_TOKEN
PAD_TOKEN = "〈|PAD|〉"
END_OF_TURN_TOKEN = "</assistant>"

# Skipped when decoding with skip_special_tokens=True: framing, not content.
SPECIAL_TOKENS: tuple[str, ...] = (
    EOS_TOKEN,
    PAD_TOKEN,
    "<system>",
    "</system>",
    "<user>",
    "</user>",
    "<assistant>",
    END_OF_TURN_TOKEN,
    "<tool_response>",
    "</tool_response>",
    "<available_tools>",
    "</available_tools>",
)

# Single ids too, but *not* special: vLLM's poolside_v1 reasoning/tool parsers read them from
# the decoded text, and a special token would be stripped before they see it.
PARSER_TOKENS: tuple[str, ...] = (
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<arg_key>",
    "</arg_key>",
    "<arg_value>",
    "</arg_value>",
)

CONTROL_TOKENS: tuple[str, ...] = SPECIAL_TOKENS + PARSER_TOKENS

CHAT_TEMPLATE_FILE = "chat_template.jinja"

# Filler for ids the trained merges do not reach (the stdlib sources give ~26k merges at most):
# a config's vocabulary of 100k+ ids still gets exactly that many tokens, as real tokenizers
# reserve ids. Byte-level pre-tokenization never forms them, so encoding never produces them.
RESERVED_TOKEN = "<|reserved_{}|>"


def training_files() -> list[Path]:
    """Top-level stdlib modules in a fixed (sorted) order: the same text every run on a machine."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return sorted(stdlib.glob("*.py"))


def _training_text() -> list[str]:
    return [path.read_text(encoding="utf-8", errors="replace") for path in training_files()]


@functools.lru_cache(maxsize=4)
def _trained_tokenizer_json(vocab_size: int) -> str:
    """Train once per process; the JSON string is immutable, so callers can share it."""
    return _bpe_json(_training_text(), vocab_size)


def _bpe_json(texts: list[str], vocab_size: int) -> str:
    """A byte-level BPE trained on ``texts`` (deterministic for the same texts in the same order)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        # Control tokens first, so they get the low ids 0..k and the vocab stays exactly vocab_size.
        special_tokens=list(CONTROL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    eos_id = tokenizer.token_to_id(EOS_TOKEN)
    # Plain encodes start with BOS, as Laguna's tokenizer does; the chat template writes it itself
    # and chat prompts are encoded without special tokens.
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A $B:1",
        special_tokens=[(BOS_TOKEN, eos_id)],
    )
    data = json.loads(tokenizer.to_str())
    for added in data["added_tokens"]:
        if added["content"] in PARSER_TOKENS:
            added["special"] = False
    _reserve_up_to(data["model"]["vocab"], vocab_size)
    return json.dumps(data, ensure_ascii=False)


def _reserve_up_to(vocab: dict[str, int], vocab_size: int) -> None:
    """Fill the ids the trainer did not reach with reserved tokens, so the vocabulary has exactly
    ``vocab_size`` ids (0 .. vocab_size - 1, none skipped)."""
    next_id = len(vocab)
    if sorted(vocab.values()) != list(range(next_id)):  # the trainer numbers its tokens densely
        raise ConfigError("the trained BPE vocabulary is not numbered 0..n-1: the tokenizers library changed how it numbers merges")
    for number in range(vocab_size - next_id):
        vocab[RESERVED_TOKEN.format(number)] = next_id + number


def chat_template() -> str:
    return resources.files("fp4forge.testbed").joinpath(CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")


def build_tokenizer(vocab_size: int = VOCAB_SIZE, fit_texts: list[str] | None = None) -> PreTrainedTokenizerFast:
    """The testbed tokenizer, wrapped for transformers, with the chat template attached.

    ``fit_texts``: train the BPE merges on these texts instead of the stdlib sources (the trained
    testbed fits them to its own corpus, so its JSON schemas and chat text tokenize shorter); the
    control tokens, their ids and the template are the same either way."""
    backend = Tokenizer.from_str(_bpe_json(fit_texts, vocab_size) if fit_texts is not None else _trained_tokenizer_json(vocab_size))
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        chat_template=chat_template(),
        model_max_length=4096,
        clean_up_tokenization_spaces=False,
    )


def generation_stop_ids(tokenizer: PreTrainedTokenizerFast) -> list[int]:
    """EOS and end-of-turn: a chat reply ends with ``</assistant>``, plain text with EOS."""
    return [tokenizer.convert_tokens_to_ids(EOS_TOKEN), tokenizer.convert_tokens_to_ids(END_OF_TURN_TOKEN)]
