"""The expected-tensor skeleton of a config from name templates (package data), without torch or
transformers.

``skeletons/<model_type>.json`` lists, for one transformers model class (and the wrapper classes
that store it under another prefix), the tensors
``save_pretrained`` writes, in its order: plain names, and blocks repeated per decoder layer
(``{layer}``) and per routed expert (``{expert}``), each with a shape made of config values and a
condition deciding whether a layer or config has it (a dense or MoE layer, ``q_lora_rank`` set,
biases on, tied embeddings), and the conditions transformers' validation puts on the config
(``requires``). Shapes and conditions are small Python expressions over the config's
values, evaluated with no builtins.

The data covers exactly the configs it was written and tested for (``scripts/skeleton_templates.py``
prints transformers' own skeleton collapsed to templates, and compares an expansion with it;
tests/test_skeleton_data.py holds every corpus config and variations to transformers' skeleton).
Anything else answers None and the caller builds the skeleton with transformers: an unknown model
type or class, a config key the table does not list, a value of an unexpected type, a count past
:data:`MAX_COUNT`, an unusual dtype. A wrong expectation would be worse than a slow one.
"""

from __future__ import annotations

import ast
import json
from functools import cache
from pathlib import Path
from typing import Any

from fp4forge.errors import ConfigError

DATA_DIR = Path(__file__).parent / "skeletons"

# The skeleton holds one Python module per layer, expert and head even on the meta device: a
# config.json claiming 10^12 experts would exhaust memory before transformers says anything. Real
# models stay far below this (the largest MoEs have a few hundred experts, ~100 layers).
MAX_COUNT = 1 << 16

# PreTrainedConfig's own fields and spellings every config may carry; none shapes a tensor except
# the dtype (read below) and tie_word_embeddings (a field of every table that uses it).
GENERIC_KEYS = frozenset(
    {
        "architectures", "chunk_size_feed_forward", "dtype", "torch_dtype", "id2label", "is_encoder_decoder",
        "label2id", "output_hidden_states", "problem_type", "return_dict", "transformers_version", "model_type",
        "_name_or_path", "output_attentions", "use_return_dict",
    }
)  # fmt: skip
TEXT_PREFIX = "model."  # a text model's names, replaced by a wrapper's prefix (as checkpoint.skeleton does)
DTYPES = {None: "BF16", "bfloat16": "BF16", "float16": "F16", "float32": "F32", "float64": "F64"}


def check_counts(config: dict[str, Any], where: str = "") -> None:
    """Refuse a ``num_*`` / ``n_*`` count no model has (nested configs included)."""
    for key, value in config.items():
        if isinstance(value, dict):
            check_counts(value, f"{where}{key}.")
        elif key.startswith(("num_", "n_")) and type(value) is int and value > MAX_COUNT:
            raise ConfigError(f"config.json: {where}{key} = {value:,} exceeds {MAX_COUNT:,}; no model has that many")


# -- expressions ----------------------------------------------------------------------------------
_ALLOWED_NODES = (
    ast.Expression, ast.Name, ast.Load, ast.Constant, ast.BinOp, ast.Add, ast.Sub, ast.Mult, ast.FloorDiv,
    ast.Mod, ast.Compare, ast.Eq, ast.NotEq, ast.Lt, ast.LtE, ast.Gt, ast.GtE, ast.Is, ast.IsNot, ast.In,
    ast.NotIn, ast.BoolOp, ast.And, ast.Or, ast.UnaryOp, ast.Not, ast.IfExp, ast.Subscript, ast.List, ast.Set,
    ast.Call,  # only the functions in _FUNCTIONS exist to be called: config values are JSON data
)  # fmt: skip


@cache
def _compiled(expression: str):
    tree = ast.parse(expression, mode="eval")
    for node in ast.walk(tree):
        if not isinstance(node, _ALLOWED_NODES):
            raise TypeError(f"skeleton data: {type(node).__name__} not allowed in {expression!r}")
    return compile(tree, f"<skeleton {expression}>", "eval")


_FUNCTIONS = {"__builtins__": {}, "len": len, "set": set}


def _eval(expression: str | int, values: dict[str, Any]) -> Any:
    if isinstance(expression, int):
        return expression
    return eval(_compiled(expression), _FUNCTIONS, values)  # whitelisted nodes, no other builtins


# -- tables ---------------------------------------------------------------------------------------
@cache
def table(model_type: str) -> dict[str, Any] | None:
    path = DATA_DIR / f"{model_type}.json"
    if "/" in model_type or "\\" in model_type or model_type.startswith(".") or not path.is_file():
        return None
    return json.loads(path.read_text(encoding="utf-8"))


def model_types() -> list[str]:
    return sorted(p.stem for p in DATA_DIR.glob("*.json"))


