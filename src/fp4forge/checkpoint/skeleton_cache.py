"""The expected-tensor skeleton of a config, cached on disk so the audit skips building it.

Model classes fp4forge has name tables for (``skeleton_data``, ``skeletons/*.json``) expand
from the config in milliseconds, with no cache. For the others, building the skeleton imports
torch and transformers and instantiates the model on the meta device: most of an audit's time on
a large MoE. The result depends only on the config, the
transformers and torch versions and fp4forge's skeleton code, so it is stored under a hash of
those in ``$FP4FORGE_CACHE_DIR/skeletons`` (default ``~/.cache/fp4forge/skeletons``). Checking
the cache imports neither torch nor transformers.
"""

from __future__ import annotations

import json
import os
from functools import lru_cache
from operator import itemgetter
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fp4forge.checkpoint import skeleton_data
from fp4forge.errors import Fp4forgeError

if TYPE_CHECKING:
    from fp4forge.checkpoint.writer import TensorSpec

# hashlib, importlib.metadata and the writer are imported where the cache is used: a config the
# tables cover needs none of them (~0.07 s of an audit's start).

CACHE_VERSION = 1


def cache_dir() -> Path:
    root = os.environ.get("FP4FORGE_CACHE_DIR") or Path.home() / ".cache" / "fp4forge"
    return Path(root) / "skeletons"


def _version(dist: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "absent"


def cache_key(config: dict[str, Any], extra: tuple[str | int, ...] = ()) -> str:
    """Everything the skeleton depends on, hashed; ``extra``: what else a result cached beside it
    depends on (a version number, or the path of a module or data file of this package, relative
    to it, whose bytes are hashed)."""
    import hashlib

    def source_hash(file_name: str) -> str:
        return hashlib.sha256((Path(__file__).parent / file_name).read_bytes()).hexdigest()

    doc = {
        "cache": CACHE_VERSION,
        "config": config,
        "transformers": _version("transformers"),
        "torch": _version("torch"),
        "skeleton": source_hash("skeleton.py"),
    }
    if extra:
        doc["extra"] = [source_hash(item) if isinstance(item, str) and item.endswith((".py", ".json")) else item for item in extra]
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


def _read_rows(path: Path) -> list | None:
    """The cached [name, dtype, shape] rows, or None when absent or damaged (then: rebuild)."""
    try:
        rows = json.loads(path.read_text())
        if isinstance(rows, list) and all(map(_ROW_SHAPE.__eq__, map(len, rows))):
            return rows
    except (OSError, ValueError, TypeError):
        pass
    return None


_ROW_SHAPE = 3


def _read(path: Path) -> list[TensorSpec] | None:
    from fp4forge.checkpoint.writer import TensorSpec

    try:
        rows = _read_rows(path)
        return None if rows is None else [TensorSpec(name, dtype, tuple(shape)) for name, dtype, shape in rows]
    except (ValueError, TypeError):
        return None  # absent or damaged: rebuild


def write_json(path: Path, doc: Any) -> None:
    """Store a cached result; a read-only home only costs the next run the rebuild."""
    from fp4forge.checkpoint.atomic import write_text_atomic

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, json.dumps(doc, separators=(",", ":")))
    except OSError:
        pass


def _write(path: Path, specs: list[TensorSpec]) -> None:
    write_json(path, [[s.name, s.dtype, list(s.shape)] for s in specs])


def expected_tensor_specs(config: dict[str, Any], *, use_cache: bool = True) -> list[TensorSpec]:
    """:func:`fp4forge.checkpoint.skeleton.expected_tensor_specs`, through the on-disk cache."""
    path = cache_dir() / f"{cache_key(config)}.json"
    if use_cache:
        cached = _read(path)
        if cached is not None:
            return cached
    from fp4forge.checkpoint import skeleton

    specs = skeleton.expected_tensor_specs(config)
    if use_cache:
        _write(path, specs)
    return specs


def expected_shapes_or_reason(config: dict[str, Any], *, trust_remote_code: bool = False) -> tuple[dict[str, tuple[int, ...]] | None, str | None]:
    """({on-disk name: shape} of the unquantized model, None) or (None, why not): what the audit's
    name checks need, read from the cache without a TensorSpec per name (10^5 of them)."""
    return _shapes_for(json.dumps(config, sort_keys=True), trust_remote_code)


@lru_cache(maxsize=8)
def _shapes_for(config_json: str, trust_remote_code: bool) -> tuple[dict[str, tuple[int, ...]] | None, str | None]:
    if not trust_remote_code:
        config = json.loads(config_json)
        config.pop("quantization_config", None)
        expanded = skeleton_data.expected_rows(config)  # the tables, when they cover this config
        if expanded is not None:
            return dict(zip(map(itemgetter(0), expanded), map(itemgetter(2), expanded))), None
        rows = _read_rows(cache_dir() / f"{cache_key(config)}.json")
        if rows is not None:
            try:
                return dict(zip(map(itemgetter(0), rows), map(tuple, map(itemgetter(2), rows)))), None
            except TypeError:
                pass  # damaged: rebuilt below
    specs, reason = _expected_for(config_json, trust_remote_code)
    return (None, reason) if specs is None else ({spec.name: tuple(spec.shape) for spec in specs}, None)


@lru_cache(maxsize=8)
def _expected_for(config_json: str, trust_remote_code: bool) -> tuple[tuple[TensorSpec, ...] | None, str | None]:
    config = json.loads(config_json)
    config.pop("quantization_config", None)  # names are the unquantized model's
    try:
        # Remote code can change without the config changing: never served from the cache.
        return tuple(expected_tensor_specs(config, use_cache=not trust_remote_code)), None
    except Fp4forgeError as exc:
        return None, exc.message
    except (ImportError, ValueError, KeyError, TypeError, AttributeError) as exc:  # transformers' own complaints
        return None, f"{type(exc).__name__}: {exc}"
