"""``AuditContext.engine_unquantized`` matches the layout's ``unquantized`` patterns as one
alternation: held to the per-pattern definition (routers, lm_head, and any module one pattern
matches at its start), also for patterns that cannot be joined (back-references, inline flags)."""

from __future__ import annotations

import dataclasses
import re

import pytest

from fp4forge.audit.context import AuditContext
from fp4forge.checkpoint.layout import layout_for_config

CONFIG = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "num_hidden_layers": 4, "num_nextn_predict_layers": 1}
LINEARS = {
    **{f"model.layers.{i}.self_attn.indexer.weights_proj": "attention" for i in range(5)},
    **{f"model.layers.{i}.self_attn.q_a_proj": "attention" for i in range(5)},
    "model.layers.1.self_attn.indexer.weights_proj_x": "attention",
    "model.layers.2.mlp.gate": "router",
    "lm_head": "lm_head",
    "aa.b": "attention",
    "AB.c": "attention",
}
PATTERN_SETS = [
    None,  # the layout's own
    (),
    (r"^model\.layers\.\d+\.self_attn\.indexer\.weights_proj$", r"model\.layers\.3\.", r"lm_"),
    (r"model\.layers\.(\d)\.self_attn\.q_a_proj", r"(a)\1"),  # a back-reference (group numbers shift when joined): not joined
    (r"(?i)ab\.", r"aa"),  # an inline global flag: cannot be joined, falls back
    (r"(?P<x>a)(?P=x)",),
]


@pytest.mark.parametrize("patterns", PATTERN_SETS)
def test_engine_unquantized_is_any_pattern_matching(patterns) -> None:
    layout = layout_for_config(CONFIG)
    if patterns is not None:
        layout = dataclasses.replace(layout, unquantized=tuple(re.compile(p) for p in patterns))
    ctx = AuditContext(ckpt=None, layout=layout, declaration=None, deep=False, fmt="auto", vllm_version=(0, 32))  # type: ignore[arg-type]
    ctx.__dict__["linear_modules"] = dict(LINEARS)
    expected = {m for m, c in LINEARS.items() if c in ("router", "lm_head") or any(p.match(m) for p in layout.unquantized)}
    assert ctx.engine_unquantized == expected
    if patterns is None:
        assert "model.layers.0.self_attn.indexer.weights_proj" in expected  # the layout's pattern is exercised
