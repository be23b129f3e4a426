"""Sigmoid + correction-bias MoE routing on vLLM's CPU platform, and loading that bias.

Two defects of vLLM 0.32 that stop Laguna's MoE from serving correctly (the first on CPU only,
the second, a loader defect, on every platform):

* ``CPURouter._compute_routing`` handles plain top-k only for softmax
  (``assert self.scoring_func == "softmax"``), so the first request to a sigmoid-routed model
  kills the engine. We add the sigmoid path, computed as transformers' ``LagunaTopKRouter`` does.
* ``RoutedExperts.load_weights`` matches only expert weights, so the checkpoint's
  ``mlp.experts.e_score_correction_bias`` is dropped without a word and the bias stays 0.
  We copy it into the parameter the router already holds.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import torch

BIAS_NAME = "e_score_correction_bias"


def sigmoid_bias_topk(
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    e_score_correction_bias: torch.Tensor | None,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Experts chosen by ``sigmoid(logit) + bias``, weighted by the unbiased sigmoid scores."""
    scores = router_logits.float().sigmoid()
    selection = scores if e_score_correction_bias is None else scores + e_score_correction_bias.float()
    topk_ids = torch.topk(selection, top_k, dim=-1).indices
    topk_weights = scores.gather(-1, topk_ids)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    if routed_scaling_factor != 1.0:
        topk_weights = topk_weights * routed_scaling_factor
    # cpu_fused_moe reads contiguous float32 / int32 buffers.
    return topk_weights.contiguous(), topk_ids.to(torch.int32).contiguous()


def patch_cpu_router() -> None:
    from vllm.model_executor.layers.fused_moe.router.cpu_router import CPURouter

    original = CPURouter._compute_routing
    if getattr(original, "_fp4forge", False):
        return  # already patched in this process

    def _compute_routing(self, hidden_states, router_logits, indices_type, *, input_ids=None):  # type: ignore[no-untyped-def]
        plain_sigmoid = (
            self.scoring_func == "sigmoid" and not self.use_grouped_topk and self.custom_routing_function is None
        )
        if not plain_sigmoid:
            return original(self, hidden_states, router_logits, indices_type, input_ids=input_ids)
        return sigmoid_bias_topk(
            router_logits, self.top_k, self.renormalize, self.e_score_correction_bias, self.routed_scaling_factor
        )

    _compute_routing._fp4forge = True  # type: ignore[attr-defined]
    CPURouter._compute_routing = _compute_routing


def _split_bias(
    weights: Iterable[tuple[str, torch.Tensor]], on_bias: Callable[[torch.Tensor], None]
) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in weights:
        if name == BIAS_NAME:
            on_bias(tensor)
        else:
            yield name, tensor


def patch_bias_loading() -> None:
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    original = RoutedExperts.load_weights
    if getattr(original, "_fp4forge", False):
        return

    def load_weights(self, weights):  # type: ignore[no-untyped-def]
        loaded: list[str] = []

        def copy_bias(tensor: torch.Tensor) -> None:
            param = self.e_score_correction_bias
            if param is None:
                raise ValueError(
                    f"fp4forge-vllm: the checkpoint has {self.layer_name}.{BIAS_NAME} but vLLM built "
                    "this MoE layer without a correction bias; refusing to drop it silently"
                )
            if tuple(param.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"fp4forge-vllm: {self.layer_name}.{BIAS_NAME} has shape {tuple(tensor.shape)}, "
                    f"the layer expects {tuple(param.shape)}"
                )
            param.data.copy_(tensor.to(param.dtype))
            loaded.append(BIAS_NAME)

        yield from original(self, _split_bias(weights, copy_bias))
        yield from loaded

    load_weights._fp4forge = True  # type: ignore[attr-defined]
    RoutedExperts.load_weights = load_weights
