"""The files a server reads beside the weights, read the way transformers (and so vLLM) reads them:
the tokenizer (``tokenizer.json`` through the ``tokenizers`` library transformers' fast tokenizers
wrap), the chat template (rendered for a one-message chat in the Jinja sandbox transformers renders
it in, ``checkpoint/chat_template.py``), ``generation_config.json``
and the config's special-token ids against the vocabulary, the config's dtype against the stored
embeddings, ``tie_word_embeddings`` against the stored ``lm_head``, and the processor files of a
wrapper (vision) architecture.

A file that is absent is not checked and is said so once (``server-file-absent``, info): a
header-only rebuild of a release, or a model served with ``--tokenizer`` from elsewhere, has none.
A file that is present and broken is a finding of its own. Only small files are read (JSON and
templates), on demand; nothing here imports torch or transformers.
"""

from __future__ import annotations

from typing import Any

from fp4forge.audit.context import AuditContext, issue
from fp4forge.audit.findings import Issue
from fp4forge.checkpoint.chat_template import render_chat_template, special_tokens
from fp4forge.checkpoint.layout import split_suffix
from fp4forge.checkpoint.json_text import JsonTextError, load_json
from fp4forge.checkpoint.names import (
    CHAT_TEMPLATE_FILES,
    GENERATION_CONFIG_JSON,
    PROCESSOR_FILES,
    SPECIAL_TOKENS_MAP_JSON,
    TOKENIZER_CONFIG_JSON,
    TOKENIZER_FILES,
    TOKENIZER_JSON,
)

SPECIAL_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id")
# config.json's dtype spellings (transformers 5 writes ``dtype``, earlier versions ``torch_dtype``)
# as safetensors names the stored dtype.
CONFIG_DTYPES = {"bfloat16": "BF16", "float16": "F16", "half": "F16", "float32": "F32", "float": "F32"}
WRAPPER_SUFFIX = "ForConditionalGeneration"
# The smallest chat request, with its content as a string and as OpenAI content parts (vLLM
# passes whichever form it detects the template reads): a template that renders neither fails
# every chat request.
PROBE_CHATS = ([{"role": "user", "content": "Hello"}], [{"role": "user", "content": [{"type": "text", "text": "Hello"}]}])
_ABSENT = object()


def run(ctx: AuditContext) -> list[Issue]:
    config = ctx.ckpt.config
    if config is None:
        return []  # config-missing says it; every check here reads the config
    files = _ServerFiles(ctx)
    issues = files.absent_issues()
    issues += _tokenizer_issues(files, _vocab_size(config))
    issues += _chat_template_issues(files)
    issues += _special_id_issues(files, config)
    issues += _processor_issues(files)
    issues += _dtype_issues(ctx, config)
    issues += _tie_issues(ctx, config)
    return issues


class _ServerFiles:
    """The server's files of one checkpoint: existence asked once, JSON read once."""

    def __init__(self, ctx: AuditContext) -> None:
        self.source = ctx.ckpt.source
        self.architecture = (ctx.ckpt.config.get("architectures") or [""])[0]
        self._exists: dict[str, bool] = {}
        self._json: dict[str, Any] = {}

    def exists(self, name: str) -> bool:
        if name not in self._exists:
            self._exists[name] = self.source.exists(name)
        return self._exists[name]

    def json(self, name: str) -> Any:
        """The file's JSON object, None when absent, or a JsonTextError (kept, not raised)."""
        if name not in self._json:
            self._json[name] = _read_json_object(self.source, name) if self.exists(name) else None
        return self._json[name]

    def text(self, name: str) -> str:
        return self.source.read(name).decode("utf-8", errors="replace")

    @property
    def has_tokenizer(self) -> bool:
        return any(self.exists(name) for name in TOKENIZER_FILES)

    @property
    def is_wrapper(self) -> bool:
        return isinstance(self.architecture, str) and self.architecture.endswith(WRAPPER_SUFFIX)

    def absent_issues(self) -> list[Issue]:
        absent = []
        if not self.has_tokenizer:
            absent.append("tokenizer")
        if not self.exists(GENERATION_CONFIG_JSON):
            absent.append(GENERATION_CONFIG_JSON)
        if self.is_wrapper and not any(self.exists(name) for name in PROCESSOR_FILES):
            absent.append("processor files (" + ", ".join(PROCESSOR_FILES) + ")")
        return [issue("server-file-absent", "not checked, absent beside the weights", what) for what in absent]


def _read_json_object(source: Any, name: str) -> Any:
    raw = source.read(name)
    try:
        doc = load_json(raw)
    except JsonTextError as exc:
        return JsonTextError("a git-LFS pointer, not the file" if raw.startswith(b"version https://git-lfs") else exc.reason)
    return doc if isinstance(doc, dict) else JsonTextError(f"not a JSON object (a {type(doc).__name__})")


def _text_config(config: dict[str, Any]) -> dict[str, Any]:
    text = config.get("text_config")
    return text if isinstance(text, dict) else config


