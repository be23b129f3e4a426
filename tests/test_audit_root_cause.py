"""A shard that cannot be read is one root cause, reported once: the absence findings about the
tensors it holds (parameters missing, KV scales absent, ...) are not reported beside it, and its
finding says how many were held back. A real absence elsewhere is still reported."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from fp4forge.checkpoint.names import INDEX_JSON
from tests.test_audit_integrity import audit, copy_checkpoint, rebuild

SHARD_RULES = {"shard-size-mismatch", "shard-missing"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from fp4forge.testbed import build_tiny_laguna

    return build_tiny_laguna(tmp_path_factory.mktemp("rc") / "tiny", seed=0)


def _truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


def _rules(report) -> set[str]:
    return {f.rule for f in report.findings}


@pytest.mark.parametrize("damage", ["truncated", "missing"])
def test_an_unreadable_shard_is_the_one_error(tiny, tmp_path, damage):
    ckpt = copy_checkpoint(tiny, tmp_path / "ckpt")
    shard = ckpt / "model-00002-of-00003.safetensors"
    _truncate(shard) if damage == "truncated" else shard.unlink()
    report = audit(ckpt)
    errors = [f for f in report.findings if f.severity == "error"]
    assert [f.rule for f in errors] == ["shard-size-mismatch" if damage == "truncated" else "shard-missing"], [f.message for f in errors]
    assert "parameter-missing" not in _rules(report)
    assert "findings that follow from it (parameter-missing" in errors[0].message


def test_an_absence_in_a_readable_shard_is_still_reported(tiny, tmp_path):
    absent = "model.layers.0.input_layernorm.weight"  # a real defect, in no shard
    ckpt = rebuild(tiny, tmp_path / "ckpt", lambda tensors: tensors.pop(absent))
    shards = sorted(set(json.loads((ckpt / INDEX_JSON).read_text())["weight_map"].values()))
    assert len(shards) > 1
    _truncate(ckpt / shards[-1])
    report = audit(ckpt)
    assert {"shard-size-mismatch", "parameter-missing"} <= _rules(report)
    assert absent in next(f for f in report.findings if f.rule == "parameter-missing").tensors
