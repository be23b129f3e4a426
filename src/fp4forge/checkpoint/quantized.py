"""The one reader of quantized Linears: a checkpoint (compressed-tensors or ModelOpt layout) seen
module by module.

:class:`QuantizedCheckpoint` answers, from the tensors on disk (their names, dtypes and shapes
against ``layouts/_schemes.toml``):

* which scheme each Linear is stored in (``nvfp4``, ``nvfp4a16``, ``fp8``, ``fp8_dynamic``, or
  ``unquantized``) and its logical shape;
* which quantized Linears are served as one GEMM (the fused groups: q/k/v, gate/up);
* the input amax a stored input scale stands for (compressed-tensors NVFP4 stores ``(6*448)/amax``,
  ModelOpt NVFP4 ``amax/(6*448)``, FP8 in both layouts ``amax/448``);
* the FP8 KV-cache scales;
* the dequantized weight, per module, by either formula: the inverse of the exporter (the
  layout's own decompress: compressed-tensors divides by its global scale) or vLLM's
  (``multiply`` by ``weight_scale_2 = fp32(1/global)``); and per GEMM as vLLM loads it, fused
  shards collapsed to one scale (:meth:`QuantizedCheckpoint.served_linear`,
  :meth:`QuantizedCheckpoint.served_experts`).

The fidelity evaluator, the reference forward pass and the tests read quantized weights through
it; the arithmetic itself is :mod:`fp4forge.numerics`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from fp4forge.checkpoint.codecs import Codec, Nvfp4Codec, codec
from fp4forge.checkpoint.declarations import detect_format
from fp4forge.checkpoint.names import natural_key
from fp4forge.checkpoint.reader import Checkpoint, HostAlloc, host_copy
from fp4forge.checkpoint.schemes import LAYOUTS, kv_role_names, scheme_table
from fp4forge.errors import ConfigError
from fp4forge.numerics.conventions import convention_rule
from fp4forge.numerics.fp8 import fp8_fake_quantize
from fp4forge.numerics.nvfp4 import DequantFormula, Nvfp4Weight, nvfp4_dequantize

UNQUANTIZED = "unquantized"
# Attention scale tensors that live beside a Linear's own (ModelOpt puts k_scale on k_proj).
KV_SUFFIXES = ("k_scale", "v_scale", "q_scale", "prob_scale")


@dataclass(frozen=True)
class QuantizedLinear:
    """One quantized Linear as stored: its scheme, and the tensor holding each role (packed,
    block_scale, global_scale, input_scale, weight, weight_scale; see ``_schemes.toml``)."""

    module: str
    scheme: str  # nvfp4 | nvfp4a16 | fp8 | fp8_dynamic
    names: dict[str, str]
    out_features: int
    in_features: int

    @property
    def codec(self) -> Codec:
        return codec(self.scheme)

    @property
    def family(self) -> str:
        """The weight format vLLM picks its kernel by (``nvfp4`` | ``fp8``)."""
        return self.codec.family

    @property
    def packs_fp4(self) -> bool:
        return isinstance(self.codec, Nvfp4Codec)


@dataclass(frozen=True)
class ServedLinear:
    """One quantized Linear as vLLM holds it after loading (fused shards collapsed)."""

    module: str
    family: str  # "nvfp4" | "fp8"
    weight: Tensor  # dequantized, float32
    act_scale: Tensor | None  # nvfp4: CT input global scale ((6*448)/amax) [1]; fp8: input scale (amax/448) [1]


@dataclass(frozen=True)
class ServedExperts:
    """One MoE layer's routed NVFP4 experts as vLLM holds them: fused gate/up and down."""

    module: str  # checkpoint prefix, e.g. model.layers.1.mlp.experts
    gate_up: Tensor  # [E, 2I, H] float32
    down: Tensor  # [E, H, I]
    gate_up_amax: Tensor | None  # [E, 2] input amax/(6*448) of gate and up
    down_amax: Tensor | None  # [E]


def _scheme_signatures(layout: str) -> dict[frozenset[str], list[str]]:
    """Tensor-suffix set -> the schemes storing exactly that set (FP8 per-channel and block-wise
    share theirs; their weight_scale's shape tells them apart)."""
    out: dict[frozenset[str], list[str]] = {}
    for scheme, entries in scheme_table()[layout].items():
        if any(entry["role"] in ("packed", "weight") for entry in entries.values()):  # a Linear's scheme, not the KV cache's
            out.setdefault(frozenset(entries), []).append(scheme)
    return out


