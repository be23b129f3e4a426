"""The trained testbed's own model card: what it is and the terms it ships under.

Its front matter is what a quantized export's card carries over (``report/card_metadata.py``
reads ``license`` from the source's card). The weights and the corpus they were trained on are
made by fp4forge's own code, so they ship under fp4forge's license.
"""

from __future__ import annotations

LICENSE = "apache-2.0"  # fp4forge's license (pyproject.toml), SPDX id in the Hub's spelling

BODY = """
# trained-laguna (fp4forge testbed)

A tiny `LagunaForCausalLM` trained from scratch by `fp4forge testbed trained-laguna` on agentic
transcripts that fp4forge generates itself: a test model for quantization tooling, not a language
model for use. `fp4forge-training.json` is its training report; `fp4forge-calibration.jsonl` and
`fp4forge-heldout.jsonl` are the calibration and held-out documents.
"""


def testbed_card() -> str:
    from huggingface_hub import ModelCardData

    data = ModelCardData(license=LICENSE, library_name="transformers", pipeline_tag="text-generation", tags=["fp4forge", "testbed"])
    return f"---\n{data.to_yaml()}\n---\n{BODY}"
