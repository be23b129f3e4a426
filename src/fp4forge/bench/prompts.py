"""Load generation, part 1: prompts with an exact token count that no cache can serve.

``/v1/completions`` prompts are lists of token IDs, so their length is exact by construction
(vLLM adds nothing to a token-ID prompt). Chat prompts must be text: their words are added and
trimmed until the server's own ``/tokenize`` (or the model's tokenizer) counts exactly the target
for the whole rendered conversation, chat template included.

Every prompt starts with tokens that encode a per-run salt and the request's serial number, so
no two requests share even their first KV-cache block and prefix caching cannot serve them. In
``prefix_cache`` mode a shape's requests share a leading slice on purpose (the same for every
request of the shape), followed by the unique part.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from fp4forge.endpoint import Endpoint
from fp4forge.errors import ConfigError, EndpointError, EndpointStatusError

# Plain English words: whatever the tokenizer, they encode to ordinary (non-special) tokens.
WORDS: tuple[str, ...] = tuple(
    """time year people way day man thing woman life child world school state family student group
    country problem hand part place case week company system program question work government number
    night point home water room mother area money story fact month lot right study book eye job word
    business issue side kind head house service friend father power hour game line end member law car
    city community name president team minute idea kid body information back parent face others level
    office door health person art war history party result change morning reason research girl guy
    moment air teacher force education foot boy age policy process music market sense nation plan
    college interest death experience effect use class control care field development role effort rate
    heart drug show leader light voice wife police mind price report decision son view relationship
    town road arm difference value building action model season society tax director position player
    record paper space ground form event official matter center couple site project activity star
    table need court oil situation cost industry figure street image phone data picture practice piece
    land product doctor wall patient worker news test movie north love support technology step baby
    computer type attention film tree source organization hair window evidence population truth""".split()
)
HEADER_DIGITS = 6  # 3 salt digits + 3 serial digits, in base len(token_pool)
SALT_DIGITS = 3
MIN_TOKEN_POOL = 32
# Appended one at a time to close the last few tokens of a chat prompt; the first that adds
# exactly one token wins.
PAD_PIECES: tuple[str, ...] = (" a", " I", ".", ",", " the", "\n", " x", "!")
MAX_FIT_STEPS = 24


class PromptTokenizer(Protocol):
    name: str

    def encode(self, text: str) -> list[int]:
        """Token IDs of plain text, without special tokens."""
        ...

    def count_chat(self, messages: list[dict[str, Any]]) -> int:
        """Tokens of the whole rendered chat request, template and generation prompt included."""
        ...


class ServerTokenizer:
    """vLLM's ``POST /tokenize``: the count the server itself will see."""

    def __init__(self, base_url: str, model: str, *, timeout_s: float = 60.0) -> None:
        self._endpoint = Endpoint(base_url, model, timeout_s=timeout_s)
        self.name = f"server /tokenize ({self._endpoint.root})"
        self.model = model
        self.max_model_len: int | None = None

    def close(self) -> None:
        self._endpoint.close()

    def _tokenize(self, body: dict[str, Any]) -> dict[str, Any]:
        try:
            doc = self._endpoint.tokenize(body)
        except EndpointStatusError as error:
            raise ConfigError(
                f"{error.url} answered HTTP {error.status}: {(error.body or '')[:200]}; count tokens locally with a tokenizer instead",
                option="tokenizer",
            ) from error
        except EndpointError as error:
            raise ConfigError(f"cannot reach the server's tokenizer ({error.message}); count tokens locally with a tokenizer instead",
                              option="tokenizer") from error
        self.max_model_len = doc.get("max_model_len", self.max_model_len)
        return doc

    def encode(self, text: str) -> list[int]:
        return list(self._tokenize({"prompt": text, "add_special_tokens": False})["tokens"])

    def count_chat(self, messages: list[dict[str, Any]]) -> int:
        return int(self._tokenize({"messages": messages, "add_generation_prompt": True})["count"])


