"""The trained testbed's own model card: what it is, which build it is and the terms it ships under.

Its front matter is what a quantized export's card carries over (``report/card_metadata.py``
reads ``license`` and ``fp4forge_testbed`` from the source's card). The weights and the corpus they
were trained on are made by fp4forge's own code, so they ship under fp4forge's license. The
testbed has no Hub repository, so the card names no ``base_model``; a shipped testbed states its
identity (name, version, sha256 of its files) in ``fp4forge_testbed`` instead.
"""

from __future__ import annotations

from typing import Any

LICENSE = "apache-2.0"  # fp4forge's license (pyproject.toml), SPDX id in the Hub's spelling
IDENTITY_KEY = "fp4forge_testbed"  # front-matter key: {name, version, sha256}

BODY = """
# trained-laguna (fp4forge testbed)

A tiny `LagunaForCausalLM` trained from scratch by `fp4forge testbed trained-laguna` on agentic
transcripts that fp4forge generates itself: a test model for quantization tooling, not a language
model for use. `fp4forge-training.json` is its training report; `fp4forge-calibration.jsonl` and
`fp4forge-heldout.jsonl` are the calibration and held-out documents.
"""

SYNTH_BODY = """
# {architecture} (fp4forge synthetic testbed)

A shape-true `{architecture}` written by `fp4forge testbed synth`: the tensor names, shapes and
dtypes of the real model for {layers} decoder layer(s), filled with seeded random values. It
reads no text: fidelity and quality numbers on it measure quantization error on random weights,
not a language model's. Its tokenizer is fp4forge's testbed BPE, extended to the config's
{vocab_size:,} ids; `fp4forge-calibration.jsonl` and `fp4forge-heldout.jsonl` are its own
calibration and held-out documents (the built-in corpus's two splits, rendered through its chat
template).
"""


def identity_line(identity: dict[str, Any]) -> str:
    return f"fp4forge's shipped testbed `{identity['name']}` v{identity['version']} (sha256 of its files `{identity['sha256'][:16]}…`)"


def testbed_card(identity: dict[str, Any] | None = None, *, body: str = BODY) -> str:
    """The card; with ``identity`` (a shipped testbed's name, version, sha256) it states which build."""
    from huggingface_hub import ModelCardData

    extra = {IDENTITY_KEY: identity} if identity else {}
    data = ModelCardData(license=LICENSE, library_name="transformers", pipeline_tag="text-generation", tags=["fp4forge", "testbed"], **extra)
    shipped = (f"\nThis copy is {identity_line(identity)}: `fp4forge-testbed.json` lists every file's hash and how it was built "
               "(recipe, seed, build key, host).\n") if identity else ""
    return f"---\n{data.to_yaml()}\n---\n{body}{shipped}"
