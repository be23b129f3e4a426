"""What calibration records, and the hooks that record it on one decoder layer.

* **Linear inputs**: a forward pre-hook per ``nn.Linear`` keeps the *running* max of ``|x|`` over
  every calibration token (``torch.maximum`` with the batch's amax; never the last batch only).
* **Routed experts**: transformers 5 keeps them fused (``gate_up_proj`` [E, 2I, H],
  ``down_proj`` [E, H, I]) with no per-expert Linear to hook, so the experts module runs
  :func:`experts_forward` — transformers' eager expert loop (``LagunaExperts.forward`` /
  ``Qwen3MoeExperts.forward``) with a tap at each expert's two GEMM inputs. The tap sees each
  expert's rows; the output is the eager loop's. Coverage policies:

  - ``routed``: an expert's statistics come from the tokens the router sends it. An expert that
    saw none gets its layer peers' max (per projection) and is listed in the metadata.
  - ``all-experts``: additionally every token goes through every expert's gate/up projection (as
    llm-compressor's ``moe_calibrate_all_experts``), for statistics only; the layer's output still
    uses the routed tokens alone.

  Tokens per expert (routed token-expert pairs) are counted in both.
* **KV cache**: the object passed to attention as ``past_key_values`` (:class:`KVCacheTap`)
  receives K and V exactly as they would be written to the cache, after k-norm and RoPE; amax is
  kept per tensor and per KV head. The same tap fake-quantizes K/V for the fidelity student.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fp4forge.checkpoint.stats import input_amax_name, kv_amax_name
from fp4forge.model.hooks import KVCacheTap, apply_gate, check_fused_experts, install_experts_forward, install_kv_tap, is_fused_experts
from fp4forge.model.distributed import Ranks
from fp4forge.model.streaming import WeightPlan
from fp4forge.errors import ConfigError
from fp4forge.calibrate.options import POLICIES  # re-exported: the observers cover these


class AmaxTable:
    """Running max |x| per name, as F32 scalars (exact: the max of bf16 values is a bf16 value)."""

    def __init__(self) -> None:
        self.values: dict[str, Tensor] = {}

    def update(self, name: str, x: Tensor) -> None:
        self.update_value(name, x.detach().abs().amax().to(torch.float32))

    def update_value(self, name: str, value: Tensor) -> None:
        current = self.values.get(name)
        self.values[name] = value.clone() if current is None else torch.maximum(current, value)


# -- routed experts -------------------------------------------------------------------------------
@dataclass
class ExpertStats:
    """Per-expert running statistics of one fused experts module."""

    num_experts: int
    device: torch.device | str = "cpu"  # where the layer runs: updates stay there, no sync per expert
    gate_up_amax: Tensor = field(init=False)
    down_amax: Tensor = field(init=False)
    tokens: Tensor = field(init=False)

    def __post_init__(self) -> None:
        self.gate_up_amax = torch.zeros(self.num_experts, dtype=torch.float32, device=self.device)
        self.down_amax = torch.zeros(self.num_experts, dtype=torch.float32, device=self.device)
        self.tokens = torch.zeros(self.num_experts, dtype=torch.int64, device=self.device)

    def to_cpu(self) -> ExpertStats:
        out = ExpertStats(self.num_experts)
        out.gate_up_amax, out.down_amax, out.tokens = self.gate_up_amax.cpu(), self.down_amax.cpu(), self.tokens.cpu()
        return out


class ExpertObserver:
    """An :class:`ExpertTap` that records amax per expert (and, for ``all-experts``, runs every
    token through every expert's gate/up projection after the routed loop)."""

    def __init__(self, stats: ExpertStats, policy: str):
        self.stats = stats
        self.policy = policy

    @staticmethod
    def _amax(x: Tensor) -> Tensor:
        return x.abs().amax().to(torch.float32) if x.numel() else torch.zeros((), dtype=torch.float32)

    def routed(self, counts: Tensor) -> None:
        self.stats.tokens += counts

    def down_input(self, expert: int, h: Tensor) -> Tensor:
        self.stats.down_amax[expert] = torch.maximum(self.stats.down_amax[expert], self._amax(h))
        return h

    # All experts' rows at once (sorted by expert, ``experts`` says whose each row is): the same
    # maxima as the per-expert calls, in one reduction instead of a few kernels per expert.
    def gate_up_rows(self, x: Tensor, experts: Tensor) -> Tensor:
        self.stats.gate_up_amax = self._rows_amax(self.stats.gate_up_amax, x, experts)
        return x

    def down_rows(self, h: Tensor, experts: Tensor) -> Tensor:
        self.stats.down_amax = self._rows_amax(self.stats.down_amax, h, experts)
        return h

    @staticmethod
    def _rows_amax(running: Tensor, rows: Tensor, experts: Tensor) -> Tensor:
        per_row = rows.abs().amax(dim=-1).to(torch.float32)
        return running.scatter_reduce(0, experts, per_row, "amax", include_self=True)

    def after_routed(self, module: nn.Module, hidden_states: Tensor) -> None:
        if self.policy != "all-experts":
            return
        every_token = self._amax(hidden_states)
        for expert in range(self.stats.num_experts):
            self.stats.gate_up_amax[expert] = torch.maximum(self.stats.gate_up_amax[expert], every_token)
            hidden = apply_gate(module, F.linear(hidden_states, module.gate_up_proj[expert]))
            self.down_input(expert, hidden)


def kv_amax_recorder(table: AmaxTable, layer_prefix: str) -> Callable[[Tensor, Tensor], None]:
    """Keeps the running K and V amax of one layer, per tensor and per KV head."""

    def observe(key_states: Tensor, value_states: Tensor) -> None:
        for role, states in (("k", key_states), ("v", value_states)):
            per_head = states.detach().abs().amax(dim=(0, 2, 3)).to(torch.float32)
            table.update_value(kv_amax_name(layer_prefix, role, per_head=True), per_head)
            table.update_value(kv_amax_name(layer_prefix, role), per_head.amax().reshape(1))

    return observe


# -- one decoder layer's observers -------------------------------------------------------------------
class CalibrationObserver:
    """Everything calibration records, over all layers (attached one layer at a time)."""

    def __init__(self, plan: WeightPlan, policy: str = "routed", device: torch.device | str = "cpu"):
        if policy not in POLICIES:
            raise ConfigError(f"MoE coverage policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.plan = plan
        self.policy = policy
        self.device = device
        self.amax = AmaxTable()
        self.experts: dict[str, ExpertStats] = {}  # in-memory experts module name -> stats

    def attach(self, layer: nn.Module, prefix: str) -> Callable[[], None]:
        """Hook ``layer`` (in-memory name ``prefix``); returns the function that removes the hooks."""
        undo: list[Callable[[], None]] = [install_kv_tap(layer, KVCacheTap(observe=kv_amax_recorder(self.amax, prefix)))]
        for name, module in layer.named_modules():
            full = f"{prefix}.{name}" if name else prefix
            if isinstance(module, nn.Linear):
                undo.append(self._hook_linear(module, self.plan.disk_module(full)))
            elif is_fused_experts(module):
                check_fused_experts(module, full)
                stats = self.experts.setdefault(full, ExpertStats(module.num_experts, self.device))
                undo.append(install_experts_forward(module, ExpertObserver(stats, self.policy)))

        def detach() -> None:
            for step in undo:
                step()

        return detach

    def _hook_linear(self, module: nn.Linear, disk_module: str) -> Callable[[], None]:
        name = input_amax_name(disk_module)

        def record(_: nn.Module, args: tuple) -> None:
            self.amax.update(name, args[0])

        return module.register_forward_pre_hook(record).remove

    def observe_head_input(self, disk_module: str, x: Tensor) -> None:
        self.amax.update(input_amax_name(disk_module), x)

    def reduce(self, ranks: Ranks) -> None:
        """Combine every rank's running statistics (each saw its share of the batches): amax by
        MAX, routed token counts by SUM. Before :meth:`statistics`, so an expert is "without
        tokens" only when no rank routed it any."""
        if not ranks.distributed:
            return
        amax = {f"linear:{n}": v for n, v in self.amax.values.items()}
        for name, stats in self.experts.items():
            amax[f"gate_up:{name}"], amax[f"down:{name}"] = stats.gate_up_amax, stats.down_amax
        amax = ranks.reduce_tensors(amax, "max")
        tokens = ranks.reduce_tensors({name: stats.tokens for name, stats in self.experts.items()}, "sum")
        self.amax.values = {n.removeprefix("linear:"): v for n, v in amax.items() if n.startswith("linear:")}
        for name, stats in self.experts.items():
            stats.gate_up_amax, stats.down_amax, stats.tokens = amax[f"gate_up:{name}"], amax[f"down:{name}"], tokens[name]

    def statistics(self) -> tuple[dict[str, Tensor], dict[str, Any]]:
        """(F32 tensors for the statistics file, metadata about experts)."""
        tensors = {name: value.reshape(-1).cpu() for name, value in self.amax.values.items()}
        tokens: dict[str, list[int]] = {}
        unseen: list[str] = []
        for experts_name, on_device in self.experts.items():
            stats = on_device.to_cpu()
            disk_gate_up = [self.plan.expert_modules(f"{experts_name}.gate_up_proj", e) for e in range(stats.num_experts)]
            disk_down = [self.plan.expert_modules(f"{experts_name}.down_proj", e) for e in range(stats.num_experts)]
            seen = stats.tokens > 0 if self.policy == "routed" else torch.ones_like(stats.tokens, dtype=torch.bool)
            gate_up = _fill_unseen(stats.gate_up_amax, seen)
            down = _fill_unseen(stats.down_amax, seen)
            for expert in range(stats.num_experts):
                for module in disk_gate_up[expert]:
                    tensors[input_amax_name(module)] = gate_up[expert].reshape(1).clone()
                (down_module,) = disk_down[expert]
                tensors[input_amax_name(down_module)] = down[expert].reshape(1).clone()
                if not bool(seen[expert]):
                    unseen.append(down_module.rsplit(".", 1)[0])
            tokens[disk_down[0][0].rsplit(".", 2)[0]] = stats.tokens.tolist()
        meta = {"moe_policy": self.policy, "tokens_per_expert": tokens, "experts_without_tokens": unseen}
        return dict(sorted(tensors.items())), meta


def _fill_unseen(amax: Tensor, seen: Tensor) -> Tensor:
    """An expert without tokens takes the max of its layer peers that had some."""
    if bool(seen.all()):
        return amax
    peers = amax[seen].max() if bool(seen.any()) else torch.zeros((), dtype=amax.dtype)
    return torch.where(seen, amax, peers)
