"""Recipes as data: which scheme each component (or name pattern) gets, and what to ignore.

A recipe is a TOML file (see ``recipes/*.toml``)::

    name = "nvfp4-experts-fp8-attn"
    [[rules]]
    components = ["routed_experts"]      # layout components (checkpoint/layouts/*.toml)
    modules = ["re:.*experts\\.1\\d\\..*"]  # optional: narrow by module name ("re:" regex or exact)
    scheme = "nvfp4"                     # nvfp4 | nvfp4a16 | fp8 | fp8_dynamic
    ignore = ["re:.*g_proj$"]            # optional: modules this rule must leave alone
    [kv_cache]
    scheme = "fp8"                       # optional: FP8 KV cache with calibrated k/v scales

Errors (before any work starts): unknown keys, components or schemes; a rule that targets
nothing in the checkpoint; a module two rules claim (ambiguous).
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from fp4forge.checkpoint.codecs import writable_schemes
from fp4forge.checkpoint.layout import quantizable_components
from fp4forge.errors import ConfigError

SCHEMES = writable_schemes()  # the schemes whose codec writes (checkpoint/codecs.py)
KV_SCHEMES = ("fp8",)


@dataclass(frozen=True)
class NamePattern:
    text: str

    def matches(self, module: str) -> bool:
        if self.text.startswith("re:"):
            return re.fullmatch(self.text[3:], module) is not None
        return module == self.text


@dataclass(frozen=True)
class Rule:
    components: tuple[str, ...]
    scheme: str
    modules: tuple[NamePattern, ...] = ()
    ignore: tuple[NamePattern, ...] = ()

    def claims(self, module: str, component: str) -> bool:
        if component not in self.components:
            return False
        if self.modules and not any(p.matches(module) for p in self.modules):
            return False
        return not any(p.matches(module) for p in self.ignore)

    def describe(self) -> str:
        return f"{self.scheme} on {'+'.join(self.components)}"


@dataclass(frozen=True)
class Recipe:
    name: str
    description: str
    rules: tuple[Rule, ...]
    kv_cache_scheme: str | None = None
    source: str = ""
    text: str = field(default="", repr=False)


def builtin_recipe_names() -> list[str]:
    directory = resources.files("fp4forge.quantize").joinpath("recipes")
    return sorted(e.name[: -len(".toml")] for e in directory.iterdir() if e.name.endswith(".toml"))


def load_recipe(name_or_path: str | Path) -> Recipe:
    """A built-in recipe by name, or a TOML file by path."""
    path = Path(name_or_path)
    if path.suffix == ".toml" and path.is_file():
        text, source = path.read_text(encoding="utf-8"), str(path)
    elif str(name_or_path) in builtin_recipe_names():
        text = resources.files("fp4forge.quantize").joinpath("recipes", f"{name_or_path}.toml").read_text(encoding="utf-8")
        source = f"builtin:{name_or_path}"
    else:
        raise ConfigError(f"no recipe file or built-in recipe {str(name_or_path)!r}; built-in: {', '.join(builtin_recipe_names())}")
    return parse_recipe(text, source=source)


def _patterns(values: object, where: str) -> tuple[NamePattern, ...]:
    if values is None:
        return ()
    if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
        raise ConfigError(f"{where} must be a list of strings")
    for value in values:
        if value.startswith("re:"):
            try:
                re.compile(value[3:])
            except re.error as exc:
                raise ConfigError(f"{where}: bad regex {value!r}: {exc}") from None
    return tuple(NamePattern(v) for v in values)


def parse_recipe(text: str, *, source: str = "<string>") -> Recipe:
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"recipe {source} is not valid TOML: {exc}") from None
    unknown = set(doc) - {"name", "description", "rules", "kv_cache"}
    if unknown:
        raise ConfigError(f"recipe {source}: unknown keys {sorted(unknown)}")
    rules = []
    for number, raw in enumerate(doc.get("rules") or [], start=1):
        where = f"recipe {source}, rule {number}"
        extra = set(raw) - {"components", "scheme", "modules", "ignore"}
        if extra:
            raise ConfigError(f"{where}: unknown keys {sorted(extra)}")
        components = raw.get("components")
        if not components or not isinstance(components, list):
            raise ConfigError(f"{where}: `components` must be a non-empty list")
        bad = [c for c in components if c not in quantizable_components()]
        if bad:
            raise ConfigError(f"{where}: components {bad} cannot be quantized; choose from {list(quantizable_components())}")
        if raw.get("scheme") not in SCHEMES:
            raise ConfigError(f"{where}: scheme {raw.get('scheme')!r} is not one of {list(SCHEMES)}")
        rules.append(
            Rule(
                components=tuple(components),
                scheme=raw["scheme"],
                modules=_patterns(raw.get("modules"), f"{where} modules"),
                ignore=_patterns(raw.get("ignore"), f"{where} ignore"),
            )
        )
    if not rules:
        raise ConfigError(f"recipe {source} has no rules")
    kv = doc.get("kv_cache")
    kv_scheme = None
    if kv is not None:
        if not isinstance(kv, dict) or set(kv) != {"scheme"} or kv["scheme"] not in KV_SCHEMES:
            raise ConfigError(f"recipe {source}: [kv_cache] must be exactly scheme = one of {list(KV_SCHEMES)}")
        kv_scheme = kv["scheme"]
    return Recipe(
        name=str(doc.get("name") or Path(source).stem),
        description=str(doc.get("description", "")),
        rules=tuple(rules),
        kv_cache_scheme=kv_scheme,
        source=source,
        text=text,
    )
