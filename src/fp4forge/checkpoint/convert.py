"""Convert a compressed-tensors NVFP4 checkpoint (what llm-compressor writes) into the ModelOpt
HF layout, streaming one tensor at a time (docs/formats.md#nvfp4-global-scale,
docs/formats.md#compressed-tensors-layout, docs/formats.md#modelopt-layout).

Per quantized Linear ``<m>``:

=============================  ==================================  ==================================
compressed-tensors             ModelOpt                            value
=============================  ==================================  ==================================
``<m>.weight_packed`` U8        ``<m>.weight`` U8 ``[out, in/2]``    identical bytes
``<m>.weight_scale`` F8_E4M3    ``<m>.weight_scale`` F8_E4M3         identical bytes
``<m>.weight_global_scale`` [1] ``<m>.weight_scale_2`` F32 ``[]``    ``1 / x`` (amax/2688 convention)
``<m>.input_global_scale`` [1]  ``<m>.input_scale`` F32 ``[]``       ``1 / x``
``<a>.k_scale`` / ``v_scale``   ``<a>.k_proj.k_scale`` / ``v_proj``  same value (amax/448), as F32 ``[]``
=============================  ==================================  ==================================

Everything else (BF16 weights, norms, router, ``e_score_correction_bias``) is copied unchanged.
``config.json`` gets a ModelOpt ``quantization_config`` and ``hf_quant_config.json`` is
written (docs/formats.md#modelopt-declaration); tokenizer, chat-template and generation files are copied.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from fp4forge.checkpoint.reader import TORCH_DTYPES, Checkpoint, open_checkpoint
from fp4forge.checkpoint.declarations import CT, MODELOPT, MODELOPT_ALGOS, MODELOPT_FP8_KV_SCHEME
from fp4forge.checkpoint.names import CONFIG_JSON, HF_QUANT_CONFIG_JSON, INDEX_JSON
from fp4forge.checkpoint.writer import DEFAULT_MAX_SHARD_BYTES, CheckpointWriter, TensorSpec
from fp4forge.errors import ConfigError

NVFP4_GROUP_SIZE = 16
# Files never copied verbatim: rewritten (config), regenerated (index, shards) or CT-only.
_NOT_COPIED = {CONFIG_JSON, INDEX_JSON, HF_QUANT_CONFIG_JSON}
_KV_CT = re.compile(r"^(?P<attn>.+\.self_attn)\.(?P<kv>[kv])_scale$")


# -- pure numerics -------------------------------------------------------------------------------
def ct_global_to_modelopt_scale(global_scale):
    """CT's per-tensor ``*_global_scale`` (2688/amax, F32 ``[1]``) -> ModelOpt's scalar
    (amax/2688, F32 ``[]``): the IEEE fp32 reciprocal, correctly rounded."""
    import torch

    if global_scale.numel() != 1:
        raise ConfigError(f"a per-tensor global scale must hold one value, got shape {list(global_scale.shape)}")
    value = global_scale.to(torch.float32).reshape(())
    if not (torch.isfinite(value) and value > 0):
        raise ConfigError(f"global scale {value.item()} is not a positive finite number; its inverse is no scale")
    return torch.reciprocal(value)


def modelopt_scale_to_ct_global(scale):
    """Inverse of :func:`ct_global_to_modelopt_scale`: ModelOpt scalar -> CT F32 ``[1]``."""
    import torch

    return torch.reciprocal(scale.to(torch.float32).reshape(1))


def kv_scale_to_modelopt(scale):
    """CT per-tensor KV scale (model dtype, ``[1]``) -> ModelOpt F32 scalar. Both are amax/448."""
    import torch

    if scale.numel() != 1:
        raise ConfigError(f"only per-tensor KV scales convert to ModelOpt, got shape {list(scale.shape)}")
    return scale.to(torch.float32).reshape(())


# -- names ---------------------------------------------------------------------------------------
class Mapping(NamedTuple):
    src: str
    dst: str
    dtype: str
    shape: tuple[int, ...]
    op: str  # copy | invert | kv


def map_tensor(name: str, dtype: str, shape: tuple[int, ...]) -> Mapping | None:
    """Where one CT tensor goes in the ModelOpt layout (None: dropped)."""
    if name.endswith(".weight_packed"):
        return Mapping(name, name[: -len("_packed")], dtype, shape, "copy")
    if name.endswith(".weight_global_scale"):
        return Mapping(name, name[: -len("weight_global_scale")] + "weight_scale_2", "F32", (), "invert")
    if name.endswith(".input_global_scale"):
        return Mapping(name, name[: -len("input_global_scale")] + "input_scale", "F32", (), "invert")
    match = _KV_CT.match(name)
    if match:
        kv = match["kv"]
        return Mapping(name, f"{match['attn']}.{kv}_proj.{kv}_scale", "F32", (), "kv")
    if name.endswith((".k_zero_point", ".v_zero_point", ".q_zero_point")):
        return None  # symmetric FP8 KV: zero points carry nothing, and ModelOpt has no such tensor
    return Mapping(name, name, dtype, shape, "copy")


# -- config --------------------------------------------------------------------------------------
def _is_nvfp4_args(args: dict[str, Any] | None) -> bool:
    return bool(args) and (
        args.get("num_bits") == 4
        and args.get("type") == "float"
        and args.get("strategy") == "tensor_group"
        and args.get("group_size") == NVFP4_GROUP_SIZE
        and args.get("symmetric", True)
    )


def ct_quant_algo(qc: dict[str, Any]) -> str:
    """``NVFP4`` (W4A4) or ``W4A16_NVFP4`` from a CT quantization_config; refuses anything else."""
    if qc.get("quant_method") != CT:
        raise ConfigError(f"not a compressed-tensors checkpoint (quant_method {qc.get('quant_method')!r})")
    groups = qc.get("config_groups") or {}
    if not groups:
        raise ConfigError("compressed-tensors quantization_config has no config_groups")
    algos = set()
    for name, group in groups.items():
        if not _is_nvfp4_args(group.get("weights")):
            raise ConfigError(f"config group {name!r} is not NVFP4 (4-bit float, tensor_group, group_size 16)")
        inputs = group.get("input_activations")
        if inputs is not None and not _is_nvfp4_args(inputs):
            raise ConfigError(f"config group {name!r}: activations are neither NVFP4 nor unquantized")
        algos.add(MODELOPT_ALGOS["nvfp4"] if inputs is not None else MODELOPT_ALGOS["nvfp4a16"])
    if len(algos) != 1:
        raise ConfigError(f"config groups mix W4A4 and W4A16 ({sorted(algos)}); ModelOpt needs one quant_algo")
    return algos.pop()


def kv_cache_algo(qc: dict[str, Any]) -> str | None:
    kv = qc.get("kv_cache_scheme")
    if kv is None:
        return None
    if kv.get("type") == "float" and kv.get("num_bits") == 8 and kv.get("strategy", "tensor") == "tensor":
        return "FP8"
    raise ConfigError(f"KV-cache scheme {kv} has no ModelOpt equivalent (only FP8 per-tensor converts)")


def expand_ignore(ignore: list[str], modules: list[str]) -> list[str]:
    """CT ``ignore`` -> ModelOpt ``exclude_modules``: exact names stay; each ``re:`` pattern is
    replaced by the checkpoint's module names it matches (CT matches with ``re.match``), since
    ModelOpt's list holds fnmatch wildcards, not regexes."""
    out: list[str] = []
    for entry in ignore:
        if entry.startswith("re:"):
            pattern = re.compile(entry[3:])
            out.extend(m for m in modules if pattern.match(m))
        else:
            out.append(entry)
    return list(dict.fromkeys(out))


