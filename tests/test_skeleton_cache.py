"""The audit's skeleton cache: a hit equals a fresh build, the key follows the config, a damaged
entry is rebuilt, and a hit imports neither torch nor transformers (the point of the cache)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fp4forge.checkpoint import skeleton, skeleton_cache


@pytest.fixture()
def config(tiny_laguna_dense_dir: Path) -> dict:
    return json.loads((tiny_laguna_dense_dir / "config.json").read_text())


@pytest.fixture(autouse=True)
def private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("FP4FORGE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_a_hit_equals_a_fresh_build(config: dict, private_cache: Path) -> None:
    fresh = skeleton.expected_tensor_specs(config)
    first = skeleton_cache.expected_tensor_specs(config)
    entries = list((private_cache / "skeletons").iterdir())
    assert len(entries) == 1
    second = skeleton_cache.expected_tensor_specs(config)
    assert first == second == fresh


def test_the_key_follows_the_config_and_a_damaged_entry_is_rebuilt(config: dict, private_cache: Path) -> None:
    skeleton_cache.expected_tensor_specs(config)
    wider = {**config, "vocab_size": config["vocab_size"] + 128}
    assert skeleton_cache.cache_key(wider) != skeleton_cache.cache_key(config)
    shapes = {s.name: s.shape for s in skeleton_cache.expected_tensor_specs(wider)}
    assert shapes["model.embed_tokens.weight"][0] == config["vocab_size"] + 128
    assert skeleton_cache.expected_tensor_specs(config) == skeleton.expected_tensor_specs(config)
    entry = private_cache / "skeletons" / f"{skeleton_cache.cache_key(config)}.json"
    entry.write_text("{ not json")
    assert skeleton_cache.expected_tensor_specs(config) == skeleton.expected_tensor_specs(config)
    assert json.loads(entry.read_text())  # rewritten


def test_a_cached_audit_imports_neither_torch_nor_transformers(tiny_laguna_dense_dir: Path, private_cache: Path) -> None:
    probe = ("import sys; from fp4forge.audit.engine import audit_checkpoint; r = audit_checkpoint(sys.argv[1]); "
             "print(r.summary['errors'], 'transformers' in sys.modules, 'torch' in sys.modules)")
    env = {**os.environ, "FP4FORGE_CACHE_DIR": str(private_cache)}
    runs = [subprocess.run([sys.executable, "-c", probe, str(tiny_laguna_dense_dir)], capture_output=True, text=True, env=env,
                           timeout=300) for _ in range(2)]
    assert [r.returncode for r in runs] == [0, 0], runs[0].stderr + runs[1].stderr
    assert runs[0].stdout.split() == ["0", "True", "True"]  # the first audit builds the skeleton
    # warm: neither, though the testbed ships a chat template (rendered without transformers,
    # checkpoint/chat_template.py)
    assert runs[1].stdout.split() == ["0", "False", "False"]
