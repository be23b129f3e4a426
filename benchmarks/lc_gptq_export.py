"""llm-compressor's GPTQ on given calibration token ids (run with the llm-compressor venv).

    .venv-lc/bin/python benchmarks/lc_gptq_export.py SRC OUT --ids ids.json --scheme NVFP4A16 \
        --targets 're:.*self_attn\\.(q|k|v|o)_proj$' 're:.*mlp\\.experts\\.\\d+\\.(gate|up|down)_proj$'

The ids are the exact token rows fp4forge calibrated on (bench_gptq.py writes them), so both tools
see the same tokens. ``oneshot`` with a ``GPTQModifier`` (its defaults: block 128, damping 0.01,
its sequential pipeline) and ``moe_calibrate_all_experts=True`` (llm-compressor's MoE default:
every token through every expert). Writes a compressed-tensors checkpoint.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("src", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--ids", type=Path, required=True)
    parser.add_argument("--scheme", default="NVFP4A16", choices=("NVFP4", "NVFP4A16"))
    parser.add_argument("--targets", nargs="+", required=True)
    parser.add_argument("--ignore", nargs="*", default=["lm_head", "re:.*mlp\\.gate$", "re:.*self_attn\\.g_proj$"])
    parser.add_argument("--routed-only", action="store_true", help="moe_calibrate_all_experts=False")
    args = parser.parse_args(argv)

    import torch
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    ids = json.loads(args.ids.read_text())
    model = AutoModelForCausalLM.from_pretrained(args.src, dtype=torch.bfloat16)
    tokenizer = AutoTokenizer.from_pretrained(args.src)
    dataset = Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * len(x) for x in ids]})
    recipe = GPTQModifier(targets=args.targets, scheme=args.scheme, ignore=args.ignore)
    t0 = time.perf_counter()
    oneshot(
        model=model,
        tokenizer=tokenizer,
        recipe=recipe,
        dataset=dataset,
        num_calibration_samples=len(ids),
        max_seq_length=max(len(x) for x in ids),
        shuffle_calibration_samples=False,
        moe_calibrate_all_experts=not args.routed_only,
    )
    t1 = time.perf_counter()
    model.save_pretrained(args.out, save_compressed=True)
    tokenizer.save_pretrained(args.out)
    print(json.dumps({"oneshot_s": t1 - t0, "samples": len(ids), "scheme": args.scheme}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
