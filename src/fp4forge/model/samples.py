"""Calibration and evaluation text: a built-in corpus every machine has, plus the user's files.

Built-in corpus: the documented functions and classes of the running interpreter's standard
library (top-level ``*.py`` files, sorted), each made into one short chat — a question about the
object and its docstring or source as the answer — rendered through the model's chat template.
Items whose ``crc32("module:qualname") % 8 == 0`` form the held-out split (for ``fidelity``);
the rest are the calibration split. The same Python and tokenizer always give the same samples.

User files: ``.jsonl`` lines with ``{"messages": [...]}`` (rendered through the chat template) or
``{"text": "..."}`` (used raw); any other file is one raw text document.

Whose text: the built-in corpus is not a model's own text unless the model says so, and no model
fp4forge knows says so (the trained and the synth testbeds ship their own files, :data:`OWN_TEXT_FILES`;
the tiny random testbeds have none). So ``builtin_corpus`` is three-valued: ``True`` uses it (asked
for), ``False`` never, ``None`` (the default) lets a job decide what an unasked fallback means:
a scoring job (fidelity) refuses with :class:`TextRequiredError` naming the option to pass, a
calibration uses it and records a warning in ``Samples.warnings`` (docs/fidelity.md#text).

Samples are packed: documents are tokenized, concatenated and cut into ``samples`` rows of exactly
``seq_len`` tokens, so no sample is padded and every batch has one shape (the masks and rotary
tables the model builds are then identical for all batches).
"""

from __future__ import annotations

import ast
import itertools
import hashlib
import json
import sysconfig
import zlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fp4forge.checkpoint.names import CALIBRATION_TEXT_FILE, HELDOUT_TEXT_FILE
from fp4forge.errors import ConfigError, TextRequiredError

DEFAULT_RAM_BUDGET_BYTES = 4 * 2**30  # activations kept in RAM before they spill to disk
SPLITS = ("calibration", "heldout")
HELDOUT_MODULUS = 8
MAX_SOURCE_CHARS = 3000  # keeps one chat to a few hundred tokens: many objects per sample
Message = dict[str, str]
# The text a testbed ships beside its weights as its own, per split.
OWN_TEXT_FILES = {"calibration": CALIBRATION_TEXT_FILE, "heldout": HELDOUT_TEXT_FILE}
UNOWNED_FALLBACKS = ("refuse", "warn")

if TYPE_CHECKING:  # torch loads with the samples, not with the options (the CLI reads their defaults)
    import torch

    from fp4forge.checkpoint.reader import Checkpoint


@dataclass(frozen=True)
class SampleOptions:
    """The text a layer-streamed job runs through the model and where its activations live: the
    options calibration, GPTQ and fidelity share (each job's options extend these)."""

    samples: int = 64
    seq_len: int = 512
    batch_size: int = 4
    text_files: tuple[Path, ...] = ()
    builtin_corpus: bool | None = None  # None: only as the job's fallback (module docstring)
    tokenizer: Path | None = None  # default: the checkpoint directory
    ram_budget_bytes: int = DEFAULT_RAM_BUDGET_BYTES
    spill_dir: Path | None = None
    device: str | None = None  # None/"auto": CUDA when available, else CPU (model.device)
    activation_budget_bytes: int | None = None  # kept on the device; None: the device's default

    def __post_init__(self) -> None:
        if self.device is not None and str(self.device).strip().lower() != "auto":  # auto: whatever is there
            from fp4forge.model.device import resolve_device

            resolve_device(self.device)  # a bad or unavailable device fails here, by name
        if self.activation_budget_bytes is not None and self.activation_budget_bytes < 0:
            raise ConfigError(f"must be at least 0, got {self.activation_budget_bytes}", option="activation_budget_bytes")
        for option, least in (("samples", 1), ("seq_len", 2), ("batch_size", 1)):
            if getattr(self, option) < least:
                raise ConfigError(f"must be at least {least}, got {getattr(self, option)}", option=option)

    def describe(self) -> dict[str, Any]:
        """The text as provenance records it."""
        return {"samples": self.samples, "seq_len": self.seq_len, "text_files": [str(p) for p in self.text_files], "builtin_corpus": self.builtin_corpus}