def modelopt_quantization_config(quant_algo: str, kv_algo: str | None, exclude: list[str], producer: dict[str, str]) -> dict[str, Any]:
    """config.json ``quantization_config`` in ModelOpt's form (``convert_hf_quant_config_format``)."""
    weights = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": NVFP4_GROUP_SIZE}
    group: dict[str, Any] = {"weights": weights, "targets": ["Linear"]}
    if quant_algo == MODELOPT_ALGOS["nvfp4"]:
        group["input_activations"] = dict(weights)
    config: dict[str, Any] = {
        "config_groups": {"group_0": group},
        "ignore": exclude,
        "quant_algo": quant_algo,
        "producer": producer,
        "quant_method": MODELOPT,
    }
    if kv_algo == "FP8":
        config["kv_cache_scheme"] = dict(MODELOPT_FP8_KV_SCHEME)
    return config


def hf_quant_config(quant_algo: str, kv_algo: str | None, exclude: list[str], producer: dict[str, str]) -> dict[str, Any]:
    """``hf_quant_config.json``; vLLM requires group_size, kv_cache_quant_algo, exclude_modules
    (docs/formats.md#modelopt-declaration)."""
    return {
        "producer": producer,
        "quantization": {
            "quant_algo": quant_algo,
            "kv_cache_quant_algo": kv_algo,
            "group_size": NVFP4_GROUP_SIZE,
            "exclude_modules": exclude,
        },
    }


