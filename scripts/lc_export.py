"""Quantize a BF16 checkpoint with llm-compressor and save its compressed-tensors export.

Run with the llm-compressor venv (scripts/setup-lc-venv.sh), not the main one:

    .venv-lc/bin/python scripts/lc_export.py SRC OUT --scheme NVFP4|NVFP4A16|FP8_DYNAMIC \
        [--kv-fp8] [--samples 16 --seq-len 256]

Calibration text is Python standard-library source (the running interpreter's own, files in
sorted order, fixed-size chunks) rendered through the model's chat template, so a given Python
gives the same samples every time. Schemes that need no activation statistics (NVFP4A16,
FP8_DYNAMIC without --kv-fp8) run data-free. OUT appears only when complete.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

# Modules that must stay BF16 besides what targets="Linear" already skips:
# - lm_head: vLLM and ModelOpt keep it unquantized; CT convention.
# - mlp.gate: the MoE router (Laguna's LagunaTopKRouter is not an nn.Linear in transformers, so
#   this is belt and braces; vLLM builds it as GateLinear without quant_config). Its
#   e_score_correction_bias is a bare parameter and is never quantized.
# - self_attn.g_proj: Laguna's per-head output gate, hidden -> num_heads (4 rows here). vLLM
#   would quantize it if asked, but an N of num_heads is below FP4 GEMM tile sizes and the bytes
#   are negligible.
IGNORE = ["lm_head", "re:.*mlp\\.gate$", "re:.*self_attn\\.g_proj$"]
SCHEMES = ("NVFP4", "NVFP4A16", "FP8_DYNAMIC")
KV_FP8 = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}


def calibration_texts(tokenizer, samples: int, seq_len: int) -> list[list[int]]:
    """Token ids of `samples` chat-rendered stdlib chunks, each truncated to `seq_len`."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.glob("*.py") if p.stat().st_size > 4096)
    chunk_chars = seq_len * 6  # comfortably more than seq_len tokens of source
    out: list[list[int]] = []
    for path in files:
        source = path.read_text(encoding="utf-8", errors="replace")
        messages = [
            {"role": "user", "content": f"Explain what `{path.name}` does:\n\n{source[:chunk_chars]}"},
            {"role": "assistant", "content": source[chunk_chars : 2 * chunk_chars]},
        ]
        text = tokenizer.apply_chat_template(messages, tokenize=False)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"][:seq_len]
        out.append(ids)
        if len(out) == samples:
            return out
    raise SystemExit(f"only {len(out)} stdlib files found for {samples} samples")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("src", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--scheme", required=True, choices=SCHEMES)
    parser.add_argument("--kv-fp8", action="store_true", help="also write FP8 per-tensor KV-cache scales")
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=256)
    args = parser.parse_args(argv)
    if args.out.exists() and any(args.out.iterdir()):
        raise SystemExit(f"{args.out} exists and is not empty")

    import torch
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    t0 = time.perf_counter()
    # Plain load, not load_quantizable_moe(): that context manager imports torchvision
    # (docs/vllm-cpu.md#llm-compressor-in-its-own-venv); oneshot linearizes the fused experts itself.
    model = AutoModelForCausalLM.from_pretrained(args.src, dtype=torch.bfloat16)
    tokenizer = AutoTokenizer.from_pretrained(args.src)

    needs_data = args.scheme == "NVFP4" or args.kv_fp8  # static activation / KV observers
    dataset = None
    if needs_data:
        ids = calibration_texts(tokenizer, args.samples, args.seq_len)
        dataset = Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * len(x) for x in ids]})

    recipe = QuantizationModifier(
        targets="Linear", scheme=args.scheme, ignore=IGNORE, kv_cache_scheme=KV_FP8 if args.kv_fp8 else None
    )
    t1 = time.perf_counter()
    oneshot(
        model=model,
        tokenizer=tokenizer,
        recipe=recipe,
        dataset=dataset,
        num_calibration_samples=args.samples if needs_data else 0,
        max_seq_length=args.seq_len,
        shuffle_calibration_samples=False,
        moe_calibrate_all_experts=True,
    )
    t2 = time.perf_counter()

    args.out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{args.out.name}.partial-", dir=args.out.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(staging, 0o777 & ~umask)  # mkdtemp's 0700 would otherwise become OUT's mode
    try:
        model.save_pretrained(staging, save_compressed=True)
        tokenizer.save_pretrained(staging)
        if args.out.exists():
            args.out.rmdir()
        os.replace(staging, args.out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    t3 = time.perf_counter()
    print(
        f"lc_export: {args.scheme}{' +kv-fp8' if args.kv_fp8 else ''} -> {args.out} "
        f"(load {t1 - t0:.1f} s, oneshot {t2 - t1:.1f} s, save {t3 - t2:.1f} s, total {t3 - t0:.1f} s)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
