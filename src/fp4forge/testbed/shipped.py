"""The testbeds fp4forge ships: versioned model directories beside this module, verified by hash.

``shipped/<name>/`` holds a model directory (weights, tokenizer, chat template, the build's report
and text files) and ``fp4forge-testbed.json``, its manifest: name, version, how it was built (the
recipe and seed, the build's cache key and the inputs that key hashes, the host it was trained on)
and every file's sha256 and size. The testbed's identity is its name, version and ``sha256``, the
hash of that file table. :func:`shipped_testbed` checks every file against the manifest before it
returns the directory (:class:`~fp4forge.errors.ShippedTestbedError` on a missing, added or changed
file), so every machine measures the same bytes; :func:`copy_shipped_testbed` writes a verified
copy with its model card. Building a testbed is research and lives in the lab
(``fp4forge.lab.trained``); reading the shipped one is the product's.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fp4forge.errors import ConfigError, ShippedTestbedError

MANIFEST_FILE = "fp4forge-testbed.json"
MANIFEST_FORMAT = "fp4forge-shipped-testbed/1"
SHIPPED_ROOT = Path(__file__).parent / "shipped"
TRAINED_LAGUNA = "trained-laguna"
CARD_FILE = "README.md"  # written into a copy, never shipped: the card names the identity


@dataclass(frozen=True)
class ShippedTestbed:
    name: str
    version: int
    sha256: str  # of the file table: the identity with name and version
    path: Path
    manifest: dict[str, Any]

    @property
    def label(self) -> str:
        return f"{self.name} v{self.version}"

    def identity(self) -> dict[str, Any]:
        """What a model card's front matter states about it."""
        return {"name": self.name, "version": self.version, "sha256": self.sha256}

    def to_json(self) -> dict[str, Any]:
        return {**self.identity(), "path": str(self.path), "cache_key": self.manifest.get("cache_key"),
                "seed": self.manifest.get("seed"), "host": self.manifest.get("host")}


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def file_table(directory: Path, names: list[str] | None = None) -> dict[str, dict[str, Any]]:
    """Per file of ``directory`` (or of ``names``): its sha256 and size in bytes."""
    chosen = sorted(names) if names is not None else sorted(p.name for p in directory.iterdir() if p.is_file())
    return {name: {"sha256": file_sha256(directory / name), "bytes": (directory / name).stat().st_size} for name in chosen}


def table_sha256(files: dict[str, dict[str, Any]]) -> str:
    """The identity hash: sha256 over the sorted (name, sha256) pairs of a file table."""
    pairs = {name: entry["sha256"] for name, entry in sorted(files.items())}
    return hashlib.sha256(json.dumps(pairs, sort_keys=True).encode()).hexdigest()


def differing_files(directory: Path, files: dict[str, dict[str, Any]], ignore: tuple[str, ...] = ()) -> list[str]:
    """What in ``directory`` differs from a file table: missing, changed and (beside the manifest,
    a card and ``ignore``) added files, each named with how."""
    present = {p.name for p in directory.iterdir() if p.is_file()} - {MANIFEST_FILE, CARD_FILE, *ignore}
    differ = [f"{name} (missing)" for name in sorted(set(files) - present)]
    differ += [f"{name} (not in the manifest)" for name in sorted(present - set(files))]
    for name in sorted(set(files) & present):
        if (directory / name).stat().st_size != files[name]["bytes"] or file_sha256(directory / name) != files[name]["sha256"]:
            differ.append(f"{name} (changed)")
    return differ


def shipped_names(root: Path = SHIPPED_ROOT) -> list[str]:
    return sorted(p.parent.name for p in root.glob(f"*/{MANIFEST_FILE}"))


def read_manifest(name: str, root: Path = SHIPPED_ROOT) -> dict[str, Any]:
    path = root / name / MANIFEST_FILE
    if not path.is_file():
        known = ", ".join(shipped_names(root)) or "none"
        raise ConfigError(f"no shipped testbed {name!r} (shipped: {known})", option="name")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise ShippedTestbedError(f"the manifest of the shipped testbed {name!r} cannot be read: {error}", file=str(path)) from error
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT or not isinstance(manifest.get("files"), dict):
        raise ShippedTestbedError(f"the manifest of the shipped testbed {name!r} is not a {MANIFEST_FORMAT} manifest", file=str(path))
    return manifest


def shipped_testbed(name: str = TRAINED_LAGUNA, root: Path = SHIPPED_ROOT) -> ShippedTestbed:
    """The shipped testbed ``name``, every file verified against its manifest's sha256."""
    manifest = read_manifest(name, root)
    directory = root / name
    differ = differing_files(directory, manifest["files"])
    if differ:
        raise ShippedTestbedError(f"the shipped testbed {name} v{manifest.get('version')} does not match its manifest: {', '.join(differ)}; "
                                  "reinstall fp4forge (or restore the files from the repository)", file=str(directory))
    if table_sha256(manifest["files"]) != manifest.get("sha256"):
        raise ShippedTestbedError(f"the manifest of the shipped testbed {name} states another sha256 than its own file table",
                                  file=str(directory / MANIFEST_FILE))
    return ShippedTestbed(name, int(manifest["version"]), manifest["sha256"], directory, manifest)


def copy_shipped_testbed(out: str | Path, name: str = TRAINED_LAGUNA, root: Path = SHIPPED_ROOT) -> ShippedTestbed:
    """``out`` as a verified copy of the shipped testbed, with its manifest and its model card."""
    from fp4forge.checkpoint.atomic import atomic_output_dir, ensure_fresh_output
    from fp4forge.testbed.card import testbed_card

    out = Path(out)
    ensure_fresh_output(out)
    testbed = shipped_testbed(name, root)
    with atomic_output_dir(out) as staging:
        for item in [*testbed.manifest["files"], MANIFEST_FILE]:
            shutil.copy2(testbed.path / item, staging / item)
        (staging / CARD_FILE).write_text(testbed_card(testbed.identity()), encoding="utf-8")
    if differing_files(out, testbed.manifest["files"]):  # a disk that wrote other bytes
        raise ShippedTestbedError(f"the copy of {testbed.label} in {out} differs from its manifest", file=str(out))
    return ShippedTestbed(testbed.name, testbed.version, testbed.sha256, out, testbed.manifest)


__all__ = ["MANIFEST_FILE", "SHIPPED_ROOT", "TRAINED_LAGUNA", "ShippedTestbed", "copy_shipped_testbed", "differing_files", "file_table",
           "read_manifest", "shipped_testbed", "table_sha256"]
