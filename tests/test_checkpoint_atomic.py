"""checkpoint/atomic.py: nothing is visible at the destination until the output is complete; an
error leaves the destination as it was and no temporary file behind."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from fp4forge.checkpoint import atomic
from fp4forge.checkpoint.atomic import atomic_file, atomic_output_dir, staged_files, write_json_atomic, write_text_atomic
from fp4forge.errors import ConfigError


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def _spy_replace(monkeypatch, seen: list):
    real = os.replace

    def spy(src, dst):
        seen.append((Path(src), Path(dst), Path(dst).read_bytes() if Path(dst).is_file() else None))
        real(src, dst)

    monkeypatch.setattr(atomic.os, "replace", spy)


def test_write_text_is_invisible_until_the_rename(tmp_path: Path, monkeypatch, umask_022) -> None:
    seen: list = []
    _spy_replace(monkeypatch, seen)
    dest = tmp_path / "new" / "report.json"
    write_text_atomic(dest, "complete ✓\n")
    [(src, dst, before)] = seen
    assert dst == dest and before is None and src.parent == dest.parent and src != dest
    assert dest.read_text(encoding="utf-8") == "complete ✓\n"
    assert stat.S_IMODE(dest.stat().st_mode) == 0o644  # the umask's mode, not mkstemp's 0600
    assert os.listdir(dest.parent) == ["report.json"]


def test_json_helper(tmp_path: Path) -> None:
    write_json_atomic(tmp_path / "doc.json", {"b": 1, "a": [2]}, sort_keys=True)
    assert (tmp_path / "doc.json").read_text() == '{\n  "a": [\n    2\n  ],\n  "b": 1\n}\n'


def test_atomic_file_keeps_the_old_file_until_done_and_on_error(tmp_path: Path) -> None:
    dest = tmp_path / "stats.safetensors"
    dest.write_text("old")
    with atomic_file(dest) as tmp:
        tmp.write_text("half")
        assert dest.read_text() == "old"  # the reader still sees the previous version
        tmp.write_text("new")
    assert dest.read_text() == "new"
    with pytest.raises(RuntimeError):
        with atomic_file(dest) as tmp:
            tmp.write_text("broken")
            raise RuntimeError("interrupted")
    assert dest.read_text() == "new"
    assert sorted(os.listdir(tmp_path)) == ["stats.safetensors"]


def test_staged_files_rename_in_order_and_all_or_nothing(tmp_path: Path, monkeypatch) -> None:
    seen: list = []
    _spy_replace(monkeypatch, seen)
    with staged_files(tmp_path) as stage:
        for name in ("shard.safetensors", "index.json", "config.json"):
            stage.path(name).write_text(name)
        assert os.listdir(tmp_path) and not any((tmp_path / n).exists() for n in ("shard.safetensors", "index.json", "config.json"))
    assert [dst.name for _, dst, _ in seen] == ["shard.safetensors", "index.json", "config.json"]
    seen.clear()
    with pytest.raises(ValueError):
        with staged_files(tmp_path) as stage:
            stage.path("index.json").write_text("changed")
            raise ValueError("second file failed")
    assert seen == [] and (tmp_path / "index.json").read_text() == "index.json"
    assert sorted(os.listdir(tmp_path)) == ["config.json", "index.json", "shard.safetensors"]


def test_atomic_output_dir(tmp_path: Path, umask_022) -> None:
    out = tmp_path / "ckpt"
    with atomic_output_dir(out) as staging:
        (staging / "config.json").write_text("{}")
        assert not out.exists()  # nothing at the destination until the block completes
    assert os.listdir(out) == ["config.json"]
    assert stat.S_IMODE(out.stat().st_mode) == 0o755 and stat.S_IMODE((out / "config.json").stat().st_mode) == 0o644
    failed = tmp_path / "failed"
    with pytest.raises(KeyError):
        with atomic_output_dir(failed) as staging:
            (staging / "model.safetensors").write_bytes(b"half")
            raise KeyError("interrupted")
    assert not failed.exists()
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # no .partial directory left
    with pytest.raises(ConfigError, match="exists and is not empty"):
        with atomic_output_dir(out):
            pass