def _config_value(config: dict[str, Any], key: str) -> Any:
    """A key of the config, else of its text config (wrappers keep the language model's there)."""
    if key in config:
        return config[key]
    return _text_config(config).get(key, _ABSENT)


def _vocab_size(config: dict[str, Any]) -> int | None:
    value = _config_value(config, "vocab_size")
    return value if type(value) is int and value > 0 else None


# -- tokenizer and chat template ------------------------------------------------------------------
def _tokenizer_issues(files: _ServerFiles, vocab_size: int | None) -> list[Issue]:
    issues = []
    tokenizer_config = files.json(TOKENIZER_CONFIG_JSON)
    if isinstance(tokenizer_config, JsonTextError):
        issues.append(issue("tokenizer-unloadable", "tokenizer file transformers cannot read", TOKENIZER_CONFIG_JSON, file=TOKENIZER_CONFIG_JSON, detail=tokenizer_config.reason))
    highest = _added_token_ids(tokenizer_config)
    if files.exists(TOKENIZER_JSON):
        loaded = _load_fast_tokenizer(files.text(TOKENIZER_JSON))
        if isinstance(loaded, str):
            issues.append(issue("tokenizer-unloadable", "tokenizer file transformers cannot read", TOKENIZER_JSON, file=TOKENIZER_JSON, detail=loaded))
        else:
            highest += loaded
    if vocab_size is not None and highest and max(highest) >= vocab_size:
        issues.append(issue("tokenizer-vocab-exceeds-embedding", "token ids the embedding has no row for", f"highest id {max(highest):,}",
                            file=TOKENIZER_JSON if files.exists(TOKENIZER_JSON) else TOKENIZER_CONFIG_JSON, detail=f"vocab_size {vocab_size:,}"))
    return issues


def _load_fast_tokenizer(text: str) -> list[int] | str:
    """Every id the tokenizer can emit (vocabulary and added tokens), or why ``tokenizers`` (the
    library behind transformers' fast tokenizers) refuses the file."""
    from tokenizers import Tokenizer

    try:
        tokenizer = Tokenizer.from_str(text)
    except Exception as exc:  # noqa: BLE001 - the Rust library raises its own exception types for a bad file
        return " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
    return [max(tokenizer.get_vocab(with_added_tokens=True).values(), default=-1)]


def _added_token_ids(tokenizer_config: Any) -> list[int]:
    decoder = tokenizer_config.get("added_tokens_decoder") if isinstance(tokenizer_config, dict) else None
    return [int(key) for key in decoder if str(key).isdigit()] if isinstance(decoder, dict) else []


def _chat_templates(files: _ServerFiles) -> list[tuple[str, str | JsonTextError]]:
    """(where, template) of every chat template transformers would find."""
    found: list[tuple[str, str]] = []
    tokenizer_config = files.json(TOKENIZER_CONFIG_JSON)
    inline = tokenizer_config.get("chat_template") if isinstance(tokenizer_config, dict) else None
    if isinstance(inline, str):
        found.append((TOKENIZER_CONFIG_JSON, inline))
    elif isinstance(inline, list):  # named templates: [{"name": ..., "template": ...}]
        found += [(TOKENIZER_CONFIG_JSON, t["template"]) for t in inline if isinstance(t, dict) and isinstance(t.get("template"), str)]
    for name in CHAT_TEMPLATE_FILES:
        if files.exists(name):
            doc = files.json(name) if name.endswith(".json") else files.text(name)
            template = doc.get("chat_template") if isinstance(doc, dict) else doc
            found.append((name, template if isinstance(template, (str, JsonTextError)) else JsonTextError("no chat_template string")))
    return found


def _chat_template_issues(files: _ServerFiles) -> list[Issue]:
    if not files.has_tokenizer:
        return []  # server-file-absent says the tokenizer is not there
    templates = _chat_templates(files)
    if not templates:
        return [issue("chat-template-absent", "no chat template with the tokenizer", TOKENIZER_CONFIG_JSON, file=TOKENIZER_CONFIG_JSON)]
    tokens = special_tokens(files.json(TOKENIZER_CONFIG_JSON), files.json(SPECIAL_TOKENS_MAP_JSON))
    issues = []
    for where, template in templates:
        reason = template.reason if isinstance(template, JsonTextError) else _render_failure(template, tokens)
        if reason is not None:
            issues.append(issue("chat-template-invalid", "chat template transformers cannot render", where, file=where, detail=" ".join(reason.split())[:300]))
    return issues


def _render_failure(template: str, tokens: dict[str, str]) -> str | None:
    """None when the template renders one of the probe chats, else why the first one failed."""
    first = None
    for chat in PROBE_CHATS:
        try:
            render_chat_template(template, chat, add_generation_prompt=True, special_tokens=tokens)
            return None
        except Exception as exc:  # noqa: BLE001 - jinja2's TemplateSyntaxError, TemplateError, and what the template's own code raises
            first = first or f"{type(exc).__name__}: {exc}"
    return first