class HfTokenizer:
    """The model's own tokenizer (``transformers``), for servers without ``/tokenize``."""

    def __init__(self, path: str) -> None:
        from transformers import AutoTokenizer

        self.name = f"tokenizer {path}"
        self._tokenizer = AutoTokenizer.from_pretrained(path)

    def close(self) -> None:
        pass

    def encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False))

    def count_chat(self, messages: list[dict[str, Any]]) -> int:
        rendered = self._tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(rendered, dict) or hasattr(rendered, "input_ids"):
            rendered = rendered["input_ids"]
        return len(rendered)


@dataclass(frozen=True)
class Prompt:
    """A ready prompt: token IDs (completions) or messages (chat), with its exact length."""

    prompt_tokens: int
    target_tokens: int
    shared_prefix_tokens: int
    fingerprint: str  # short hash of the content, to spot accidental repeats in samples.jsonl
    token_ids: list[int] | None = None
    messages: list[dict[str, Any]] | None = None


class PromptFactory:
    """Builds the prompts of one run; ``serial`` must be unique per request within the run."""

    def __init__(
        self,
        tokenizer: PromptTokenizer,
        *,
        endpoint: str,
        seed: int = 0,
        run_salt: int | None = None,
        prefix_cache_fraction: float = 0.0,
    ) -> None:
        if not 0.0 <= prefix_cache_fraction < 1.0:
            raise ConfigError(f"prefix-cache fraction must be in [0, 1), got {prefix_cache_fraction}")
        self.tokenizer = tokenizer
        self.endpoint = endpoint
        self.seed = seed
        # Random per run unless given: a rerun against a warm server must not hit the cache that
        # the previous run filled.
        self.run_salt = secrets.randbits(31) if run_salt is None else run_salt
        self.prefix_cache_fraction = prefix_cache_fraction
        self._token_pool: list[int] | None = None
        self._tokens_per_word: float | None = None

    # -- token pool (completions) ---------------------------------------------------------------
    @property
    def token_pool(self) -> list[int]:
        if self._token_pool is None:
            ids = self.tokenizer.encode(" ".join(WORDS))
            self._token_pool = sorted(set(ids))
            if len(self._token_pool) < MIN_TOKEN_POOL:
                raise ConfigError(f"{self.tokenizer.name} encodes the word list to only {len(self._token_pool)} distinct tokens")
        return self._token_pool

    def unique_header_ids(self, serial: int) -> list[int]:
        """Serial digits first (the first token differs between consecutive requests), then salt digits."""
        pool = self.token_pool
        base = len(pool)
        if serial >= base**3:
            raise ConfigError(f"more than {base**3} requests in one run")
        serial_digits = _digits(serial, base, HEADER_DIGITS - SALT_DIGITS)
        salt_digits = _digits(self.run_salt % base**SALT_DIGITS, base, SALT_DIGITS)
        return [pool[d] for d in serial_digits + salt_digits]

    def shared_prefix_length(self, target_tokens: int) -> int:
        return int(round(self.prefix_cache_fraction * target_tokens))

    def build(self, shape_name: str, target_tokens: int, serial: int) -> Prompt:
        if target_tokens < 1:
            raise ConfigError(f"shape {shape_name}: prompt length must be >= 1 token")
        if self.endpoint == "chat":
            return self._build_chat(shape_name, target_tokens, serial)
        return self._build_token_ids(shape_name, target_tokens, serial)

    def _build_token_ids(self, shape_name: str, target_tokens: int, serial: int) -> Prompt:
        pool = self.token_pool
        shared = self.shared_prefix_length(target_tokens)
        prefix = [pool[i] for i in self._rng("prefix", shape_name).integers(0, len(pool), shared)]
        header = self.unique_header_ids(serial)
        filler_count = max(0, target_tokens - shared - len(header))
        filler = [pool[i] for i in self._rng("filler", serial).integers(0, len(pool), filler_count)]
        ids = (prefix + header + filler)[:target_tokens]
        return Prompt(len(ids), target_tokens, shared, _fingerprint(ids), token_ids=ids)

    # -- chat: text fitted to the exact count ---------------------------------------------------
    def _build_chat(self, shape_name: str, target_tokens: int, serial: int) -> Prompt:
        shared = self.shared_prefix_length(target_tokens)
        prefix = ""
        if shared:  # the same text for every request of the shape: a function of (shape, run) only
            prefix_words = self._words(self._rng("prefix", shape_name), self._words_for(shared))
            prefix = fit_text(prefix_words, shared, lambda text: len(self.tokenizer.encode(text)))[0]
        header = f"Request {serial:x}-{self.run_salt:x}."
        head = f"{prefix} {header}" if prefix else header
        words = self._words(self._rng("filler", serial), self._words_for(target_tokens))

        def count(text: str) -> int:
            return self.tokenizer.count_chat(_user_message(text))

        text, tokens = fit_text(words, target_tokens, count, head=head)
        messages = _user_message(text)
        return Prompt(tokens, target_tokens, shared, _fingerprint(text), messages=messages)

    def _words_for(self, target_tokens: int) -> int:
        return max(8, int(target_tokens / max(self.tokens_per_word, 0.25)) + 16)

    @property
    def tokens_per_word(self) -> float:
        if self._tokens_per_word is None:
            sample = self._words(self._rng("calibration", 0), 256)
            self._tokens_per_word = len(self.tokenizer.encode(" " + " ".join(sample))) / len(sample)
        return self._tokens_per_word

    def _rng(self, purpose: str, key: object) -> np.random.Generator:
        digest = hashlib.blake2b(f"{purpose}|{key}|{self.seed}|{self.run_salt}".encode(), digest_size=8).digest()
        return np.random.default_rng(int.from_bytes(digest, "little"))

    @staticmethod
    def _words(rng: np.random.Generator, count: int) -> list[str]:
        return [WORDS[i] for i in rng.integers(0, len(WORDS), count)]