def samples_for(options: SampleOptions, *checkpoints: Checkpoint, split: str = "calibration", unowned: str = "warn") -> Samples:
    """The packed samples ``options`` ask for, tokenized by ``options.tokenizer`` or else by the
    first local checkpoint's own tokenizer. ``unowned``: what the built-in corpus as an unasked
    fallback (``builtin_corpus=None``) does: ``refuse`` (no text given: :class:`TextRequiredError`)
    or ``warn`` (used, with a warning in ``Samples.warnings``)."""
    if unowned not in UNOWNED_FALLBACKS:
        raise ConfigError(f"unowned must be one of {UNOWNED_FALLBACKS}, got {unowned!r}")
    roots = [getattr(c.source, "root", None) for c in checkpoints]
    tokenizer_dir = options.tokenizer or next((r for r in roots if r is not None), None)
    if tokenizer_dir is None:
        display = checkpoints[0].display if checkpoints else None
        raise ConfigError("a remote checkpoint needs a tokenizer directory", file=display, option="tokenizer")
    fallback = options.builtin_corpus is None
    own = _own_text_hint(split, roots[0] if roots else None)
    if fallback and unowned == "refuse" and not options.text_files:
        raise TextRequiredError(f"no {'held-out' if split == 'heldout' else 'calibration'} text given, and the built-in corpus "
                                f"(Python's standard library) is not this model's own text: give text the model reads{own}, or ask "
                                "for the built-in corpus explicitly (docs/fidelity.md#text)", option="text_files")
    builtin = options.builtin_corpus is not False and not (fallback and unowned == "refuse")
    samples = load_samples(load_tokenizer(tokenizer_dir), samples=options.samples, seq_len=options.seq_len,
                           text_files=options.text_files, split=split, builtin=builtin)
    if fallback and f"builtin:{split}" in samples.sources:
        warning = (f"the built-in corpus (Python's standard library) filled in {split} text, though nobody asked for it and it "
                   f"is not this model's own text: give text the model reads{own} (docs/fidelity.md#text)")
        samples = replace(samples, warnings=(*samples.warnings, warning))
    return samples


def _own_text_hint(split: str, root: Path | None) -> str:
    """Where a testbed's own text for ``split`` is, when it ships one."""
    own = Path(root) / OWN_TEXT_FILES[split] if root is not None else None
    return f" (this checkpoint ships its own: {own})" if own is not None and own.is_file() else ""


@dataclass(frozen=True)
class Document:
    """One text to tokenize: a chat (rendered through the template) or raw text."""

    origin: str
    messages: tuple[Message, ...] = ()
    text: str | None = None


# -- the built-in corpus ----------------------------------------------------------------------------
def _stdlib_files() -> list[Path]:
    return sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))


def _documented_objects(path: Path) -> Iterator[tuple[str, str, str]]:
    """(qualname, docstring, source) of every documented top-level function, class and method."""
    source = path.read_text(encoding="utf-8", errors="replace")
    lines = source.splitlines()
    try:
        tree = ast.parse(source)
    except SyntaxError:  # a test-data file the running Python cannot parse
        return
    nodes: list[tuple[str, ast.AST]] = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            nodes.append((node.name, node))
            if isinstance(node, ast.ClassDef):
                nodes += [(f"{node.name}.{m.name}", m) for m in node.body if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))]
    for qualname, node in nodes:
        doc = ast.get_docstring(node)
        # whole lines by number: ast.get_source_segment re-splits the file on every call
        segment = "\n".join(lines[node.lineno - 1 : node.end_lineno])[:MAX_SOURCE_CHARS]
        if doc and segment:
            yield qualname, doc, segment


# Three ways to ask about one object, chosen by its position: prose answers and code answers.
def _ask_doc(module: str, qualname: str, doc: str, source: str) -> tuple[Message, ...]:
    return ({"role": "user", "content": f"What does `{module}.{qualname}` do?"}, {"role": "assistant", "content": doc})


def _ask_source(module: str, qualname: str, doc: str, source: str) -> tuple[Message, ...]:
    return (
        {"role": "user", "content": f"Show me how `{qualname}` is implemented in Python's `{module}` module."},
        {"role": "assistant", "content": f"```python\n{source}\n```"},
    )


def _ask_docstring(module: str, qualname: str, doc: str, source: str) -> tuple[Message, ...]:
    return (
        {"role": "user", "content": f"Write a docstring for this code:\n```python\n{source}\n```"},
        {"role": "assistant", "content": doc},
    )


CHAT_FORMS = (_ask_doc, _ask_source, _ask_docstring)


def builtin_documents(split: str = "calibration") -> Iterator[Document]:
    """The built-in corpus, lazily (packing stops reading files once it has enough tokens)."""
    if split not in SPLITS:
        raise ConfigError(f"split must be one of {SPLITS}, got {split!r}")
    number = 0
    for path in _stdlib_files():
        module = path.stem
        for qualname, doc, source in _documented_objects(path):
            heldout = zlib.crc32(f"{module}:{qualname}".encode()) % HELDOUT_MODULUS == 0
            if heldout == (split == "heldout"):
                form = CHAT_FORMS[number % len(CHAT_FORMS)]
                yield Document(f"stdlib:{module}:{qualname}", messages=form(module, qualname, doc, source))
                number += 1


# -- user files ----------------------------------------------------------------------------------
def _jsonl_documents(path: Path) -> Iterator[Document]:
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record: Any = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"line {number}: not JSON ({exc})", file=str(path)) from None
        origin = f"{path.name}:{number}"
        if isinstance(record, dict) and isinstance(record.get("messages"), list):
            yield Document(origin, messages=tuple(record["messages"]))
        elif isinstance(record, dict) and isinstance(record.get("text"), str):
            yield Document(origin, text=record["text"])
        else:
            raise ConfigError(f'line {number}: expected {{"messages": [...]}} or {{"text": "..."}}', file=str(path))


