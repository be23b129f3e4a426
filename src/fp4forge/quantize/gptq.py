"""GPTQ for MoE, layer-streamed (docs/quantization.md#gptq).

One pass over the calibration samples, one decoder layer at a time (:mod:`fp4forge.model.streaming`):

1. Every batch goes through layer i in BF16; hooks accumulate the input Hessian ``X^T X / n`` of
   each Linear the recipe quantizes to NVFP4, and of each routed expert's gate/up and down
   projections from **the tokens the router sends to that expert** (``expert_hessian="routed"``)
   or from every token (``"all"``, as llm-compressor's all-experts calibration: every token also
   goes through every expert, for statistics only).
2. Right after the layer, its Linears are GPTQ-rounded (:func:`fp4forge.numerics.gptq.gptq_quantize`)
   on the NVFP4 grid with the exporter's per-tensor rule (a fused q/k/v or gate/up group shares one
   global scale from the group's amax), and the layer's Hessians are dropped.
3. What feeds layer i+1: by default the layer's BF16 outputs (**not sequential**: the next
   layer's Hessians come from the unquantized model's activations, one forward per layer, the
   same activations ``fp4forge calibrate`` sees). With ``sequential=True`` the layer runs a second
   time with its just-rounded weights (dequantized in place) and *those* outputs feed layer i+1,
   so each layer's Hessians see the error of the layers before it, as llm-compressor's
   sequential pipeline does (two forwards per layer).

Experts with fewer than ``min_expert_tokens`` routed tokens get the fallback: ``"pooled"``
(default; the layer's pooled Hessian over all routed expert tokens, per projection) or ``"rtn"``
(plain min-max round-to-nearest, what the exporter does without GPTQ).

The result (:class:`GptqWeights`) holds the on-disk NVFP4 tensors per module; the exporter writes
them in place of its own round-to-nearest (``QuantizeOptions.precomputed``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fp4forge.checkpoint.codecs import Nvfp4Codec, codec
from fp4forge.checkpoint.layout import layout_for_config
from fp4forge.checkpoint.reader import Checkpoint, open_checkpoint
from fp4forge.checkpoint.writer import TensorSpec
from fp4forge.errors import ConfigError
from fp4forge.model.hooks import NoTap, apply_gate, check_fused_experts, install_experts_forward, is_fused_experts
from fp4forge.model.samples import Samples, samples_for
from fp4forge.model.streaming import ActivationStore, SpillSpace, StreamedModel, WeightPlan, check_bf16_source, embed_batches, run_layer
from fp4forge.numerics.gptq import HessianAccumulator, gptq_quantize_batch
from fp4forge.numerics.nvfp4 import Nvfp4Weight, nvfp4_quantize
from fp4forge.numerics.scale_search import nvfp4_mse_global_scale, search_nvfp4
from fp4forge.quantize.job import EXPERT_HESSIANS, FALLBACKS, GPTQ_BLOCK_SCALES, GptqOptions  # re-exported
from fp4forge.quantize.plan import WorkUnit, plan_export
from fp4forge.quantize.recipe import Recipe

__all__ = ["EXPERT_HESSIANS", "FALLBACKS", "GPTQ_BLOCK_SCALES", "GptqOptions", "GptqWeights", "gptq_weights"]

Progress = Callable[[int, int, str], None] | None


@dataclass
class GptqWeights:
    """NVFP4 tensors per disk module (compressed-tensors convention), and how each was made."""

    weights: dict[str, Nvfp4Weight]
    modules: dict[str, dict[str, Any]]  # module -> {tokens, hessian: own|pooled|all|none, fallback, loss}
    settings: dict[str, Any]
    data: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0

    def provenance(self) -> dict[str, Any]:
        kinds: dict[str, int] = {}
        for info in self.modules.values():
            kinds[info["hessian"]] = kinds.get(info["hessian"], 0) + 1
        return {"method": "gptq", "settings": self.settings, "data": self.data, "modules": len(self.modules), "hessians": kinds}

    def summary(self) -> dict[str, Any]:
        return {**self.provenance(), "seconds": self.seconds}


# -- Hessian taps ------------------------------------------------------------------------------------
class _ExpertHessians:
    """An ExpertTap that accumulates per-expert Hessians of one fused experts module."""

    def __init__(self, module: nn.Module, policy: str):
        self.module = module
        self.policy = policy
        self.gate_up: dict[int, HessianAccumulator] = {}
        self.down: dict[int, HessianAccumulator] = {}
        self.tokens = torch.zeros(module.num_experts, dtype=torch.int64)

    @staticmethod
    def _add(table: dict[int, HessianAccumulator], expert: int, x: Tensor) -> None:
        if expert not in table:
            table[expert] = HessianAccumulator(x.shape[-1])
        table[expert].add(x)

    def routed(self, counts: Tensor) -> None:
        self.tokens += counts.to(torch.int64)

    def gate_up_input(self, expert: int, x: Tensor) -> Tensor:
        if self.policy == "routed":
            self._add(self.gate_up, expert, x)
        return x

    def down_input(self, expert: int, h: Tensor) -> Tensor:
        if self.policy == "routed":
            self._add(self.down, expert, h)
        return h

    def after_routed(self, module: nn.Module, hidden_states: Tensor) -> None:
        if self.policy != "all":
            return
        for expert in range(module.num_experts):  # every token through every expert (statistics only)
            self._add(self.gate_up, expert, hidden_states)
            self._add(self.down, expert, apply_gate(module, F.linear(hidden_states, module.gate_up_proj[expert])))


class _LayerHessians:
    """Hooks on one materialised decoder layer; Hessians keyed by disk module name."""

    def __init__(self, layer: nn.Module, prefix: str, plan: WeightPlan, targets: set[str], policy: str):
        self.linear: dict[str, HessianAccumulator] = {}
        self.experts: list[tuple[_ExpertHessians, list[list[str]], list[list[str]]]] = []
        self.covered: set[str] = set()
        self._undo: list[Callable[[], None]] = []
        for name, module in layer.named_modules():
            full = f"{prefix}.{name}" if name else prefix
            if isinstance(module, nn.Linear):
                try:
                    disk = plan.disk_module(full)
                except (ConfigError, ValueError):
                    continue  # a Linear filled from several disk tensors: not one exported Linear
                if disk in targets:
                    self.covered.add(disk)
                    self._undo.append(module.register_forward_pre_hook(self._linear_hook(disk, module.in_features)).remove)
            elif is_fused_experts(module):
                check_fused_experts(module, full)
                gate_up = [plan.expert_modules(f"{full}.gate_up_proj", e) for e in range(module.num_experts)]
                down = [plan.expert_modules(f"{full}.down_proj", e) for e in range(module.num_experts)]
                names = {m for group in gate_up + down for m in group}
                if not names & targets:
                    continue
                self.covered |= names
                tap = _ExpertHessians(module, policy)
                self.experts.append((tap, gate_up, down))
                self._undo.append(install_experts_forward(module, tap))

    def _linear_hook(self, disk: str, width: int):
        acc = self.linear.setdefault(disk, HessianAccumulator(width))

        def hook(_module: nn.Module, args: tuple) -> None:
            acc.add(args[0])

        return hook

    def detach(self) -> None:
        for undo in self._undo:
            undo()
        self._undo = []

    def resolve(self, min_tokens: int, fallback: str, policy: str) -> dict[str, tuple[Tensor | None, int, str]]:
        """disk module -> (Hessian or None for round-to-nearest, tokens, which Hessian)."""
        out: dict[str, tuple[Tensor | None, int, str]] = {}
        for disk, acc in self.linear.items():
            out[disk] = (acc.hessian() if acc.count else None, acc.count, "own" if acc.count else "none")
        for tap, gate_up, down in self.experts:
            pooled: dict[str, HessianAccumulator] = {}
            for kind, table in (("gate_up", tap.gate_up), ("down", tap.down)):
                for acc in table.values():
                    if kind not in pooled:
                        pooled[kind] = HessianAccumulator(acc.in_features)
                    pooled[kind].merge(acc)
            for expert in range(len(gate_up)):
                for kind, table, names in (("gate_up", tap.gate_up, gate_up[expert]), ("down", tap.down, down[expert])):
                    acc = table.get(expert)
                    tokens = int(tap.tokens[expert])
                    if policy == "all":
                        entry = (acc.hessian(), acc.count, "all")
                    elif acc is not None and tokens >= min_tokens:
                        entry = (acc.hessian(), tokens, "own")
                    elif fallback == "pooled" and kind in pooled and pooled[kind].count:
                        entry = (pooled[kind].hessian(), tokens, "pooled")
                    else:
                        entry = (None, tokens, "none")
                    for disk in names:
                        out[disk] = entry
        return out


# -- the run -----------------------------------------------------------------------------------------
def _gptq_units(ckpt: Checkpoint, recipe: Recipe) -> tuple[list[WorkUnit], set[str]]:
    """The export plan's NVFP4 units (GPTQ's targets) and their modules."""
    layout = layout_for_config(ckpt.config)
    specs = [TensorSpec(info.name, info.dtype, info.shape) for _, info in ckpt.tensors()]
    plan = plan_export(specs, layout, recipe, "compressed-tensors")
    units = [u for u in plan.units if u.linears and isinstance(codec(u.linears[0].scheme), Nvfp4Codec)]
    if not units:
        raise ConfigError(f"recipe {recipe.name} quantizes nothing to NVFP4; GPTQ here writes NVFP4 weights", option="method")
    return units, {t.module for u in units for t in u.linears}


#: Weights of one shape GPTQ sweeps together (the experts of a layer): bounds the batch's memory.
BATCH_LIMIT = 64




def _quantize_units(ckpt: Checkpoint, units: list[WorkUnit], hessians: dict[str, tuple[Tensor | None, int, str]], options: GptqOptions, out: GptqWeights) -> None:
    """GPTQ-round the units' Linears, same-shape weights in batches (a layer's experts together)."""
    jobs: dict[tuple, list[tuple[str, Tensor, Tensor, Tensor | None, int, str]]] = {}
    for unit in units:
        weights = {t.module: ckpt.read_tensor(f"{t.module}.weight") for t in unit.linears}
        w0 = next(iter(weights.values()))
        # the exporter's rule: a fused group shares one global scale from the group's max amax
        group_amax = torch.tensor(max(float(w.abs().max()) for w in weights.values()), dtype=w0.dtype) if len(weights) > 1 else None
        # MSE scales: the searched global scale (one per fused group) and each weight's searched
        # block scales under it, fixed on the original weight before the sweep
        scalar = nvfp4_mse_global_scale(list(weights.values()), global_amax=group_amax) if options.block_scales == "mse" else None
        for module, w in weights.items():
            hessian, tokens, kind = hessians.get(module, (None, 0, "none"))
            if scalar is not None:
                searched = search_nvfp4(w, "mse", global_scale=scalar, error=False).weight
                scale, amax = searched.block_scale, None
            else:
                searched, scale, amax = None, None, group_amax
            if hessian is None:
                out.weights[module] = searched if searched is not None else nvfp4_quantize(w, global_amax=group_amax)
                out.modules[module] = {"tokens": tokens, "hessian": "none", "fallback": "rtn", "loss": None}
                continue
            jobs.setdefault((tuple(w.shape), w.dtype), []).append((module, w, hessian, amax, tokens, kind, scale, scalar))
    for batch_jobs in jobs.values():
        for start in range(0, len(batch_jobs), BATCH_LIMIT):
            chunk = batch_jobs[start : start + BATCH_LIMIT]
            results = gptq_quantize_batch(
                torch.stack([j[1] for j in chunk]), torch.stack([j[2] for j in chunk]), "nvfp4",
                block_size=options.block_size, damp=options.damp, act_order=options.act_order, global_amax=[j[3] for j in chunk],
                block_scale=[j[6] for j in chunk], global_scale=[j[7] for j in chunk],
            )
            for (module, _w, _h, _amax, tokens, kind, _scale, _scalar), result in zip(chunk, results):
                out.weights[module] = result.quantized
                out.modules[module] = {"tokens": tokens, "hessian": kind, "fallback": "rtn" if result.fallback else None, "loss": result.loss}


def _load_rounded(layer: nn.Module, prefix: str, plan: WeightPlan, modules: set[str], result: GptqWeights) -> None:
    """Overwrite the materialised layer's slots of ``modules`` with their dequantized GPTQ weights."""
    for name, param in layer.named_parameters():
        for placement in plan.for_param(f"{prefix}.{name}"):
            if placement.disk_name.endswith(".weight") and placement.disk_module in modules:
                target = placement.target(param)
                target.copy_(result.weights[placement.disk_module].dequantize(torch.float32).to(target.dtype).reshape(target.shape))