def fit_text(
    words: Sequence[str],
    target_tokens: int,
    count: Callable[[str], int],
    *,
    head: str = "",
) -> tuple[str, int]:
    """``head`` plus as many ``words`` as fit, padded one token at a time; returns (text, exact count).

    The count is exact (it is measured); it equals the target unless the head alone is longer or
    no pad piece adds exactly one token, in which case it is the closest count below the target.
    """

    def text_for(k: int) -> str:
        body = " ".join(words[:k])
        return f"{head} {body}" if head and body else (head or body)

    known: dict[int, int] = {}

    def counted(k: int) -> int:
        if k not in known:
            known[k] = count(text_for(k))
        return known[k]

    lo = 0
    if counted(0) >= target_tokens:
        return text_for(0), counted(0)
    hi = len(words)
    if counted(hi) <= target_tokens:
        lo = hi
    else:
        # Invariant: counted(lo) < target < counted(hi) (or == at the end); interpolate, then bisect.
        for step in range(MAX_FIT_STEPS):
            if hi - lo <= 1:
                break
            c_lo, c_hi = counted(lo), counted(hi)
            if step < 3 and c_hi > c_lo:
                guess = lo + int((target_tokens - c_lo) * (hi - lo) / (c_hi - c_lo))
            else:
                guess = (lo + hi) // 2
            guess = min(max(guess, lo + 1), hi - 1)
            c = counted(guess)
            if c == target_tokens:
                return text_for(guess), c
            if c < target_tokens:
                lo = guess
            else:
                hi = guess
    text, tokens = text_for(lo), counted(lo)
    return pad_text(text, tokens, target_tokens, count)


def pad_text(text: str, tokens: int, target_tokens: int, count: Callable[[str], int]) -> tuple[str, int]:
    """Append pad pieces that each add exactly one token until the target is reached (or none does)."""
    while tokens < target_tokens:
        for piece in PAD_PIECES:
            candidate = text + piece
            c = count(candidate)
            if c == tokens + 1:
                text, tokens = candidate, c
                break
        else:
            break  # no single-token piece here; report the exact shorter count
    return text, tokens


def _user_message(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


def _digits(value: int, base: int, count: int) -> list[int]:
    """``count`` base-``base`` digits of ``value``, least significant first."""
    digits = []
    for _ in range(count):
        value, digit = divmod(value, base)
        digits.append(digit)
    return digits


def _fingerprint(content: object) -> str:
    return hashlib.blake2b(repr(content).encode(), digest_size=6).hexdigest()
