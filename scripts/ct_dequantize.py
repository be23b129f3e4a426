"""Dequantize a compressed-tensors checkpoint with compressed-tensors' own file-level
dequantizer (`convert_checkpoint` + `CompressedTensorsDequantizer`). An independent oracle for
fp4forge's dequantization; run it with a venv that has compressed-tensors 0.17 (.venv-vllm):

    .venv-vllm/bin/python scripts/ct_dequantize.py SRC OUT [--dtype bfloat16|float32]
"""

from __future__ import annotations

import argparse

import torch
from compressed_tensors.entrypoints.convert import convert_checkpoint
from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import CompressedTensorsDequantizer

# Without these, FP8 dequantization looks for scales of modules it must not touch
# (docs/vllm-cpu.md#transformers-as-a-cross-check: "Dependency weight model.embed_tokens.weight_scale not found").
IGNORE = ["re:.*embed_tokens$", "re:.*norm$", "re:.*mlp.gate$", "re:.*lm_head$"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("src")
    parser.add_argument("out")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = parser.parse_args()
    converter = CompressedTensorsDequantizer(args.src, ignore=IGNORE, dtype=getattr(torch, args.dtype))
    convert_checkpoint(args.src, args.out, converter)


if __name__ == "__main__":
    main()