@torch.inference_mode()
def gptq_weights(
    src: str | Path | Checkpoint,
    recipe: Recipe,
    options: GptqOptions = GptqOptions(),
    *,
    samples: Samples | None = None,
    progress: Progress = None,
) -> GptqWeights:
    """GPTQ-round every NVFP4 Linear ``recipe`` names in ``src``, layer-streamed (see the module doc)."""
    started = time.perf_counter()
    ckpt = src if isinstance(src, Checkpoint) else open_checkpoint(src)
    check_bf16_source(ckpt)
    units, targets = _gptq_units(ckpt, recipe)
    samples = samples or samples_for(options.calibration, ckpt)
    streamed = StreamedModel.from_checkpoint(ckpt)
    space = SpillSpace(options.calibration.ram_budget_bytes, options.calibration.spill_dir)
    batches = samples.batches(options.calibration.batch_size)
    result = GptqWeights({}, {}, options.settings(), data=samples.describe())
    pending = list(units)
    total = streamed.num_layers + 1
    try:
        store, calls = embed_batches(streamed, batches, space)
        for index in range(streamed.num_layers):
            if progress:
                progress(index + 1, total, f"GPTQ layer {index + 1}/{streamed.num_layers}")
            with streamed.layer(index) as layer:
                prefix = streamed.layer_prefix(index)
                hooks = _LayerHessians(layer, prefix, streamed.plan, targets, options.expert_hessian)
                try:
                    if options.sequential:
                        run_layer(layer, index, store, batches, calls, None, drop_inputs=False)  # for the hooks only
                    else:
                        store = run_layer(layer, index, store, batches, calls, ActivationStore(space, f"layer{index}"))
                finally:
                    hooks.detach()
                hessians = hooks.resolve(options.min_expert_tokens, options.fallback, options.expert_hessian)
                ready = [u for u in pending if all(t.module in hooks.covered for t in u.linears)]
                _quantize_units(ckpt, ready, hessians, options, result)
                pending = [u for u in pending if u not in ready]
                del hooks, hessians
                if options.sequential:  # the next layer sees this layer's rounding
                    _load_rounded(layer, prefix, streamed.plan, {t.module for u in ready for t in u.linears}, result)
                    # the same expert loop as the observed pass (transformers' own may round differently)
                    undo = [install_experts_forward(m, NoTap()) for m in layer.modules() if is_fused_experts(m)]
                    try:
                        store = run_layer(layer, index, store, batches, calls, ActivationStore(space, f"layer{index}"))
                    finally:
                        for step in undo:
                            step()
        for number in range(len(batches)):
            store.drop(number)
    finally:
        space.close()
    _quantize_units(ckpt, pending, {}, options, result)  # not reached by any hook (outside the decoder layers)
    result.seconds = time.perf_counter() - started
    if progress:
        progress(total, total, "done")
    return result
