"""Fixtures shared by the calibration, KV and fidelity tests (import them into a test module)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers.utils import logging as hf_logging

from fp4forge.testbed.tiny import build_tiny_laguna, build_tiny_qwen3_moe

BUILDERS = {"laguna": build_tiny_laguna, "qwen3_moe": build_tiny_qwen3_moe}


@pytest.fixture(autouse=True, scope="module")
def one_thread():  # module scope: active before the module-scoped fixtures too
    """Two OpenMP threads on a shared two-core machine make bf16 index_add_ 10x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    hf_logging.disable_progress_bar()
    yield
    torch.set_num_threads(threads)


def tiny(tmp_path_factory: pytest.TempPathFactory, kind: str) -> Path:
    """One tiny model per session, shared by the calibration, KV and fidelity tests."""
    path = tmp_path_factory.getbasetemp() / f"calib-tiny-{kind}"
    if not path.exists():
        BUILDERS[kind](path, seed=0)
    return path


@pytest.fixture(scope="module")
def laguna(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny(tmp_path_factory, "laguna")
