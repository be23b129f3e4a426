"""The calibration-statistics file (checkpoint/stats.py): what is written reads back the same,
as the safetensors library sees it too, and every way a file can break the schema is a named
error (StatsFileError, exit code 2), never a traceback or a silently wrong amax."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from fp4forge.checkpoint.stats import STATS_MARKER, kv_amax_name, read_stats, write_stats
from fp4forge.errors import ConfigError, StatsFileError

LAYER = "model.layers.0"
MODULE = f"{LAYER}.mlp.experts.3.down_proj"
CALIBRATION = {"moe_policy": "routed", "tokens_per_expert": {f"{LAYER}.mlp.experts": [5, 0]}, "experts_without_tokens": [f"{LAYER}.mlp.experts.1"]}


def tensors() -> dict[str, torch.Tensor]:
    return {
        f"{MODULE}.input_amax": torch.tensor([3.25]),
        f"{LAYER}.self_attn.k_amax": torch.tensor([7.5]),
        f"{LAYER}.self_attn.v_amax": torch.tensor([0.5]),
        f"{LAYER}.self_attn.k_amax_per_head": torch.tensor([7.5, 2.0]),
        f"{LAYER}.self_attn.v_amax_per_head": torch.tensor([0.25, 0.5]),
    }


def test_round_trip(tmp_path: Path) -> None:
    path = write_stats(tmp_path / "sub" / "stats.safetensors", tensors(), CALIBRATION)
    with safe_open(str(path), framework="pt") as fh:  # the library's own reading of what we wrote
        assert fh.metadata()[STATS_MARKER] == "1"
        assert json.loads(fh.metadata()["calibration"]) == CALIBRATION
        assert {n: fh.get_tensor(n).tolist() for n in fh.keys()} == {n: t.tolist() for n, t in tensors().items()}
    stats = read_stats(path)
    assert stats.calibration == CALIBRATION
    assert all(torch.equal(stats.tensors[n], t) for n, t in tensors().items()) and stats.tensors.keys() == tensors().keys()
    assert stats.input_amax(MODULE) == 3.25
    assert stats.kv_amax(LAYER) == (7.5, 0.5)
    assert stats.tensor(kv_amax_name(LAYER, "v", per_head=True)).tolist() == [0.25, 0.5]
    assert [p.name for p in path.parent.iterdir()] == ["stats.safetensors"]  # no temp file left


def _raw_file(path: Path, entries: dict[str, torch.Tensor], metadata: dict[str, str] | None) -> Path:
    save_file(entries, str(path), metadata=metadata)
    return path


MARKED = {STATS_MARKER: "1", "calibration": json.dumps(CALIBRATION)}


@pytest.mark.parametrize(
    ("case", "entries", "metadata", "message"),
    [
        ("no marker", tensors(), {"format": "pt"}, "not an fp4forge statistics file"),
        ("future version", tensors(), {**MARKED, STATS_MARKER: "2"}, "statistics format '2'"),
        ("no calibration record", tensors(), {STATS_MARKER: "1"}, "has no 'calibration' metadata"),
        ("record not JSON", tensors(), {**MARKED, "calibration": "{oops"}, "is not JSON"),
        ("record not an object", tensors(), {**MARKED, "calibration": "[1, 2]"}, "is not a JSON object"),
        ("BF16 entry", {**tensors(), f"{MODULE}.input_amax": torch.tensor([3.25], dtype=torch.bfloat16)}, MARKED, "statistics are F32"),
        ("scalar of two", {**tensors(), f"{LAYER}.self_attn.k_amax": torch.tensor([1.0, 2.0])}, MARKED, r"shape \[2\], expected \[1\]"),
        ("empty per head", {**tensors(), f"{LAYER}.self_attn.k_amax_per_head": torch.zeros(0)}, MARKED, r"expected \[num_kv_heads\]"),
        ("unknown name", {**tensors(), "model.norm.weight": torch.ones(4)}, MARKED, "is not a statistics entry"),
        ("NaN amax", {**tensors(), f"{MODULE}.input_amax": torch.tensor([float("nan")])}, MARKED, "finite and >= 0"),
        ("negative amax", {**tensors(), f"{LAYER}.self_attn.v_amax_per_head": torch.tensor([0.5, -1.0])}, MARKED, "finite and >= 0"),
    ],
)
def test_malformed_file_is_a_named_error(tmp_path: Path, case: str, entries, metadata, message: str) -> None:
    path = _raw_file(tmp_path / "stats.safetensors", entries, metadata)
    with pytest.raises(StatsFileError, match=message) as caught:
        read_stats(path)
    assert caught.value.file == str(path)
    assert isinstance(caught.value, ConfigError) and caught.value.exit_code == 2


def test_not_safetensors_at_all(tmp_path: Path) -> None:
    (tmp_path / "stats.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00garbage!")
    with pytest.raises(StatsFileError, match="cannot read statistics file"):
        read_stats(tmp_path / "stats.safetensors")
    with pytest.raises(StatsFileError, match="cannot read statistics file"):
        read_stats(tmp_path / "absent.safetensors")


def test_missing_entry_names_it(tmp_path: Path) -> None:
    stats = read_stats(write_stats(tmp_path / "stats.safetensors", tensors(), CALIBRATION))
    with pytest.raises(StatsFileError, match="model.layers.9.self_attn.k_amax.*calibrated on this model"):
        stats.kv_amax("model.layers.9")


def test_write_refuses_non_f32_and_leaves_nothing(tmp_path: Path) -> None:
    with pytest.raises(StatsFileError, match="must be F32"):
        write_stats(tmp_path / "stats.safetensors", {**tensors(), f"{MODULE}.input_amax": torch.tensor([1.0], dtype=torch.float16)}, CALIBRATION)
    assert list(tmp_path.iterdir()) == []
