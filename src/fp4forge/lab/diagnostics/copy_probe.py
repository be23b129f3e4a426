"""Can the tiny testbed architecture learn to copy from its context? A diagnostic, not a test.

The trained testbed writes tool names and argument values from its training pools instead of the
request in front of it. This trains a fresh model of the testbed's exact configuration on the
purest copying task (a random token string, a separator, the same string again) and prints the
accuracy on the second copy as training goes; the same for the softmax-routed Qwen3-MoE control
of the same size, and for Laguna without its per-head output gate. If the testbed's architecture
learns this in a few hundred steps, the trained testbed's failure to copy is about its data and
budget, not its layers.

    python -m fp4forge.lab.diagnostics.copy_probe [--device cuda] [--steps 400] [--arms laguna,qwen3,laguna-nogate]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
from transformers import LagunaForCausalLM, Qwen3MoeForCausalLM

from fp4forge.testbed.tiny import init_model, tiny_laguna_config, tiny_qwen3_moe_config

VOCAB = 4096
SEPARATOR = 3
FIRST_RANDOM = 16  # token ids below this are left for BOS / separator


def batch(generator: torch.Generator, size: int, length: int, device: str) -> torch.Tensor:
    """BOS, ``length`` random tokens, the separator, the same tokens: ``2 * length + 2`` tokens."""
    body = torch.randint(FIRST_RANDOM, VOCAB, (size, length), generator=generator)
    bos = torch.full((size, 1), 1)
    sep = torch.full((size, 1), SEPARATOR)
    return torch.cat([bos, body, sep, body], dim=1).to(device)


def copy_accuracy(model: torch.nn.Module, tokens: torch.Tensor, length: int) -> float:
    with torch.no_grad():
        logits = model(input_ids=tokens[:, :-1], use_cache=False).logits
    predicted = logits[:, length + 1 :].argmax(-1)  # positions whose next token is a copied one
    return float((predicted == tokens[:, length + 2 :]).float().mean())


def make(arm: str) -> torch.nn.Module:
    stop = [2]
    if arm == "qwen3":
        return init_model(Qwen3MoeForCausalLM, tiny_qwen3_moe_config(VOCAB, 1, stop, 0), 0)
    config = tiny_laguna_config(VOCAB, 1, stop, 0, dense=False)
    if arm == "laguna-nogate":
        config.gating = False
    return init_model(LagunaForCausalLM, config, 0)


def probe(arm: str, device: str, steps: int, length: int, batch_size: int, lr: float) -> dict:
    torch.manual_seed(0)
    model = make(arm).to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    generator = torch.Generator().manual_seed(0)
    held_out = batch(torch.Generator().manual_seed(12345), 64, length, device)
    curve = []
    started = time.monotonic()
    for step in range(1, steps + 1):
        tokens = batch(generator, batch_size, length, device)
        logits = model(input_ids=tokens[:, :-1], use_cache=False).logits
        # Loss on the copy only: the first half is unpredictable by construction.
        loss = torch.nn.functional.cross_entropy(logits[:, length + 1 :].reshape(-1, logits.shape[-1]), tokens[:, length + 2 :].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % max(1, steps // 8) == 0 or step == steps:
            model.eval()
            accuracy = copy_accuracy(model, held_out, length)
            model.train()
            curve.append({"step": step, "loss": round(float(loss), 3), "copy_accuracy": round(accuracy, 3)})
            print(f"{arm:14} step {step:5d} loss {float(loss):6.3f} copy accuracy {accuracy:.3f} ({time.monotonic() - started:.0f} s)", flush=True)
    return {"arm": arm, "steps": steps, "length": length, "batch_size": batch_size, "lr": lr, "curve": curve}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--length", type=int, default=24, help="random tokens per copy")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--arms", default="laguna,qwen3,laguna-nogate")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    results = [probe(arm, args.device, args.steps, args.length, args.batch_size, args.lr) for arm in args.arms.split(",")]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
