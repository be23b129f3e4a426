"""The shipped trained testbed: verified by sha256 when loaded, copied with its identity, and a new
build says whether it equals it and why not. Oracles: hashlib over the files, safetensors' own
reader, huggingface_hub's card metadata reader."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from fp4forge.errors import ShippedTestbedError
from fp4forge.testbed.shipped import MANIFEST_FILE, SHIPPED_ROOT, TRAINED_LAGUNA, shipped_testbed


def _independent_identity(directory: Path, names: list[str]) -> str:
    pairs = {name: hashlib.sha256((directory / name).read_bytes()).hexdigest() for name in sorted(names)}
    return hashlib.sha256(json.dumps(pairs, sort_keys=True).encode()).hexdigest()


@pytest.fixture()
def shipped_copy(tmp_path: Path) -> Path:
    """A root holding a copy of the shipped testbed, to damage."""
    shutil.copytree(SHIPPED_ROOT / TRAINED_LAGUNA, tmp_path / "root" / TRAINED_LAGUNA)
    return tmp_path / "root"


def test_the_shipped_testbed_is_verified_and_named_by_the_hash_of_its_files() -> None:
    from safetensors import safe_open

    testbed = shipped_testbed()
    files = sorted(p.name for p in testbed.path.iterdir() if p.name != MANIFEST_FILE)
    assert sorted(testbed.manifest["files"]) == files
    assert testbed.sha256 == _independent_identity(testbed.path, files)
    shards = [name for name in files if name.endswith(".safetensors")]
    assert shards and all(len(safe_open(str(testbed.path / name), "pt").keys()) > 0 for name in shards)
    size = sum((testbed.path / name).stat().st_size for name in files)
    assert size < 40 * 2**20  # a small artifact: a few tens of MB at most
    manifest = testbed.manifest
    assert manifest["seed"] == 0 and manifest["cache_key"] and manifest["host"]["cpu_capability"]
    assert manifest["recipe"].startswith("fp4forge testbed trained-laguna OUT --seed 0")


@pytest.mark.parametrize("damage, named", [
    (lambda d: d.joinpath("config.json").write_text("{}"), "config.json (changed)"),
    (lambda d: d.joinpath("tokenizer.json").unlink(), "tokenizer.json (missing)"),
    (lambda d: d.joinpath("extra.bin").write_bytes(b"x"), "extra.bin (not in the manifest)"),
])
def test_a_changed_missing_or_added_file_is_a_named_error(shipped_copy: Path, damage: Any, named: str) -> None:
    shipped_testbed(TRAINED_LAGUNA, shipped_copy)  # intact: verifies
    damage(shipped_copy / TRAINED_LAGUNA)
    with pytest.raises(ShippedTestbedError, match=named.replace("(", r"\(").replace(")", r"\)")):
        shipped_testbed(TRAINED_LAGUNA, shipped_copy)


def test_a_manifest_that_lies_about_its_identity_or_is_not_one_is_refused(shipped_copy: Path) -> None:
    manifest_path = shipped_copy / TRAINED_LAGUNA / MANIFEST_FILE
    manifest = json.loads(manifest_path.read_text())
    manifest_path.write_text(json.dumps({**manifest, "sha256": "0" * 64}))
    with pytest.raises(ShippedTestbedError, match="another sha256"):
        shipped_testbed(TRAINED_LAGUNA, shipped_copy)
    manifest_path.write_text("[1, 2")
    with pytest.raises(ShippedTestbedError, match="cannot be read"):
        shipped_testbed(TRAINED_LAGUNA, shipped_copy)


def test_cli_writes_a_verified_copy_with_its_identity_in_the_card(tmp_path: Path) -> None:
    from huggingface_hub.repocard import metadata_load

    out = tmp_path / "tb"
    result = subprocess.run([sys.executable, "-m", "fp4forge.cli", "testbed", "shipped", str(out), "--json"], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    shipped = shipped_testbed()
    assert doc["sha256"] == shipped.sha256 and doc["name"] == TRAINED_LAGUNA
    for name in shipped.manifest["files"]:
        assert (out / name).read_bytes() == (shipped.path / name).read_bytes()
    card = metadata_load(out / "README.md")
    assert card["fp4forge_testbed"] == {"name": TRAINED_LAGUNA, "version": shipped.version, "sha256": shipped.sha256}
    assert card["license"] == "apache-2.0" and "base_model" not in card
    again = subprocess.run([sys.executable, "-m", "fp4forge.cli", "testbed", "shipped", str(out)], capture_output=True, text=True, check=False)
    assert again.returncode == 2 and "exists and is not empty" in again.stderr and "Traceback" not in again.stderr


def test_an_export_card_states_the_testbed_identity_and_no_base_model(tmp_path: Path) -> None:
    from fp4forge.report.card_metadata import front_matter
    from fp4forge.testbed.shipped import copy_shipped_testbed

    source = copy_shipped_testbed(tmp_path / "src")
    block, base, unstated = front_matter(tmp_path, {"source": {"location": str(source.path)}}, None, None)
    assert base is None and "base_model" not in block
    assert f"sha256: {source.sha256}" in block and "name: trained-laguna" in block
    assert any("trained-laguna` v1" in line and "no Hub repository" in line for line in unstated)


# -- a new build against the shipped one ------------------------------------------------------------
def _report_like_shipped(**changes: Any) -> dict[str, Any]:
    manifest = shipped_testbed().manifest
    inputs = json.loads(json.dumps(manifest["cache_key_inputs"]))
    host = {k: v for k, v in manifest["host"].items() if k != "recorded"}
    report = {"cache_key_inputs": inputs, "host": host}
    for path, value in changes.items():
        *parents, leaf = path.split(".")
        target = report
        for part in parents:
            target = target[part]
        target[leaf] = value
    return report


@pytest.mark.parametrize("changes, reason", [
    ({}, "not explained"),
    ({"host.cpu_capability": "AVX2", "host.cpu_model": "Other CPU"}, "torch used AVX2 kernels on Other CPU"),
    ({"host.device": "cuda"}, "trained on cuda"),
    ({"cache_key_inputs.training.steps": 2000}, "other training settings: steps"),
    ({"cache_key_inputs.seed": 1}, "other seed"),
    ({"cache_key_inputs.versions.torch": "9.9"}, "torch 9.9 (shipped: built with"),
    ({"cache_key_inputs.code.fp4forge.quality.runner": "0"}, "the code changed since v1 was shipped: fp4forge.quality.runner"),
])
def test_why_a_build_differs_names_the_input_or_the_host(changes: dict[str, Any], reason: str) -> None:
    from fp4forge.lab.trained.ship import why_builds_differ

    flat = {k: v for k, v in changes.items() if not k.startswith("cache_key_inputs.code.")}
    report = _report_like_shipped(**flat)
    for key, value in changes.items():
        if key.startswith("cache_key_inputs.code."):
            report["cache_key_inputs"]["code"][key.removeprefix("cache_key_inputs.code.")] = value
    reasons = why_builds_differ(report, shipped_testbed().manifest)
    assert any(reason in line for line in reasons), reasons


def test_a_build_with_the_shipped_bytes_compares_equal_and_a_changed_one_does_not(tmp_path: Path) -> None:
    from fp4forge.lab.trained.ship import compare_with_shipped
    from fp4forge.testbed.shipped import copy_shipped_testbed

    build = copy_shipped_testbed(tmp_path / "build").path
    (build / "fp4forge-training.json").write_text("{}")  # the report holds its own wall clock: not compared
    same = compare_with_shipped(build, _report_like_shipped())
    assert same["same_bytes"] and same["reasons"] == [] and same["shipped"]["sha256"] == shipped_testbed().sha256
    shard = sorted(build.glob("*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:-1] + b"\0")
    other = compare_with_shipped(build, _report_like_shipped(**{"host.cpu_capability": "AVX2"}))
    assert not other["same_bytes"] and other["differing_files"] == [f"{shard.name} (changed)"]
    assert "AVX2" in other["reasons"][0]


def test_cli_build_says_how_it_differs_from_the_shipped_testbed(tmp_path: Path) -> None:
    """The untrained init (--steps 0) of the shipped seed: the same inputs but the training settings."""
    out = tmp_path / "init"
    result = subprocess.run([sys.executable, "-m", "fp4forge.cli", "testbed", "trained-laguna", str(out), "--steps", "0", "--json"],
                            capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
    comparison = json.loads(result.stdout)["shipped_comparison"]
    assert comparison["shipped"]["sha256"] == shipped_testbed().sha256 and not comparison["same_bytes"]
    assert any(name.endswith(".safetensors (changed)") for name in comparison["differing_files"])
    assert comparison["reasons"][0] == "other training settings: steps"
    assert "fp4forge-training.json" not in " ".join(comparison["differing_files"])  # its timing differs between any two builds