def text_jsonl(texts: Iterable[str]) -> str:
    """Raw documents as a ``.jsonl`` file of ``{"text": ...}`` lines, the form read above."""
    return "".join(json.dumps({"text": text}, ensure_ascii=False) + "\n" for text in texts)


def file_documents(paths: Sequence[str | Path]) -> list[Document]:
    documents: list[Document] = []
    for raw in paths:
        path = Path(raw)
        if not path.is_file():
            raise ConfigError("no such text file", file=str(path))
        if path.suffix == ".jsonl":
            documents += list(_jsonl_documents(path))
        else:
            documents.append(Document(path.name, text=path.read_text(encoding="utf-8", errors="replace")))
    return documents


# -- tokenizing and packing -------------------------------------------------------------------------
def render(tokenizer: Any, document: Document) -> str:
    if document.text is not None:
        return document.text
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError("the tokenizer has no chat template; give raw text files instead", option="text_files")
    return tokenizer.apply_chat_template(list(document.messages), tokenize=False)


@dataclass(frozen=True)
class Samples:
    """Token ids [samples, seq_len] and what they were made of."""

    input_ids: torch.Tensor
    sources: tuple[str, ...]
    documents_used: int
    # Per token, the number of the document it came from (0, 1, ...): packing cuts documents into
    # rows, so a row is a chunk of one or more documents. Fidelity's intervals resample them.
    document_ids: torch.Tensor
    warnings: tuple[str, ...] = ()

    @classmethod
    def from_rows(cls, input_ids: torch.Tensor, sources: tuple[str, ...]) -> Samples:
        """Token rows whose documents are not known (ids a benchmark saved or drew at random), each
        row numbered its own document: for calibration, which reads no document numbers."""
        import torch

        rows, seq_len = input_ids.shape
        return cls(input_ids, sources, rows, document_ids=torch.arange(rows).repeat_interleave(seq_len).reshape(rows, seq_len))

    @property
    def digest(self) -> str:
        import torch

        return hashlib.sha256(self.input_ids.to(torch.int64).numpy().tobytes()).hexdigest()[:16]

    def batches(self, batch_size: int) -> list[torch.Tensor]:
        return list(self.input_ids.split(batch_size))

    def describe(self) -> dict[str, Any]:
        count, seq_len = self.input_ids.shape
        out = {"samples": count, "seq_len": seq_len, "tokens": count * seq_len, "sources": list(self.sources), "documents": self.documents_used, "token_digest": self.digest}
        return out | ({"warnings": list(self.warnings)} if self.warnings else {})


def pack(tokenizer: Any, documents: Iterable[Document], samples: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Concatenate the documents' tokens and cut ``samples`` rows of ``seq_len``; returns the
    token ids and, per token, the number of its document (the last one + 1 is the count used)."""
    if samples < 1 or seq_len < 2:
        raise ConfigError(f"need samples >= 1 and seq_len >= 2, got {samples} x {seq_len}")
    needed = samples * seq_len
    stream: list[int] = []
    owners: list[int] = []
    used = 0
    for document in documents:
        if len(stream) >= needed:
            break
        ids = tokenizer(render(tokenizer, document), add_special_tokens=False)["input_ids"]
        stream += ids
        owners += [used] * len(ids)
        used += 1
    if len(stream) < needed:
        raise ConfigError(f"the text gives {len(stream):,} tokens but {samples} x {seq_len} = {needed:,} are needed; add text files or ask for fewer samples", option="text_files")
    import torch

    shape = (samples, seq_len)
    return torch.tensor(stream[:needed], dtype=torch.int64).reshape(shape), torch.tensor(owners[:needed], dtype=torch.int64).reshape(shape)


def load_samples(
    tokenizer: Any,
    *,
    samples: int,
    seq_len: int,
    text_files: Sequence[str | Path] = (),
    split: str = "calibration",
    builtin: bool = True,
) -> Samples:
    """User files first (in the order given), then the built-in corpus's ``split`` when they run out.
    ``sources`` names the built-in corpus only when a document of it was used."""
    user_documents = file_documents(text_files)
    documents: Iterable[Document] = user_documents
    if builtin:
        documents = itertools.chain(user_documents, builtin_documents(split))
    ids, owners = pack(tokenizer, documents, samples, seq_len)
    used = int(owners[-1, -1]) + 1
    sources = [Path(p).name for p in text_files]
    if used > len(user_documents):
        sources.append(f"builtin:{split}")
    return Samples(ids, tuple(sources), used, document_ids=owners)


def load_tokenizer(path: str | Path) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"no usable tokenizer at {path} ({exc}); give a tokenizer directory", file=str(path), option="tokenizer") from None
