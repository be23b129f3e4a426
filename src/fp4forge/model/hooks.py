"""Hooks into one decoder layer's forward that calibration and measurement share.

* **Routed experts**: transformers 5 keeps them fused (``gate_up_proj`` [E, 2I, H], ``down_proj``
  [E, H, I]) with no per-expert Linear to hook, so the experts module runs :func:`experts_forward`
  — transformers' eager expert loop (``LagunaExperts.forward`` / ``Qwen3MoeExperts.forward``: the
  same values bit for bit, with one host sync per call instead of one per expert) with an
  :class:`ExpertTap` at each expert's two GEMM inputs. Calibration's tap
  records amax per expert; the fidelity student's tap fake-quantizes.
* **KV cache**: a :class:`KVCacheTap` passed to attention as ``past_key_values`` receives K and V
  exactly as the cache would store them (after k-norm and RoPE); ``observe`` sees them
  (calibration), ``transform`` may replace them (FP8 KV fake-quant for the student).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fp4forge.errors import ConfigError


class ExpertTap(Protocol):
    """Sees (and may replace) the input of each expert's gate/up and down GEMMs. A tap may also
    define ``gate_up_rows(x, experts)`` / ``down_rows(h, experts)``: then it gets every expert's
    rows in one call (sorted by expert; ``experts`` names each row's) instead of the per-expert ones."""

    def routed(self, counts: Tensor) -> None: ...

    def gate_up_input(self, expert: int, x: Tensor) -> Tensor: ...

    def down_input(self, expert: int, h: Tensor) -> Tensor: ...

    def after_routed(self, module: nn.Module, hidden_states: Tensor) -> None: ...


def check_fused_experts(module: nn.Module, name: str) -> None:
    """The eager loop below covers gated, concatenated [gate; up], untransposed, bias-free experts."""
    layout = {
        "has_gate": getattr(module, "has_gate", True),
        "has_bias": getattr(module, "has_bias", False),
        "is_transposed": getattr(module, "is_transposed", False),
        "is_concatenated": getattr(module, "is_concatenated", True),
        "has_post_expert_norm": getattr(module, "has_post_expert_norm", False),
    }
    if layout != {"has_gate": True, "has_bias": False, "is_transposed": False, "is_concatenated": True, "has_post_expert_norm": False}:
        raise ConfigError(f"{name}: fused experts with layout {layout} are not supported by fp4forge's expert loop")


def is_fused_experts(module: nn.Module) -> bool:
    gate_up = getattr(module, "gate_up_proj", None)
    down = getattr(module, "down_proj", None)
    return isinstance(gate_up, Tensor) and isinstance(down, Tensor) and gate_up.dim() == 3 and hasattr(module, "num_experts")


def apply_gate(module: nn.Module, gate_up: Tensor) -> Tensor:
    """The experts' gating (``act(gate) * up``), through the class's own ``_apply_gate`` if any."""
    custom = getattr(module, "_apply_gate", None)
    if custom is not None:
        return custom(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return module.act_fn(gate) * up


@torch.no_grad()
def experts_forward(module: nn.Module, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor, tap: ExpertTap) -> Tensor:
    """transformers' eager expert loop, same values bit for bit, with ``tap`` at the GEMM inputs.

    Each expert's GEMMs and gate run on the same rows in the same order as the eager loop (its
    token-expert pairs ordered by top-k slot, then token). What the eager loop does per expert
    with a host sync and small kernels (finding the rows, weighting, ``index_add_``) is done here
    once for all experts: the pairs sorted by expert, one sync for the counts, and every token's
    contributions added in ascending expert order (the order the eager ``index_add_`` calls make).
    A tap with ``gate_up_rows`` / ``down_rows`` sees all experts' rows at once (one call, not one
    per expert)."""
    routes = ExpertRoutes.of(top_k_index, module.num_experts)
    tap.routed(routes.count_tensor)
    rows = hidden_states[routes.token[: routes.valid]]
    batched = hasattr(tap, "gate_up_rows")
    if batched:
        rows = tap.gate_up_rows(rows, routes.expert[: routes.valid])
    parts = routes.split(rows)
    gated = [apply_gate(module, F.linear(part if batched else tap.gate_up_input(e, part), module.gate_up_proj[e])) for e, part in parts]
    if batched and gated:
        gated = list(tap.down_rows(torch.cat(gated), routes.expert[: routes.valid]).split(routes.hit_counts))
    down = [F.linear(h if batched else tap.down_input(e, h), module.down_proj[e]) for (e, _), h in zip(parts, gated)]
    final = torch.zeros_like(hidden_states)
    if down:
        weights = top_k_weights[routes.token[: routes.valid], routes.slot[: routes.valid], None]
        final = routes.accumulate(final, (torch.cat(down) * weights).to(final.dtype))
    tap.after_routed(module, hidden_states)
    return final


class ExpertRoutes:
    """One batch's token-expert pairs, sorted by expert (stable: by top-k slot, then token within
    an expert, as the eager loop's ``torch.where`` over the slot-major mask orders them). Expert
    index ``num_experts`` (a route to no local expert) sorts last and is skipped."""

    def __init__(self, top_k_index: Tensor, order: Tensor, count_tensor: Tensor, counts: list[int], num_experts: int):
        tokens = top_k_index.shape[0]
        self.count_tensor = count_tensor  # routed pairs per expert, on the device
        self.top_k_index = top_k_index
        self.num_experts = num_experts
        self.order = order
        self.token, self.slot = order % tokens, torch.div(order, tokens, rounding_mode="floor")
        self.counts = counts[:num_experts]
        self.valid = sum(self.counts)
        self.expert = top_k_index.t().reshape(-1)[order]
        self.hit_counts = [n for n in self.counts if n]

    @classmethod
    def of(cls, top_k_index: Tensor, num_experts: int) -> ExpertRoutes:
        flat = top_k_index.t().reshape(-1)  # slot-major: pair p = slot * tokens + token
        count_tensor = torch.bincount(flat, minlength=num_experts + 1)
        counts = count_tensor.tolist()  # the one host sync
        if len(counts) > num_experts + 1:
            raise ConfigError(f"the router chose expert {len(counts) - 1}; the layer has {num_experts}")
        return cls(top_k_index, torch.sort(flat, stable=True).indices, count_tensor[:num_experts], counts, num_experts)

    def split(self, rows: Tensor) -> list[tuple[int, Tensor]]:
        """(expert, its rows) for every expert with any, ascending."""
        hit = [e for e, n in enumerate(self.counts) if n]
        return list(zip(hit, rows.split(self.hit_counts))) if hit else []

    def accumulate(self, final: Tensor, contributions: Tensor) -> Tensor:
        """``final`` plus each token's contributions, one at a time in ascending expert order: the
        sums (and roundings) the eager loop's per-expert ``index_add_`` calls make."""
        tokens, slots = self.top_k_index.shape
        position = torch.empty_like(self.order)
        position[self.order] = torch.arange(self.order.numel(), device=self.order.device)
        by_expert = torch.sort(self.top_k_index, dim=-1, stable=True)
        token_ids = torch.arange(tokens, device=position.device)[:, None]
        rows = position[by_expert.indices * tokens + token_ids]  # [tokens, slots] rows of the sorted pairs
        valid = by_expert.values < self.num_experts
        padded = torch.cat([contributions, contributions.new_zeros(1, contributions.shape[-1])])
        rows = torch.where(valid, rows, self.valid)  # skipped routes read the zero row ...
        for j in range(slots):
            summed = final + padded[rows[:, j]]
            final = torch.where(valid[:, j, None], summed, final)  # ... and leave the sum as it was
        return final


class NoTap:
    """The teacher's experts: nothing seen, nothing changed."""

    def routed(self, counts: Tensor) -> None:
        pass

    def gate_up_input(self, expert: int, x: Tensor) -> Tensor:
        return x

    def down_input(self, expert: int, h: Tensor) -> Tensor:
        return h

    def after_routed(self, module: nn.Module, hidden_states: Tensor) -> None:
        pass


def install_experts_forward(module: nn.Module, tap: ExpertTap) -> Callable[[], None]:
    """Route ``module``'s forward through :func:`experts_forward` with ``tap``; returns the undo."""

    def forward(hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        return experts_forward(module, hidden_states, top_k_index, top_k_weights, tap)

    module.forward = forward
    return lambda: module.__dict__.pop("forward", None)


# -- the KV cache --------------------------------------------------------------------------------
KVTransform = Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]


class KVCacheTap:
    """Passed to attention as ``past_key_values``: ``update`` gets K and V [B, kv_heads, S, D]
    as the cache would store them and returns what attention uses (unchanged, or fake-quantized
    by ``transform``). Stores nothing: calibration and evaluation run whole sequences."""

    def __init__(self, observe: KVTransform | None = None, transform: KVTransform | None = None):
        self.observe = observe
        self.transform = transform

    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int | None = None, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor]:
        if self.observe is not None:
            self.observe(key_states, value_states)
        if self.transform is not None:
            return self.transform(key_states, value_states)
        return key_states, value_states


def install_kv_tap(layer: nn.Module, tap: KVCacheTap) -> Callable[[], None]:
    """Make every call of the decoder layer pass ``tap`` as its ``past_key_values``."""

    def inject(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return args, {**kwargs, "past_key_values": tap}

    return layer.register_forward_pre_hook(inject, with_kwargs=True).remove
