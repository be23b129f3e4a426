"""Tiny, random, deterministic MoE checkpoints to test the whole pipeline on a laptop CPU.

``build_tiny_laguna`` uses transformers' native ``LagunaForCausalLM`` and keeps everything that
makes Laguna Laguna: a dense first layer then sparse MoE layers (16 routed experts, top-4, one
shared expert, sigmoid router with a *non-zero* ``e_score_correction_bias``), mixed sliding-window
and full attention, the per-head softplus output gate and q/k norms. ``build_tiny_qwen3_moe`` is a
softmax-routed control of the same size. Every Linear's input dimension is a multiple of 64, so
NVFP4's 16-element blocks and vLLM's MoE kernels divide evenly.

The same seed always gives byte-identical output directories.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from transformers import (
    GenerationConfig,
    LagunaConfig,
    LagunaForCausalLM,
    PreTrainedConfig,
    PreTrainedModel,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)
from transformers.utils import logging as hf_logging

from fp4forge.checkpoint.atomic import atomic_output_dir
from fp4forge.errors import ConfigError
from fp4forge.testbed.tokenizer import build_tokenizer, generation_stop_ids

Progress = Callable[[int, int, str], None] | None
# (vocab_size, bos_id, stop_ids, pad_id) -> config
ConfigFactory = Callable[[int, int, list[int], int], PreTrainedConfig]

# Small enough that the ~15 MB tiny models split into several shards, so index handling is exercised.
TINY_MAX_SHARD_BYTES = 6 * 10**6
# Large enough to change which experts win for most tokens, so a loader that drops the bias shows.
E_SCORE_CORRECTION_BIAS_STD = 0.5
ROUTER_BIAS_SEED_OFFSET = 0x5EED_B1A5
TINY_MAX_POSITIONS = 4096


@contextlib.contextmanager
def quiet_transformers_progress() -> Iterator[None]:
    """save_pretrained draws its own tqdm bar; the caller's ``progress`` is the one to show."""
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def _report(progress: Progress, done: int, total: int, desc: str) -> None:
    if progress is not None:
        progress(done, total, desc)


# -- configs ------------------------------------------------------------------------------------
def tiny_laguna_config(vocab_size: int, bos_id: int, stop_ids: list[int], pad_id: int, *, dense: bool) -> LagunaConfig:
    num_layers = 4
    return LagunaConfig(
        vocab_size=vocab_size,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=TINY_MAX_POSITIONS,
        # Alternating, as the real model interleaves full-attention layers among sliding ones;
        # the MoE layers 1..3 then see both kinds.
        layer_types=["full_attention", "sliding_attention", "full_attention", "sliding_attention"],
        sliding_window=64,
        gating=True,  # per-head softplus output gate (g_proj: hidden -> num_heads)
        mlp_layer_types=["dense"] * num_layers if dense else ["dense"] + ["sparse"] * (num_layers - 1),
        num_experts=16,
        num_experts_per_tok=4,
        moe_intermediate_size=128,
        shared_expert_intermediate_size=128,
        moe_routed_scaling_factor=2.5,  # Laguna XS.2's value; vLLM applies it in its fused MoE
        tie_word_embeddings=False,
        bos_token_id=bos_id,
        eos_token_id=stop_ids,
        pad_token_id=pad_id,
    )


def tiny_qwen3_moe_config(vocab_size: int, bos_id: int, stop_ids: list[int], pad_id: int) -> Qwen3MoeConfig:
    return Qwen3MoeConfig(
        vocab_size=vocab_size,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=TINY_MAX_POSITIONS,
        num_experts=16,
        num_experts_per_tok=4,
        moe_intermediate_size=128,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        tie_word_embeddings=False,
        bos_token_id=bos_id,
        eos_token_id=stop_ids,
        pad_token_id=pad_id,
    )


# -- building -----------------------------------------------------------------------------------
def init_model(model_class: type[PreTrainedModel], config: PreTrainedConfig, seed: int) -> PreTrainedModel:
    """Random init from the seed alone, without disturbing the caller's global RNG."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class(config)
    return model.eval()


def _randomise_router_bias(model: PreTrainedModel, seed: int) -> int:
    """Give every sigmoid router a non-zero correction bias (random init leaves it at zero)."""
    # Its own stream, so it never replays the draws of the weight init of some other seed.
    generator = torch.Generator().manual_seed(seed + ROUTER_BIAS_SEED_OFFSET)
    count = 0
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("e_score_correction_bias"):
                param.copy_(torch.randn(param.shape, generator=generator) * E_SCORE_CORRECTION_BIAS_STD)
                count += 1
    return count


def _build_tiny(
    out: Path,
    model_class: type[PreTrainedModel],
    make_config: ConfigFactory,
    *,
    seed: int,
    progress: Progress,
    after_init: Callable[[PreTrainedModel], None] | None = None,
) -> Path:
    out = Path(out)
    total = 4
    with atomic_output_dir(out) as staging:
        _report(progress, 0, total, "training tokenizer")
        tokenizer = build_tokenizer()
        vocab_size = padded(len(tokenizer), 64)
        stop_ids = generation_stop_ids(tokenizer)
        config = make_config(vocab_size, tokenizer.bos_token_id, stop_ids, tokenizer.pad_token_id)

        _report(progress, 1, total, "initialising model")
        model = init_model(model_class, config, seed)
        if after_init is not None:
            after_init(model)
        model = model.to(torch.bfloat16)
        model.generation_config = GenerationConfig(
            bos_token_id=tokenizer.bos_token_id, eos_token_id=stop_ids, pad_token_id=tokenizer.pad_token_id
        )

        _report(progress, 2, total, "saving model")
        with quiet_transformers_progress():
            model.save_pretrained(staging, max_shard_size=TINY_MAX_SHARD_BYTES)
        _report(progress, 3, total, "saving tokenizer")
        tokenizer.save_pretrained(staging)
    _report(progress, total, total, "done")
    return out


def padded(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def build_tiny_laguna(out: Path, *, seed: int = 0, dense: bool = False, progress: Progress = None) -> Path:
    """Tiny random Laguna at ``out``; ``dense=True`` makes every layer a dense MLP (no MoE)."""

    def make_config(vocab_size: int, bos_id: int, stop_ids: list[int], pad_id: int) -> LagunaConfig:
        return tiny_laguna_config(vocab_size, bos_id, stop_ids, pad_id, dense=dense)

    def add_router_bias(model: PreTrainedModel) -> None:
        if not dense and _randomise_router_bias(model, seed) == 0:
            raise ConfigError("tiny Laguna has no e_score_correction_bias to set; transformers' layout changed?")

    return _build_tiny(out, LagunaForCausalLM, make_config, seed=seed, progress=progress, after_init=add_router_bias)


def build_tiny_qwen3_moe(out: Path, *, seed: int = 0, progress: Progress = None) -> Path:
    """Tiny random Qwen3-MoE (softmax routing) at ``out``, same size and tokenizer as tiny Laguna."""
    return _build_tiny(out, Qwen3MoeForCausalLM, tiny_qwen3_moe_config, seed=seed, progress=progress)