def _pick_scheme(candidates: list[str], tensors: dict) -> str:
    if len(candidates) == 1:
        return candidates[0]
    scale = tensors.get("weight_scale")
    per_channel = scale is not None and len(scale.shape) == 2 and scale.shape[1] == 1
    return next(c for c in candidates if (codec(c).strategy == "channel") == per_channel)


class QuantizedCheckpoint:
    """A checkpoint's quantized Linears, by module (``layout``: compressed-tensors | modelopt).

    A module is quantized when its tensors are exactly one scheme's set in ``layout``; anything
    else (BF16 Linears, norms, embeddings) is left as stored.
    """

    def __init__(self, ckpt: Checkpoint, layout: str):
        if layout not in LAYOUTS:
            raise ConfigError(f"no quantized layout {layout!r} (one of {', '.join(LAYOUTS)})", file=ckpt.display)
        self.ckpt = ckpt
        self.layout = layout
        self.linears: dict[str, QuantizedLinear] = {}
        self.names: frozenset[str] = frozenset(info.name for _, info in ckpt.tensors())
        self._plain: dict[str, tuple[int, ...]] = {}
        self._fused: tuple[tuple[str, ...], ...] | None = None
        self._classify()

    def _classify(self) -> None:
        signatures = _scheme_signatures(self.layout)
        by_module: dict[str, dict] = {}
        for _, info in self.ckpt.tensors():
            module, _, suffix = info.name.rpartition(".")
            if suffix in KV_SUFFIXES:
                continue
            by_module.setdefault(module, {})[suffix] = info
        for module, tensors in by_module.items():
            candidates = signatures.get(frozenset(tensors))
            scheme = _pick_scheme(candidates, tensors) if candidates else None
            if scheme is None:
                for suffix, info in tensors.items():
                    self._plain[f"{module}.{suffix}"] = tuple(info.shape)
                continue
            roles = {entry["role"]: f"{module}.{suffix}" for suffix, entry in scheme_table()[self.layout][scheme].items()}
            weight_info = tensors["weight" if "weight" in tensors else "weight_packed"]
            out_features, stored_in = weight_info.shape
            in_features = codec(scheme).in_features(stored_in)
            self.linears[module] = QuantizedLinear(module, scheme, roles, out_features, in_features)

    # -- what is stored --------------------------------------------------------------------------
    def scheme(self, module: str) -> str:
        """The module's scheme, ``unquantized`` when it is not a quantized Linear."""
        q = self.linears.get(module)
        return UNQUANTIZED if q is None else q.scheme

    def has(self, name: str) -> bool:
        return name in self.names

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """The logical tensors of the model it was made from: ``<m>.weight`` [out, in] for every
        quantized Linear, every other tensor as stored (quantization metadata hidden)."""
        shapes = dict(self._plain)
        shapes.update({f"{q.module}.weight": (q.out_features, q.in_features) for q in self.linears.values()})
        return shapes

    def tensor(self, module: str, role: str) -> Tensor:
        """The stored tensor of one role of a quantized Linear."""
        return self.ckpt.read_tensor(self._linear(module).names[role])

    def _linear(self, module: str) -> QuantizedLinear:
        q = self.linears.get(module)
        if q is None:
            raise ConfigError(f"{module} is not a quantized Linear of this checkpoint", file=self.ckpt.display)
        return q

    def _f32(self, module: str, role: str) -> Tensor:
        return self.tensor(module, role).to(torch.float32).reshape(-1)

    # -- fused groups ------------------------------------------------------------------------------
    def fused_groups(self) -> tuple[tuple[str, ...], ...]:
        """Leaf names vLLM fuses into one GEMM, from the architecture's layout (``[fused]``)."""
        if self._fused is None:
            from fp4forge.checkpoint.layout import layout_for_config

            self._fused = tuple(layout_for_config(self.ckpt.config).fused.values())
        return self._fused

    def fused_partners(self, module: str, groups: Iterable[Sequence[str]] | None = None) -> list[str]:
        """The quantized Linears served as one GEMM with ``module`` (itself included, in group
        order); ``groups`` defaults to :meth:`fused_groups`. Empty when ``module`` is not quantized."""
        if module not in self.linears:
            return []
        parent, _, leaf = module.rpartition(".")
        group = next((tuple(members) for members in (self.fused_groups() if groups is None else groups) if leaf in members), (leaf,))
        return [f"{parent}.{m}" for m in group if f"{parent}.{m}" in self.linears]

    # -- input scales ------------------------------------------------------------------------------
    def has_input_scale(self, module: str) -> bool:
        q = self.linears.get(module)
        return q is not None and "input_scale" in q.names

    def input_amax(self, module: str) -> float | None:
        """The activation amax the module's stored input scale stands for (None: no static input
        scale: unquantized, ``nvfp4a16``, ``fp8_dynamic``). CT NVFP4 ``(6*448)/amax``, ModelOpt NVFP4
        ``amax/(6*448)``, FP8 ``amax/448``; computed in float64 from the stored F32 value."""
        if not self.has_input_scale(module):
            return None
        return self.linears[module].codec.input_amax(float(self._f32(module, "input_scale")[0]), self.layout)

    def nvfp4_input_scale_2(self, module: str) -> Tensor | None:
        """An NVFP4 module's input ``amax/(6*448)`` as vLLM holds it, F32 ``[1]`` (CT: ``1/gs`` in
        F32; ModelOpt: as stored); None without an input scale."""
        if not self.has_input_scale(module):
            return None
        return self._to_scale_2(self._f32(module, "input_scale"))

    def _to_scale_2(self, stored: Tensor) -> Tensor:
        return convention_rule(self.layout).scale_2(stored).reshape(-1)

    # -- weights, per module -------------------------------------------------------------------------
    def nvfp4_weight(self, module: str) -> Nvfp4Weight:
        """The stored NVFP4 weight (global scale in F32, in the layout's own convention)."""
        scheme_codec = self._linear(module).codec
        if not isinstance(scheme_codec, Nvfp4Codec):
            raise ConfigError(f"{module} is not an NVFP4 Linear", file=self.ckpt.display)
        return scheme_codec.weight(self._stored(module), self.layout)

    def weight_scale_2(self, module: str) -> Tensor:
        """An NVFP4 module's weight ``amax/(6*448)`` (vLLM's dequant multiplier), F32 ``[1]``."""
        return self._to_scale_2(self._f32(module, "global_scale"))

    def dequantize(self, module: str, dtype: torch.dtype = torch.bfloat16, *, formula: DequantFormula | None = None) -> Tensor:
        """The module's weight as ``dtype``; an unquantized module's as stored, cast.

        NVFP4 ``formula``: None = the layout's own decompress, the exact inverse of the exporter
        (CT: ``value * (scale / global)``; ModelOpt: ``value * (scale * scale_2)``); ``"multiply"``
        = vLLM's emulation, ``value * (scale * fp32(1/global))`` in both layouts. FP8:
        ``q * scale`` in the scale's stored dtype (compressed-tensors' decompress), then cast.
        """
        q = self.linears.get(module)
        if q is None:
            return self.ckpt.read_tensor(f"{module}.weight").to(dtype)
        return q.codec.decode(self._stored(module), self.layout, dtype, formula)

    def _stored(self, module: str) -> dict[str, Tensor]:
        """The module's stored tensors that the codec reads, by role (input scales aside)."""
        return {role: self.tensor(module, role) for role in self._linear(module).names if role != "input_scale"}

    def dequantize_nvfp4_with(self, module: str, scale_2: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
        """An NVFP4 module's codes and block scales with another per-tensor multiplier
        (``value * (scale * scale_2)``): how vLLM dequantizes a shard of a fused weight."""
        q = Nvfp4Weight(self.tensor(module, "packed"), self.tensor(module, "block_scale"), scale_2.reshape(()), convention="modelopt")
        return nvfp4_dequantize(q, dtype, formula="multiply")

    def dequantized(self, dtype: torch.dtype, formula: DequantFormula | None = None) -> DequantizedTensors:
        """The checkpoint seen as the unquantized one it came from (``shapes`` / ``read``)."""
        return DequantizedTensors(self, dtype, formula)

    # -- weights, per GEMM as vLLM loads them ---------------------------------------------------------
    def served_linear(self, module: str, groups: Iterable[Sequence[str]] | None = None) -> ServedLinear:
        """The module's GEMM weight (F32) and input scale as vLLM holds them: shards of one fused
        GEMM (``groups``, default :meth:`fused_groups`) of the same family share the largest
        scale. NVFP4: one multiplier ``max(amax/(6*448))``, input ``1/max(amax/(6*448))``; FP8: the
        shards requantized to the largest weight scale (``requantize_with_max_scale``), the
        largest input scale."""
        q = self._linear(module)
        groups = None if groups is None else tuple(tuple(g) for g in groups)
        partners = [m for m in self.fused_partners(module, groups) if self.linears[m].family == q.family]
        if q.packs_fp4:
            mult = torch.stack([self.weight_scale_2(m).max() for m in partners]).max()
            inputs = [s for m in partners if (s := self.nvfp4_input_scale_2(m)) is not None]
            act = None if not inputs else (1.0 / torch.stack([i.max() for i in inputs]).max()).reshape(1)
            return ServedLinear(module, q.family, self.dequantize_nvfp4_with(module, mult), act)
        w_scales = {m: self._f32(m, "weight_scale") for m in partners}
        w_max = torch.stack([s.max() for s in w_scales.values()]).max()
        scale = w_scales[module] if w_scales[module].numel() == 1 else w_scales[module].reshape(-1, 1)
        weight = self.tensor(module, "weight").to(torch.float32) * scale
        if len(partners) > 1 and all(s.numel() == 1 for s in w_scales.values()):  # per-tensor shards
            weight = fp8_fake_quantize(weight, w_max)
        act = None
        if self.has_input_scale(module):
            act = torch.stack([self._f32(m, "input_scale").max() for m in partners]).max().reshape(1)
        return ServedLinear(module, q.family, weight, act)

    def served_experts(self, moe: str, count: int) -> ServedExperts:
        """Routed NVFP4 experts ``<moe>.<e>.{gate,up,down}_proj``: gate/up fused and dequantized
        with the gate's multiplier (vLLM's w13 takes w1's scale), down with its own; input
        ``amax/(6*448)`` per expert when every expert has input scales."""
        gate_up, down, gu_amax, d_amax = [], [], [], []
        for e in range(count):
            g, u, d = (f"{moe}.{e}.{proj}" for proj in ("gate_proj", "up_proj", "down_proj"))
            for m in (g, u, d):
                if not self._linear(m).packs_fp4:
                    raise ConfigError(f"{m}: routed experts are read as NVFP4, found {self.linears[m].scheme}", file=self.ckpt.display)
            g_mult = self.weight_scale_2(g)
            gate_up.append(torch.cat([self.dequantize_nvfp4_with(g, g_mult), self.dequantize_nvfp4_with(u, g_mult)]))
            down.append(self.dequantize_nvfp4_with(d, self.weight_scale_2(d)))
            inputs = [self.nvfp4_input_scale_2(m) for m in (g, u, d)]
            if all(i is not None for i in inputs):
                gu_amax.append(torch.cat(inputs[:2]))
                d_amax.append(inputs[2])
        has_inputs = len(gu_amax) == count
        return ServedExperts(
            moe,
            torch.stack(gate_up),
            torch.stack(down),
            torch.stack(gu_amax) if has_inputs else None,
            torch.cat(d_amax) if has_inputs else None,
        )

    # -- the KV cache -----------------------------------------------------------------------------------
    def kv_scale_names(self, layers: Iterable[str]) -> dict[str, dict[str, str]]:
        """{layer prefix: {k_scale | v_scale: tensor name}} for the layers that store any
        (:func:`find_kv_scale_names`)."""
        return find_kv_scale_names(self.names, layers)[1]

    def kv_scales(self, layers: Iterable[str]) -> dict[str, dict[str, Tensor]]:
        """The stored FP8 KV scales (``amax/448``) as flat F32 tensors (one value, or one per KV
        head), by layer prefix and role."""
        return {layer: {role: self.ckpt.read_tensor(name).to(torch.float32).reshape(-1) for role, name in names.items()} for layer, names in self.kv_scale_names(layers).items()}


def find_kv_scale_names(present: Iterable[str], layers: Iterable[str]) -> tuple[str | None, dict[str, dict[str, str]]]:
    """(layout whose names the KV scales use, {layer prefix: {role: tensor name}}) among the tensor
    names ``present``: the layout with the most names present (a checkpoint may carry the other
    layout's); (None, {}) when there are none."""
    present = present if isinstance(present, (set, frozenset)) else set(present)
    layers = list(layers)
    best: tuple[str | None, dict[str, dict[str, str]]] = (None, {})
    for layout in LAYOUTS:
        found: dict[str, dict[str, str]] = {}
        for layer in layers:
            names = {role: spec.name for role, spec in kv_role_names(layout, layer).items() if spec.name in present}
            if names:
                found[layer] = names
        if sum(map(len, found.values())) > sum(map(len, best[1].values())):
            best = (layout, found)
    return best


class DequantizedTensors:
    """A quantized checkpoint as the unquantized one it came from: ``<m>.weight`` of every
    quantized Linear is its dequantized weight; quantization metadata is hidden. A tensor source
    for the layer-streamed model (``shapes`` / ``read``)."""

    def __init__(self, view: QuantizedCheckpoint, dtype: torch.dtype, formula: DequantFormula | None = None):
        self.view = view
        self.dtype = dtype
        self.formula = formula

    @property
    def linears(self) -> dict[str, QuantizedLinear]:
        return self.view.linears

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return self.view.shapes()

    def _quantized_module(self, name: str) -> str | None:
        module = name[: -len(".weight")] if name.endswith(".weight") else None
        return module if module in self.view.linears else None

    def read(self, name: str) -> Tensor:
        module = self._quantized_module(name)
        if module is None:
            return self.view.ckpt.read_tensor(name)
        return self.view.dequantize(module, self.dtype, formula=self.formula)

    def host_nbytes(self, names: list[str]) -> list[int]:
        """The bytes :meth:`read_host` with ``pin`` hands over for each of ``names``: a quantized
        weight's stored tensors, anything else as stored (sizes a read-ahead slab)."""
        ckpt = self.view.ckpt
        sizes = []
        for name in names:
            module = self._quantized_module(name)
            stored = [name] if module is None else [n for role, n in self.view._linear(module).names.items() if role != "input_scale"]
            sizes += [ckpt.locate(n)[1].nbytes for n in stored]
        return sizes

    def read_host(self, name: str, pin: bool, alloc: HostAlloc | None = None) -> Tensor | StoredWeight:
        """What a read-ahead thread hands over. Without ``pin``, :meth:`read`. With ``pin`` (the
        layer goes to a CUDA device), a quantized weight's stored codes and scales in page-locked
        memory (made by ``alloc`` when given), decoded on the device where it is materialised
        (:meth:`StoredWeight.on_device`): the same formula in F32, the same values; the host
        neither decodes nor holds the wide weight."""
        module = self._quantized_module(name)
        if not pin:
            return self.read(name)
        if module is None:
            return host_copy(self.view.ckpt.read_tensor(name), pin, alloc)
        stored = {role: host_copy(t, pin, alloc) for role, t in self.view._stored(module).items()}
        return StoredWeight(self, module, stored)


@dataclass(frozen=True)
class StoredWeight:
    """A quantized Linear's stored tensors on the host, to be decoded where they are used."""

    source: DequantizedTensors
    module: str
    stored: dict[str, Tensor]

    def on_device(self, device: torch.device) -> Tensor:
        view = self.source.view
        on = {role: t.to(device, non_blocking=True) for role, t in self.stored.items()}
        return view.linears[self.module].codec.decode(on, view.layout, self.source.dtype, self.source.formula)


# -- which layers carry a KV cache, and which layout declares it ------------------------------------
ATTENTION_LAYER = re.compile(r"^(?P<layer>.+)\.self_attn\.k_proj\.(weight|weight_packed)$")


def attention_layers(ckpt: Checkpoint) -> list[str]:
    """Layer prefixes that hold an attention k_proj, in natural order."""
    found = {m.group("layer") for _, info in ckpt.tensors() if (m := ATTENTION_LAYER.match(info.name))}
    return sorted(found, key=natural_key)


def kv_layout(ckpt: Checkpoint) -> str | None:
    """The layout whose declaration the checkpoint carries (None: no quantization declared)."""
    detected = detect_format(ckpt.config, ckpt.extra_json)
    if detected is not None and detected not in LAYOUTS:
        raise ConfigError(f"quant_method {detected!r}: fp4forge writes KV scales for {', '.join(LAYOUTS)} only", file=ckpt.display)
    return detected
