"""The fp4forge-vllm plugin's expert op under torch.compile (plain torch; no vLLM needed).

vLLM compiles the model at start-up unless ``--enforce-eager``. The expert loop visits only the
experts a batch routes to, a data-dependent loop that torch.compile cannot trace
(``GuardOnDataDependentSymNode``, which killed every compiled start-up of fp4forge-vllm 0.1.0);
the plugin therefore runs it as the custom op ``fp4forge::nvfp4_experts``. Oracle: the plain
loop run eagerly. The real compiled server is tested in tests/test_vllm_plugin.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "plugins" / "fp4forge-vllm" / "src"))
from fp4forge_vllm import moe  # noqa: E402

sys.path.pop(0)

EXPERTS, HIDDEN, INTERMEDIATE, TOP_K = 8, 32, 16, 2


def routed_batch(tokens: int, seed: int) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=generator)
    logits = torch.randn(tokens, EXPERTS, generator=generator)
    weights, ids = torch.topk(logits.sigmoid(), TOP_K)
    return x, weights, ids.to(torch.int32)


@pytest.fixture(scope="module")
def weights() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return (torch.randn(EXPERTS, 2 * INTERMEDIATE, HIDDEN, generator=generator),
            torch.randn(EXPERTS, HIDDEN, INTERMEDIATE, generator=generator))


def test_the_plain_loop_cannot_be_compiled(weights: tuple[torch.Tensor, torch.Tensor]) -> None:
    w13, w2 = weights
    x, topk_weights, topk_ids = routed_batch(5, seed=1)

    def plain(x, topk_weights, topk_ids):  # type: ignore[no-untyped-def]
        return moe.experts_forward(x, w13, w2, topk_weights, topk_ids, lambda h, e, g: h)

    torch._dynamo.reset()
    with pytest.raises(Exception, match="GuardOnDataDependentSymNode|data-dependent"):
        torch.compile(plain, fullgraph=True, dynamic=True)(x, topk_weights, topk_ids)


def test_the_expert_op_compiles_and_equals_the_eager_loop(weights: tuple[torch.Tensor, torch.Tensor]) -> None:
    w13, w2 = weights

    def layer(x, topk_weights, topk_ids):  # type: ignore[no-untyped-def]
        return moe.nvfp4_experts(x, w13, w2, topk_weights, topk_ids, None, None) + x

    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True, dynamic=True)
    for tokens, seed in ((5, 1), (17, 2), (1, 3)):  # several batch sizes through one dynamic graph
        x, topk_weights, topk_ids = routed_batch(tokens, seed)
        expected = moe.experts_forward(x, w13, w2, topk_weights, topk_ids, lambda h, e, g: h) + x
        assert torch.equal(compiled(x, topk_weights, topk_ids), expected)


def test_the_expert_op_has_a_schema_torch_can_check() -> None:
    schema = str(torch.ops.fp4forge.nvfp4_experts.default._schema)
    assert "Tensor? w13_act_global_scale" in schema and schema.endswith("-> Tensor")
    torch.library.opcheck(
        torch.ops.fp4forge.nvfp4_experts.default,
        (*routed_batch(4, seed=5)[:1], torch.randn(EXPERTS, 2 * INTERMEDIATE, HIDDEN), torch.randn(EXPERTS, HIDDEN, INTERMEDIATE),
         *routed_batch(4, seed=5)[1:], None, None),
    )
