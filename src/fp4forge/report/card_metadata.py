"""The model card's YAML front matter, in the Hugging Face Hub's own terms.

``huggingface_hub.ModelCardData`` writes it (and ``ModelCard.load`` reads it back), so the keys
are the Hub's: ``base_model`` with ``base_model_relation: quantized`` (the Hub's model tree),
``license``, ``tags``, ``pipeline_tag``. Each value comes from an authority or is left out:

* ``base_model``: the ``--base-model`` repository id, else the source's own: the location it was
  exported from when that is a Hub repository (``REPO_ID@REVISION``) or a Hugging Face cache
  snapshot (``…/models--ORG--NAME/snapshots/REV``), else the ``_name_or_path`` transformers wrote
  into the source's config.json when that is a repository id (a bare local path is never one);
* ``license``: the source's model card front matter (its README.md);
* ``fp4forge_testbed``: a shipped fp4forge testbed's identity (name, version, sha256 of its files),
  carried over from the source's card: the testbed has no Hub repository, so it is never a
  ``base_model``;
* ``tags``: fp4forge, the declared layout and schemes (``checkpoint.declarations``), vllm.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from fp4forge.checkpoint.declarations import read_declaration
from fp4forge.checkpoint.names import CONFIG_JSON, HF_QUANT_CONFIG_JSON
from fp4forge.testbed.card import IDENTITY_KEY, identity_line

CARD_FILE = "README.md"
PIPELINE_TAG = "text-generation"  # every architecture fp4forge exports is a causal LM
CACHE_SNAPSHOT = re.compile(r"(?:^|/)models--([^/]+?)--([^/]+)/snapshots/")


def _repo_id(text: Any) -> str | None:
    """``text`` when it is a Hub repository id (``org/name``) and not a local path."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if not isinstance(text, str) or text.count("/") != 1 or Path(text).exists():
        return None
    try:
        validate_repo_id(text)
    except HFValidationError:
        return None
    return text


def _source_dir(location: str | None) -> Path | None:
    return Path(location) if location and Path(location).is_dir() else None


def source_repo_id(location: str | None) -> str | None:
    """The Hub repository the export's source is, as far as the source itself says."""
    if not location:
        return None
    snapshot = CACHE_SNAPSHOT.search(Path(location).resolve().as_posix() if Path(location).exists() else location)
    if snapshot:
        return f"{snapshot.group(1)}/{snapshot.group(2)}"
    remote = location.partition("@")[0] if "@" in location else None  # a Hub source reads as REPO_ID@REVISION
    if remote and _repo_id(remote):
        return remote
    source = _source_dir(location)
    if source is not None and (source / CONFIG_JSON).is_file():
        try:
            return _repo_id(json.loads((source / CONFIG_JSON).read_text(encoding="utf-8")).get("_name_or_path"))
        except (OSError, ValueError, AttributeError):
            return None
    return None


def source_card_metadata(location: str | None) -> dict[str, Any]:
    """The front matter of the source's own model card ({} when it has none)."""
    from huggingface_hub.repocard import metadata_load

    source = _source_dir(location)
    if source is None or not (source / CARD_FILE).is_file():
        return {}
    try:
        return metadata_load(source / CARD_FILE) or {}
    except (OSError, ValueError):
        return {}


def quantization_tags(config: dict[str, Any] | None, extra_json: dict[str, Any]) -> list[str]:
    """Tags for the layout and number formats the checkpoint declares."""
    declaration = read_declaration(config, extra_json)
    if declaration is None:
        return []
    schemes = [g.scheme.replace("_", "-") for g in declaration.groups if g.scheme]
    kv = [f"{declaration.kv.algo}-kv-cache"] if declaration.kv else []
    return list(dict.fromkeys([declaration.format, *schemes, *kv]))


def shipped_testbed_identity(source_meta: dict[str, Any]) -> dict[str, Any] | None:
    """The source card's ``fp4forge_testbed`` (name, version, sha256), when it states all three."""
    identity = source_meta.get(IDENTITY_KEY)
    if isinstance(identity, dict) and {"name", "version", "sha256"} <= set(identity):
        return {key: identity[key] for key in ("name", "version", "sha256")}
    return None


def front_matter(checkpoint: Path, provenance: dict[str, Any] | None, config: dict[str, Any] | None, base_model: str | None) -> tuple[str, str | None, list[str]]:
    """The card's front matter block, the base model's repository id it names (or None) and the
    facts it could not state (for the card's non-claims)."""
    from huggingface_hub import ModelCardData

    location = ((provenance or {}).get("source") or {}).get("location")
    base = base_model or source_repo_id(location)
    source_meta = source_card_metadata(location)
    license_id = source_meta.get("license")
    testbed = shipped_testbed_identity(source_meta)
    extra, unstated = {}, []
    if (checkpoint / HF_QUANT_CONFIG_JSON).is_file():
        try:
            extra[HF_QUANT_CONFIG_JSON] = json.loads((checkpoint / HF_QUANT_CONFIG_JSON).read_text(encoding="utf-8"))
        except (OSError, ValueError) as error:
            unstated.append(f"`{HF_QUANT_CONFIG_JSON}` is present but corrupt ({error}): the tags name no quantization it declares.")
    tags = ["fp4forge", "quantized", *quantization_tags(config, extra), "vllm"]
    data = ModelCardData(base_model=base, license=license_id, tags=list(dict.fromkeys(tags)), pipeline_tag=PIPELINE_TAG,
                         **({"base_model_relation": "quantized"} if base else {}), **({IDENTITY_KEY: testbed} if testbed else {}))
    if base is None and testbed is not None:
        unstated.append(f"The front matter names no `base_model`: the source is {identity_line(testbed)}, which has no Hub repository; "
                        f"`{IDENTITY_KEY}` states its identity.")
    elif base is None:
        unstated.append(f"The front matter names no `base_model`: the source (`{location or 'unknown'}`) is not a Hub repository "
                        "and does not name one; `fp4forge card --base-model REPO_ID` states it.")
    if license_id is None:
        unstated.append("The front matter names no `license`: the source's model card states none. Add the base model's license before publishing.")
    return f"---\n{data.to_yaml()}\n---\n", base, unstated
