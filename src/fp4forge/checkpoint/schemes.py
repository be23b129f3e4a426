"""Which tensors a quantization scheme stores, per layout (data in ``layouts/_schemes.toml``)."""

from __future__ import annotations

import tomllib
from functools import lru_cache
from importlib import resources

from fp4forge.checkpoint.writer import TensorSpec
from fp4forge.errors import ConfigError

# numerics.nvfp4's NVFP4_BLOCK, repeated: this module plans the deep audit before torch is imported,
# and importing anything of numerics imports torch (tests/test_architecture.py keeps the two equal).
NVFP4_BLOCK = 16
LAYOUTS = ("compressed-tensors", "modelopt")  # the layouts fp4forge writes; _schemes.toml also describes formats it only reads


@lru_cache(maxsize=1)
def scheme_table() -> dict[str, dict[str, dict[str, dict]]]:
    text = resources.files("fp4forge.checkpoint").joinpath("layouts", "_schemes.toml").read_text(encoding="utf-8")
    return tomllib.loads(text)


def _resolve_dim(symbol: int | str, out_features: int, in_features: int, block: tuple[int, int] | None = None) -> int:
    if isinstance(symbol, int):
        return symbol
    if symbol in ("out_wblocks", "in_wblocks"):
        if block is None:
            raise ConfigError("a block-wise scheme needs its block size (weight_block_size / block_structure)")
        return -(-out_features // block[0]) if symbol == "out_wblocks" else -(-in_features // block[1])
    return {"out": out_features, "in": in_features, "in_half": in_features // 2, "in_blocks": in_features // NVFP4_BLOCK}[symbol]


def resolve_shape(symbols: list, out_features: int, in_features: int, block: tuple[int, int] | None = None) -> tuple[int, ...]:
    """A table entry's shape for a Linear [out, in]."""
    return tuple(_resolve_dim(d, out_features, in_features, block) for d in symbols)


def linear_tensor_specs(layout: str, scheme: str, module: str, out_features: int, in_features: int, block: tuple[int, int] | None = None) -> list[TensorSpec]:
    """The tensors `<module>.*` that `scheme` stores in `layout` for a Linear [out, in]
    (``block``: [out, in] values per scale of a block-wise scheme)."""
    try:
        entries = scheme_table()[layout][scheme]
    except KeyError:
        raise ConfigError(f"no scheme {scheme!r} for layout {layout!r}") from None
    if any("in_blocks" in entry["shape"] for entry in entries.values()) and in_features % NVFP4_BLOCK:  # scales per 16 inputs
        raise ConfigError(f"{module}: input size {in_features} is not a multiple of {NVFP4_BLOCK} (NVFP4 block)")
    return [
        TensorSpec(f"{module}.{suffix}", entry["dtype"], resolve_shape(entry["shape"], out_features, in_features, block))
        for suffix, entry in entries.items()
    ]


def kv_scale_specs(layout: str, layer_prefix: str) -> list[TensorSpec]:
    """KV-cache scale tensors for one attention layer (`layer_prefix` = `model.layers.N`)."""
    entries = scheme_table()[layout]["kv"]
    return [TensorSpec(f"{layer_prefix}.{entry['on']}.{suffix}", entry["dtype"], tuple(entry["shape"])) for suffix, entry in entries.items()]


def role_suffixes(layout: str, scheme: str) -> dict[str, str]:
    """role (packed, block_scale, global_scale, input_scale, weight, weight_scale) -> tensor suffix."""
    try:
        entries = scheme_table()[layout][scheme]
    except KeyError:
        raise ConfigError(f"no scheme {scheme!r} for layout {layout!r}") from None
    return {entry["role"]: suffix for suffix, entry in entries.items()}


@lru_cache(maxsize=None)
def role_entries(layout: str, scheme: str) -> dict[str, dict]:
    """role -> the table's entry (``suffix`` added: the tensor name's last part) of ``scheme`` in
    ``layout`` (cached: callers must not change it)."""
    try:
        entries = scheme_table()[layout][scheme]
    except KeyError:
        raise ConfigError(f"no scheme {scheme!r} for layout {layout!r}") from None
    return {entry["role"]: {**entry, "suffix": suffix} for suffix, entry in entries.items()}


def kv_role_names(layout: str, layer_prefix: str) -> dict[str, TensorSpec]:
    """`k_scale` / `v_scale` role -> the spec of that layer's tensor in this layout."""
    entries = scheme_table()[layout]["kv"]
    return {
        entry["role"]: TensorSpec(f"{layer_prefix}.{entry['on']}.{suffix}", entry["dtype"], tuple(entry["shape"]))
        for suffix, entry in entries.items()
    }
