"""`fp4forge diff A B`: per-tensor identity by blake2b of the raw bytes, streamed tensor by
tensor in chunks; counts per component; --values gives max abs / rel differences; local and
remote (loopback HTTP) checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import typer
from typer.testing import CliRunner

from fp4forge.checkpoint import raw
from fp4forge.audit.diff import diff_checkpoints
from fp4forge.audit.options import DiffOptions
from fp4forge.cli.audit import register
from fp4forge.errors import Fp4forgeError
from tests.http_repo_server import RepoServer
from tests.test_audit_integrity import copy_checkpoint, load_tensors, rebuild

CHANGED = "model.layers.1.mlp.experts.5.up_proj.weight"
RECAST = "model.layers.0.self_attn.q_norm.weight"
REMOVED = "model.layers.3.mlp.shared_expert.down_proj.weight"
ADDED = "model.layers.3.mlp.shared_expert.down_proj.bias"


@pytest.fixture(scope="module")
def edited(lc_source_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Laguna with one tensor nudged, one re-cast to F32, one removed and one added."""

    def edit(tensors: dict[str, torch.Tensor]) -> None:
        tensors[CHANGED][2, 3] += 0.5
        tensors[RECAST] = tensors[RECAST].to(torch.float32)
        del tensors[REMOVED]
        tensors[ADDED] = torch.zeros(256, dtype=torch.bfloat16)

    return rebuild(lc_source_dir, tmp_path_factory.mktemp("diff") / "edited", edit)


def test_a_copy_is_identical(lc_source_dir: Path, tmp_path: Path) -> None:
    report = diff_checkpoints(lc_source_dir, copy_checkpoint(lc_source_dir, tmp_path / "copy"))
    assert report.summary == {"identical": 201, "different": 0, "only_in_a": 0, "only_in_b": 0}
    assert report.exit_code == 0
    assert report.components["routed_experts"]["identical"] == 3 * 16 * 3


def test_statuses_reasons_and_components(lc_source_dir: Path, edited: Path) -> None:
    report = diff_checkpoints(lc_source_dir, edited)
    by_name = {e.name: e for e in report.entries}
    assert (by_name[CHANGED].status, by_name[CHANGED].reason) == ("different", "bytes")
    assert (by_name[RECAST].status, by_name[RECAST].reason) == ("different", "dtype")
    assert by_name[REMOVED].status == "only_in_a" and by_name[ADDED].status == "only_in_b"
    assert report.summary == {"identical": 198, "different": 2, "only_in_a": 1, "only_in_b": 1}
    assert report.components["routed_experts"]["different"] == 1
    assert report.components["shared_expert"] == {"identical": 8, "different": 0, "only_in_a": 1, "only_in_b": 1}
    assert by_name[CHANGED].max_abs is None  # values only when asked
    assert report.exit_code == 1


def test_values_give_max_abs_and_rel_difference(lc_source_dir: Path, edited: Path) -> None:
    report = diff_checkpoints(lc_source_dir, edited, DiffOptions(values=True))
    by_name = {e.name: e for e in report.entries}
    before = load_tensors(lc_source_dir)[CHANGED].float()
    after = load_tensors(edited)[CHANGED].float()
    expected_abs = float((before - after).abs().max())
    assert by_name[CHANGED].max_abs == pytest.approx(expected_abs)
    assert by_name[CHANGED].max_rel == pytest.approx(expected_abs / float(before.abs().max()))
    assert by_name[RECAST].max_abs == 0.0  # BF16 -> F32 is exact: different bytes, same values


def test_hashing_streams_in_chunks(lc_source_dir: Path, edited: Path, monkeypatch) -> None:
    monkeypatch.setattr(raw, "RAW_CHUNK_BYTES", 4096)
    from fp4forge.checkpoint.source import LocalSource

    largest: list[int] = []
    real_read = LocalSource.read

    def spy(self, relpath, start=0, length=None):
        largest.append(length if length is not None else 1 << 62)
        return real_read(self, relpath, start, length)

    monkeypatch.setattr(LocalSource, "read", spy)
    report = diff_checkpoints(lc_source_dir, edited)
    assert report.summary["different"] == 2
    tensor_reads = [n for n in largest if n != 1 << 62]
    assert tensor_reads and max(tensor_reads) <= 4096  # whole-file reads are only the small JSON files


def test_cli_json_and_exit_codes(lc_source_dir: Path, edited: Path, tmp_path: Path) -> None:
    app = typer.Typer()

    @app.callback()
    def main() -> None:
        """test app"""

    register(app)
    runner = CliRunner()
    result = runner.invoke(app, ["diff", str(lc_source_dir), str(edited), "--json", "--values"])
    assert result.exit_code == 1
    doc = json.loads(result.stdout)
    assert doc["summary"]["different"] == 2 and {t["name"] for t in doc["tensors"]} == {CHANGED, RECAST, REMOVED, ADDED}
    human = runner.invoke(app, ["diff", str(lc_source_dir), str(edited)])
    assert human.exit_code == 1 and "routed_experts" in human.stdout
    same = runner.invoke(app, ["diff", str(lc_source_dir), str(lc_source_dir), "--markdown"])
    assert same.exit_code == 0 and "| **total** | **201** |" in same.stdout
    missing = runner.invoke(app, ["diff", str(lc_source_dir), str(tmp_path / "nothing-here")])
    assert missing.exit_code == 2 and missing.stderr.startswith("error: could not diff")


def test_remote_diff_equals_local_diff(lc_source_dir: Path, edited: Path) -> None:
    with RepoServer({"org/a": lc_source_dir, "org/b": edited}) as server:
        remote = diff_checkpoints(f"{server.endpoint}/org/a/resolve/main", f"{server.endpoint}/org/b/resolve/main", DiffOptions(values=True))
    local = diff_checkpoints(lc_source_dir, edited, DiffOptions(values=True))
    assert remote.to_json()["tensors"] == local.to_json()["tensors"] and remote.summary == local.summary


def test_unreadable_checkpoint_raises_a_named_error(lc_source_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(Fp4forgeError):
        diff_checkpoints(lc_source_dir, tmp_path / "absent")
