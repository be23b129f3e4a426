"""The testbeds' own model cards: what each is and the terms it ships under.

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


def testbed_card(body: str = BODY) -> str:
    from huggingface_hub import ModelCardData

    data = ModelCardData(license=LICENSE, library_name="transformers", pipeline_tag="text-generation", tags=["fp4forge", "testbed"])
    return f"---\n{data.to_yaml()}\n---\n{body}"
