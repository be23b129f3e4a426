"""The shipped trained testbed: made from a cache build, and what a new build says about it.

``write_shipped_testbed`` turns a CPU cache build (``cached_trained_laguna``) into the versioned
directory the product reads (``fp4forge.testbed.shipped``): its files, their sha256 hashes, the
recipe, seed, cache key and the inputs the key hashes, and the host it was trained on.
``compare_with_shipped`` holds a build against it: the same bytes, or which inputs differ (seed,
settings, code, library versions) and, with the same key, the kind of CPU it trained on (another
kind dispatches other kernels, which round differently).

    python -m fp4forge.lab.trained.ship MODEL_DIR --version N   # ship a cache build as version N
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Any

from fp4forge.checkpoint.atomic import atomic_output_dir
from fp4forge.errors import ConfigError
from fp4forge.lab.trained.training import REPORT_FILE
from fp4forge.testbed.shipped import (CARD_FILE, MANIFEST_FILE, MANIFEST_FORMAT, SHIPPED_ROOT, TRAINED_LAGUNA, ShippedTestbed, differing_files,
                                      file_table, shipped_testbed, table_sha256)

# Files whose bytes differ between two builds of the same model: the report holds the wall clock.
VARIES_BETWEEN_BUILDS = (REPORT_FILE,)


def _recipe(report: dict[str, Any]) -> str:
    steps = report["training"]["steps"]
    return f"fp4forge testbed trained-laguna OUT --seed {report['seed']} --steps {steps} --threads {report['training']['threads']} --cache"


def _key_inputs(report: dict[str, Any]) -> dict[str, Any]:
    """The key inputs of a build's settings under the current code; refused unless they hash to the
    report's cache key (a GPU build, or a build of other code, is not what would ship)."""
    from dataclasses import fields

    from fp4forge.lab.trained.build import prepare_build
    from fp4forge.lab.trained.training import TrainingConfig
    from fp4forge.lab.trained.training_corpus import CorpusSpec

    corpus = report.get("corpus", {})
    spec = CorpusSpec(**{f.name: _tupled(corpus[f.name]) for f in fields(CorpusSpec) if f.name in corpus})
    prepared = prepare_build(report["seed"], TrainingConfig(**report["training"]), spec)
    if report.get("cache_key") != prepared.key:
        raise ConfigError(f"the build's cache key {report.get('cache_key')} is not the current code's key {prepared.key} for its settings: "
                          f"ship a CPU build of this code (`{_recipe(report)}`)")
    return prepared.key_inputs


def _tupled(value: Any) -> Any:
    """JSON lists back to the tuples CorpusSpec holds (pairs of family weights, ranges)."""
    return tuple(_tupled(v) for v in value) if isinstance(value, list) else value


def shipped_manifest(model_dir: Path, version: int, name: str = TRAINED_LAGUNA) -> dict[str, Any]:
    """The manifest of a CPU build whose cache key the current code reproduces."""
    from fp4forge.lab.trained.build import build_host

    report = json.loads((model_dir / REPORT_FILE).read_text(encoding="utf-8"))
    inputs = _key_inputs(report)
    # A report from before builds recorded their host: the shipping machine's, said so.
    host = report.get("host") or {**build_host(), "recorded": "when shipped (the build report holds no host)"}
    files = file_table(model_dir, [p.name for p in model_dir.iterdir() if p.is_file() and p.name not in (CARD_FILE, MANIFEST_FILE)])
    return {
        "format": MANIFEST_FORMAT, "name": name, "version": version, "sha256": table_sha256(files),
        "recipe": _recipe(report), "seed": report["seed"], "training": report["training"], "corpus_spec": inputs["corpus_spec"],
        "cache_key": report["cache_key"], "cache_key_inputs": inputs, "host": host,
        "heldout_perplexity": report["heldout_perplexity"], "varies_between_builds": list(VARIES_BETWEEN_BUILDS), "files": files,
    }


