"""The fidelity evaluator reads a third-party W4A4 export: llm-compressor's NVFP4 + FP8-KV
compressed-tensors checkpoint of the tiny Laguna (session fixture from tests/fixtures_lc.py)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from fp4forge.fidelity.evaluate import FidelityOptions, evaluate


@pytest.mark.slow
def test_fidelity_scores_llm_compressor_w4a4_export(lc_source_dir: Path, lc_nvfp4_kv_dir: Path) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        report = evaluate(lc_source_dir, lc_nvfp4_kv_dir, FidelityOptions(samples=4, seq_len=128, batch_size=4, builtin_corpus=True, allow_unreadable=True))
    finally:
        torch.set_num_threads(threads)
    kl = report.metrics["kl"]
    assert kl["mean"] > 0 and math.isfinite(kl["p99"])
    assert report.kv_cache == "fp8 with the checkpoint's k/v scales"
    assert report.activation_quantized_gemm_inputs > 3 * 2 * 16, "routed experts and the other Linears run W4A4"
    assert len(report.layers) == 4 and all(layer["relative_error"] > 0 for layer in report.layers)