def _same_kind(value: Any, default: Any) -> bool:
    """``value`` may stand where transformers' default ``default`` stands (by its Python type)."""
    if default is None:
        return True  # the field's type is not known from its default: the table reads it or it shapes nothing
    if isinstance(default, bool):
        return type(value) is bool
    if isinstance(default, int):
        return type(value) is int
    if isinstance(default, float):
        return type(value) in (int, float)
    if isinstance(default, str):
        return isinstance(value, str)
    return isinstance(value, type(default))


def _values(spec: dict[str, Any], config: dict[str, Any]) -> dict[str, Any] | None:
    """The config's values over the table's defaults, derived values added; None when the table
    does not cover this config."""
    fields: dict[str, Any] = spec["fields"]
    extra = frozenset(spec.get("extra_keys", ()))
    values = dict(fields)
    for key, value in config.items():
        if key in fields:
            if value is not None and not _same_kind(value, fields[key]):
                return None
            if value is None and key not in spec.get("nullable", ()):
                return None
            values[key] = value
        elif key not in GENERIC_KEYS and key not in extra:
            return None  # a key this table was not tested with
    for key in spec.get("positive", ()):
        value = values.get(key)
        if value is not None and (type(value) is not int or value <= 0):
            return None
    for key in spec.get("natural", ()):
        value = values.get(key)
        if type(value) is not int or value < 0:
            return None
    for name, expression in spec.get("derived", ()):
        values[name] = _eval(expression, values)
    if not all(_eval(expression, values) for expression in spec.get("requires", ())):
        return None  # transformers' own validation would refuse it, in its words
    return values


def _dtype(config: dict[str, Any]) -> str | None:
    dtype, torch_dtype = config.get("dtype"), config.get("torch_dtype")
    if dtype is not None and torch_dtype is not None and dtype != torch_dtype:
        return None
    chosen = dtype if dtype is not None else torch_dtype
    return DTYPES.get(chosen) if chosen is None or isinstance(chosen, str) else None


def expected_rows(config: dict[str, Any]) -> list[tuple[str, str, tuple[int, ...]]] | None:
    """[(name, dtype, shape)] of what save_pretrained writes for ``config`` (its
    quantization_config already removed), in save_pretrained's order; None when the tables do not
    cover the config (then: transformers)."""
    model_type = config.get("model_type")
    spec = table(model_type) if isinstance(model_type, str) else None
    if spec is None:
        return None
    config = {k: v for k, v in config.items() if not k.startswith("_fp4forge")}
    architectures = config.get("architectures")
    wrappers: dict[str, str] = spec.get("wrappers", {})
    prefix = None
    if architectures is not None:
        named = architectures[0] if isinstance(architectures, list) and architectures else None
        if named in wrappers:  # a vision-language class over a text config: its text model's prefix
            prefix = wrappers[named]
        elif named not in spec["classes"]:
            return None
    try:
        check_counts(config)
    except ConfigError:
        return None  # transformers' path says so, in its words
    dtype = _dtype(config)
    if dtype is None:
        return None
    try:
        values = _values(spec, config)
        if values is None:
            return None
        rows: list[tuple[str, str, tuple[int, ...]]] = []
        _expand(spec["tensors"], values, dtype, rows)
    except (TypeError, ValueError, KeyError, ZeroDivisionError, IndexError):
        return None  # a value the expressions cannot use: transformers decides
    for _, _, shape in rows:
        for dim in shape:
            if type(dim) is not int or dim < 0:
                return None
    if prefix is not None:
        rows = [(prefix + name[len(TEXT_PREFIX):] if name.startswith(TEXT_PREFIX) else name, dtype, shape) for name, dtype, shape in rows]
    return rows


def _expand(entries: list[dict[str, Any]], values: dict[str, Any], dtype: str, rows: list) -> None:
    for entry in entries:
        when = entry.get("when")
        if when is not None and not _eval(when, values):
            continue
        if "layers" in entry:
            for layer in range(_eval(entry["layers"], values)):
                values["layer"] = layer
                _expand(entry["tensors"], values, dtype, rows)
            values.pop("layer", None)
            continue
        name = entry["name"]
        shape = tuple(_eval(dim, values) for dim in entry["shape"])
        tensor_dtype = entry.get("dtype", dtype)
        if "experts" in entry:
            count = _eval(entry["experts"], values)
            head, _, tail = name.format(layer=values.get("layer"), expert="\0").partition("\0")
            rows.extend((f"{head}{expert}{tail}", tensor_dtype, shape) for expert in range(count))  # 10^4 names: no format() each
        else:
            rows.append((name.format(layer=values.get("layer")), tensor_dtype, shape))