def write_shipped_testbed(model_dir: str | Path, version: int, name: str = TRAINED_LAGUNA, root: Path = SHIPPED_ROOT) -> ShippedTestbed:
    """``root/name`` as the shipped testbed ``name`` version ``version``, made from ``model_dir``."""
    model_dir = Path(model_dir)
    manifest = shipped_manifest(model_dir, version, name)
    target = root / name
    if target.exists():
        shutil.rmtree(target)  # a new version replaces the old one; git keeps the history
    with atomic_output_dir(target) as staging:
        for item in manifest["files"]:
            shutil.copy2(model_dir / item, staging / item)
        (staging / MANIFEST_FILE).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    return shipped_testbed(name, root)


def _changed(a: Any, b: Any) -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
    return [] if a == b else ["value"]


def why_builds_differ(report: dict[str, Any], manifest: dict[str, Any]) -> list[str]:
    """Why a build's bytes are not the shipped ones, as far as the two records say."""
    reasons = []
    host, shipped_host = report.get("host") or {}, manifest.get("host") or {}
    if host.get("device", "cpu") != "cpu":
        reasons.append(f"trained on {host['device']}: GPU arithmetic rounds unlike the CPU build the testbed ships")
    inputs, shipped = report.get("cache_key_inputs") or {}, manifest["cache_key_inputs"]
    for field, what in (("seed", "seed"), ("training", "training settings"), ("corpus_spec", "corpus settings")):
        if inputs.get(field) != shipped.get(field):
            reasons.append(f"other {what}: {', '.join(_changed(inputs.get(field), shipped.get(field)))}")
    code = _changed(inputs.get("code"), shipped.get("code"))
    if code:
        reasons.append(f"the code changed since v{manifest['version']} was shipped: {', '.join(code)}")
    for dist in _changed(inputs.get("versions"), shipped.get("versions")):
        reasons.append(f"{dist} {inputs.get('versions', {}).get(dist)} (shipped: built with {shipped['versions'].get(dist)})")
    explained = bool(reasons)  # the corpus and tokenizer follow from the seed, settings and code
    for field in ("python", "chat_template", "tool_catalogue", "format", "corpus", "tokenizer"):
        if inputs.get(field) != shipped.get(field) and not (explained and field in ("corpus", "tokenizer")):
            values = f" ({inputs.get(field)}; shipped: {shipped.get(field)})" if field in ("python", "format") else ""
            reasons.append(f"its {field.replace('_', ' ')} differs from the shipped build's{values}")
    if not reasons and host.get("cpu_capability") != shipped_host.get("cpu_capability"):
        reasons.append(f"the same inputs (cache key {manifest['cache_key']}) on another kind of CPU: torch used {host.get('cpu_capability')} kernels "
                       f"on {host.get('cpu_model')}, the shipped build {shipped_host.get('cpu_capability')} on {shipped_host.get('cpu_model')}; "
                       "their sums round differently")
    return reasons or ["the same inputs and the same kind of CPU, yet other bytes: not explained by what the two builds record"]


def compare_with_shipped(model_dir: str | Path, report: dict[str, Any], name: str = TRAINED_LAGUNA, root: Path = SHIPPED_ROOT) -> dict[str, Any]:
    """A build against the shipped testbed: equal model bytes, or which files differ and why."""
    testbed = shipped_testbed(name, root)
    ignore = tuple(testbed.manifest.get("varies_between_builds", ()))
    files = {k: v for k, v in testbed.manifest["files"].items() if k not in ignore}
    differ = differing_files(Path(model_dir), files, ignore)
    return {"shipped": testbed.identity(), "same_bytes": not differ, "differing_files": differ,
            "reasons": why_builds_differ(report, testbed.manifest) if differ else []}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", type=Path, help="a CPU cache build (fp4forge testbed trained-laguna OUT --cache, or its cache entry)")
    parser.add_argument("--version", type=int, required=True)
    args = parser.parse_args(argv)
    testbed = write_shipped_testbed(args.model_dir, args.version)
    print(f"shipped {testbed.label} (sha256 {testbed.sha256}) at {testbed.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
