"""Hooks into one decoder layer's forward that calibration and measurement share.

* **Routed experts**: transformers 5 keeps them fused (``gate_up_proj`` [E, 2I, H], ``down_proj``
  [E, H, I]) with no per-expert Linear to hook, so the experts module runs :func:`experts_forward`
  — transformers' eager expert loop (``LagunaExperts.forward`` / ``Qwen3MoeExperts.forward``, same
  ops, same order) with an :class:`ExpertTap` at each expert's two GEMM inputs. Calibration's tap
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
    """Sees (and may replace) the input of each expert's gate/up and down GEMMs."""

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
    """transformers' eager expert loop (same ops, same order), with ``tap`` at the GEMM inputs."""
    num_experts = module.num_experts
    final = torch.zeros_like(hidden_states)
    expert_mask = F.one_hot(top_k_index, num_classes=num_experts + 1).permute(2, 1, 0)
    tap.routed(torch.bincount(top_k_index.reshape(-1), minlength=num_experts)[:num_experts])
    hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
    for expert_idx in hit:
        expert = int(expert_idx[0])
        if expert == num_experts:
            continue
        top_k_pos, token_idx = torch.where(expert_mask[expert])
        state = tap.gate_up_input(expert, hidden_states[token_idx])
        hidden = apply_gate(module, F.linear(state, module.gate_up_proj[expert]))
        hidden = F.linear(tap.down_input(expert, hidden), module.down_proj[expert])
        hidden = hidden * top_k_weights[token_idx, top_k_pos, None]
        final.index_add_(0, token_idx, hidden.to(final.dtype))
    tap.after_routed(module, hidden_states)
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