def _producer() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return {"name": "fp4forge", "version": version("fp4forge")}
    except PackageNotFoundError:
        return {"name": "fp4forge", "version": "unknown"}


# -- conversion ----------------------------------------------------------------------------------
def plan(ckpt: Checkpoint) -> list[Mapping]:
    mappings = []
    for _, info in ckpt.tensors():
        mapping = map_tensor(info.name, info.dtype, tuple(info.shape))
        if mapping is not None:
            mappings.append(mapping)
    seen: dict[str, str] = {}
    for m in mappings:
        if m.dst in seen:
            raise ConfigError(f"both {seen[m.dst]!r} and {m.src!r} would become {m.dst!r}")
        seen[m.dst] = m.src
    names = {m.src for m in mappings}
    for m in mappings:  # a packed weight without its FP8 block scale is not NVFP4
        if m.src.endswith(".weight_packed") and m.src[: -len("_packed")] + "_scale" not in names:
            raise ConfigError("packed weight without weight_scale", tensor=m.src)
    return mappings


def ct_nvfp4_to_modelopt(src_dir: str | Path, out_dir: str | Path, *, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> Path:
    """Write the ModelOpt-layout equivalent of the compressed-tensors NVFP4 checkpoint ``src_dir``."""
    src_dir, out_dir = Path(src_dir), Path(out_dir)
    ckpt = open_checkpoint(src_dir)
    config = dict(ckpt.config or {})
    qc = config.get("quantization_config")
    if not qc:
        raise ConfigError("config.json has no quantization_config", file=str(src_dir / CONFIG_JSON))
    quant_algo = ct_quant_algo(qc)
    kv_algo = kv_cache_algo(qc)
    mappings = plan(ckpt)
    modules = sorted({m.src.rpartition(".")[0] for m in mappings})
    exclude = expand_ignore(list(qc.get("ignore") or []), modules)
    producer = _producer()
    config["quantization_config"] = modelopt_quantization_config(quant_algo, kv_algo, exclude, producer)

    specs = [TensorSpec(m.dst, m.dtype, m.shape) for m in mappings]
    with CheckpointWriter(out_dir, specs, max_shard_bytes=max_shard_bytes) as writer:
        for m in mappings:
            tensor = ckpt.read_tensor(m.src)
            if m.op == "invert":
                tensor = ct_global_to_modelopt_scale(tensor)
            elif m.op == "kv":
                tensor = kv_scale_to_modelopt(tensor)
            writer.write(m.dst, tensor)
            del tensor
        writer.write_json(CONFIG_JSON, config)
        writer.write_json(HF_QUANT_CONFIG_JSON, hf_quant_config(quant_algo, kv_algo, exclude, producer))
        for path in sorted(src_dir.iterdir()):
            if path.is_file() and path.name not in _NOT_COPIED and not path.name.endswith(".safetensors"):
                writer.copy_file(path)
    return out_dir


# -- block-wise FP8 as a source: the release seen as the BF16 model it was made from ---------------
BLOCK_FP8_SCALE_SUFFIX = ".weight_scale_inv"


@dataclass
class BlockFp8Source(Checkpoint):
    """A block-wise FP8 release (DeepSeek-V3/R1, Qwen *-FP8: ``quant_method: fp8`` with
    ``weight_block_size``; ``<m>.weight`` F8_E4M3 and ``<m>.weight_scale_inv`` F32, one scale per
    [block_out, block_in] block) read as BF16: each FP8 weight dequantized the way DeepSeek's own
    ``fp8_cast_bf16`` does it, ``float32(code) * float32(scale_inv)`` per block then rounded once to
    BF16; its scale tensor hidden; ``quantization_config`` dropped from the config. Every other
    tensor reads as stored."""

    block: tuple[int, int] = (128, 128)
    fp8_weights: dict[str, str] = field(default_factory=dict)  # weight name -> its scale_inv name
    stored_config: dict[str, Any] | None = None

    @property
    def dequantized_from(self) -> dict[str, Any]:
        return {"format": "fp8 block-wise", "weight_block_size": list(self.block), "weights": len(self.fp8_weights), "dequantized_to": "BF16"}

    def tensors(self):
        hidden = set(self.fp8_weights.values())
        for shard, info in super().tensors():
            if info.name in hidden:
                continue
            if info.name in self.fp8_weights:
                info = info._replace(dtype="BF16", end=info.begin + 2 * info.numel)
            yield shard, info

    def reads_as_stored(self, name: str) -> bool:
        return name not in self.fp8_weights

    def read_tensor(self, name: str):
        if name not in self.fp8_weights:
            return super().read_tensor(name)
        import torch

        from fp4forge.numerics.fp8 import Fp8Weight, fp8_dequantize_weight

        weight = self._stored(name)
        scale = self._stored(self.fp8_weights[name]).to(torch.float32)
        return fp8_dequantize_weight(Fp8Weight(weight, scale, "block", self.block), torch.bfloat16)

    def _stored(self, name: str):
        """A tensor as stored (the base reader's read_tensor would come back through read_raw)."""
        import torch

        _, info = self.locate(name)
        dtype = getattr(torch, TORCH_DTYPES[info.dtype])
        return torch.frombuffer(bytearray(Checkpoint.read_raw(self, name)), dtype=dtype).reshape(list(info.shape))

    def read_raw(self, name: str) -> bytes:
        if name not in self.fp8_weights:
            return super().read_raw(name)
        import torch

        return self.read_tensor(name).contiguous().view(torch.uint8).numpy().tobytes()


def dequantized_source(ckpt: Checkpoint) -> Checkpoint:
    """``ckpt`` itself, unless it declares block-wise FP8: then a :class:`BlockFp8Source` over it.
    Refuses (named error) a block-FP8 declaration whose tensors do not fit it."""
    qc = (ckpt.config or {}).get("quantization_config")
    if not isinstance(qc, dict) or qc.get("quant_method") != "fp8" or qc.get("weight_block_size") is None:
        return ckpt
    block = qc["weight_block_size"]
    if not (isinstance(block, list) and len(block) == 2 and all(type(b) is int and b > 0 for b in block)):
        raise ConfigError(f"weight_block_size is {block!r}, not two positive integers", file=ckpt.display)
    infos = {info.name: info for _, info in ckpt.tensors()}
    pairs: dict[str, str] = {}
    for name, info in infos.items():
        if not name.endswith(BLOCK_FP8_SCALE_SUFFIX):
            continue
        weight = name[: -len(BLOCK_FP8_SCALE_SUFFIX)] + ".weight"
        stored = infos.get(weight)
        if stored is None or stored.dtype != "F8_E4M3" or len(stored.shape) != 2:
            raise ConfigError(f"{name} scales no F8_E4M3 2-D weight ({weight})", file=ckpt.display, tensor=name)
        expected = (-(-stored.shape[0] // block[0]), -(-stored.shape[1] // block[1]))
        if tuple(info.shape) != expected or info.dtype not in ("F32", "BF16"):
            raise ConfigError(f"{name} is {info.dtype}{list(info.shape)}; weight_block_size {block} needs F32{list(expected)}", file=ckpt.display, tensor=name)
        pairs[weight] = name
    unscaled = [n for n, i in infos.items() if i.dtype == "F8_E4M3" and n not in pairs]
    if unscaled:
        raise ConfigError(f"{len(unscaled)} F8_E4M3 tensors have no weight_scale_inv, e.g. {unscaled[0]}", file=ckpt.display, tensor=unscaled[0])
    config = {k: v for k, v in (ckpt.config or {}).items() if k != "quantization_config"}
    return BlockFp8Source(
        source=ckpt.source, shard_names=ckpt.shard_names, headers=ckpt.headers, index=ckpt.index, config=config,
        extra_json=ckpt.extra_json, shard_errors=ckpt.shard_errors,
        block=(block[0], block[1]), fp8_weights=pairs, stored_config=ckpt.config,
    )