# -- generation config and special ids ------------------------------------------------------------
def _special_ids(doc: dict[str, Any]) -> list[tuple[str, Any]]:
    """(key, id) for every special-token id a config names (a list counts id by id)."""
    out = []
    for key in SPECIAL_ID_KEYS:
        value = doc.get(key)
        for one in value if isinstance(value, list) else [value]:
            if one is not None:
                out.append((key, one))
    return out


def _special_id_issues(files: _ServerFiles, config: dict[str, Any]) -> list[Issue]:
    issues = []
    generation = files.json(GENERATION_CONFIG_JSON)
    if isinstance(generation, JsonTextError):
        issues.append(issue("generation-config-invalid", "generation config transformers cannot read", GENERATION_CONFIG_JSON,
                            file=GENERATION_CONFIG_JSON, detail=generation.reason))
    vocab_size = _vocab_size(config)
    if vocab_size is None:
        return issues
    sources = [("config.json", _text_config(config)), ("config.json", config)] if _text_config(config) is not config else [("config.json", config)]
    if isinstance(generation, dict):
        sources.append((GENERATION_CONFIG_JSON, generation))
    seen = set()
    for where, doc in sources:
        for key, value in _special_ids(doc):
            bad = type(value) is not int or not 0 <= value < vocab_size
            if bad and (where, key, str(value)) not in seen:
                seen.add((where, key, str(value)))
                issues.append(issue("special-token-id-out-of-range", f"special-token ids outside the vocabulary (vocab_size {vocab_size:,})",
                                    f"{where} {key} = {value!r}", file=where))
    return issues


def _processor_issues(files: _ServerFiles) -> list[Issue]:
    issues = []
    for name in PROCESSOR_FILES:
        doc = files.json(name)
        if isinstance(doc, JsonTextError):
            issues.append(issue("processor-config-invalid", "processor file transformers cannot read", name, file=name, detail=doc.reason))
    return issues


# -- dtype and tied embeddings --------------------------------------------------------------------
def _component_tensors(ctx: AuditContext, component: str) -> list[str]:
    return [name for name, (module, _, _) in ctx.roles.items() if ctx.component(module) == component]


def _dtype_issues(ctx: AuditContext, config: dict[str, Any]) -> list[Issue]:
    """The embeddings are never quantized: their stored dtype is the one the config must name, or
    vLLM (``--dtype auto`` reads the config) casts every unquantized weight at load."""
    declared = _config_value(config, "dtype")
    if declared is _ABSENT or declared is None:
        declared = _config_value(config, "torch_dtype")
    expected = CONFIG_DTYPES.get(str(declared).removeprefix("torch.")) if isinstance(declared, str) else None
    embeddings = _component_tensors(ctx, "embeddings")
    stored = sorted({ctx.tensors[name][1].dtype for name in embeddings})
    if expected is None or not stored or stored == [expected]:
        return []
    return [issue("config-dtype-mismatch", "config dtype other than the stored embeddings'", f"{declared} declared, {'/'.join(stored)} stored",
                  file="config.json", tensors=embeddings)]


def _tie_issues(ctx: AuditContext, config: dict[str, Any]) -> list[Issue]:
    tied = _config_value(config, "tie_word_embeddings")
    if type(tied) is not bool or ctx.layout is None:
        return []  # absent: the model class's default decides, and the names check compares with it
    heads = _component_tensors(ctx, "lm_head")
    expected = ctx.expected_shapes
    if expected and bool(heads) == any(ctx.component(split_suffix(name)[0]) == "lm_head" for name in expected):
        return []  # the model class built from this config stores what is there (wrappers may read the flag elsewhere)
    if tied and heads:
        return [issue("tied-embeddings-mismatch", "tie_word_embeddings is true but an lm_head is stored", examples(heads), file="config.json", tensors=heads)]
    if not tied and not heads and _component_tensors(ctx, "embeddings"):
        return [issue("tied-embeddings-mismatch", "tie_word_embeddings is false but no lm_head is stored", "lm_head", file="config.json")]
    return []


def examples(names: list[str]) -> str:
    return ", ".join(sorted(names)[:3]) + (f" (+{len(names) - 3} more)" if len(names) > 3 else "")


# The generic name findings a tie mismatch explains: one root cause reported once.
TIE_KNOCK_ON_RULES = ("tensor-unexpected", "parameter-missing")


def without_knock_on(issues: list[Issue], ctx: AuditContext) -> list[Issue]:
    """Drop the unexpected/missing-tensor findings about lm_head that a tie mismatch explains."""
    if not any(i.rule == "tied-embeddings-mismatch" for i in issues):
        return issues

    def explained(i: Issue) -> bool:
        names = set(i.tensors) or {i.subject}
        return i.rule in TIE_KNOCK_ON_RULES and all(ctx.component(split_suffix(name)[0]) == "lm_head" for name in names)

    return [i for i in issues if not explained(i)]
