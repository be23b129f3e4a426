"""Sweep trained-testbed recipes on a GPU: train each variant, then play the quality suite offline.

Recipe exploration only: CUDA arithmetic differs from the CPU build's, so these models are not
the cached testbed; the chosen recipe is then built on the CPU by ``fp4forge testbed
trained-laguna``. Each variant runs in its own process (they share the GPU), writes
``OUT/<variant>/result.json`` (training report excerpt + offline suite result) and the summary
table is printed at the end.

    python -m fp4forge.lab.diagnostics.sweep_trained OUT [--variants a,b] [--device cuda] [--steps N]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

OLD_WEIGHTS = (("one_call", 10), ("restraint", 2), ("session", 0))
# The suite's restraint kinds (answer, ask, decline steps) as a larger share of the transcripts.
MIX_RESTRAINT = (("one_call", 6), ("restraint", 5), ("missing_tool", 3), ("ask_missing_date", 2), ("refuse_wipe", 2), ("no_tool_needed", 2), ("session", 12))
MIX_SESSION = (("one_call", 3), ("restraint", 3), ("missing_tool", 2), ("session", 18))

# name -> (TrainingConfig overrides, CorpusSpec overrides)
VARIANTS: dict[str, tuple[dict, dict]] = {
    "old-corpus": ({}, {"family_weights": OLD_WEIGHTS}),
    "base": ({}, {}),
    "lr6e-3": ({"lr": 6e-3}, {}),
    "lr1e-2": ({"lr": 1e-2, "warmup_steps": 30}, {}),
    "ctx0": ({"context_loss_weight": 0.0}, {}),
    "seq512x6": ({"seq_len": 512, "batch_size": 6}, {}),
    "steps320": ({"steps": 320}, {}),
    "lr6e-3-seq512": ({"lr": 6e-3, "seq_len": 512, "batch_size": 6}, {}),
    "steps1000": ({"steps": 1000}, {}),
    "steps2000": ({"steps": 2000}, {}),
    "lr1e-2-steps1000": ({"steps": 1000, "lr": 1e-2, "warmup_steps": 30}, {}),
    # The CPU budget with logits only where the loss counts (context_sample) and two
    # threads is about 1M training tokens; every variant below stays inside it (one reference twice).
    "cs-1024x3-330": ({"steps": 330, "context_sample": 0.1}, {}),
    "cs-512x3-660": ({"steps": 660, "seq_len": 512, "context_sample": 0.1}, {}),
    "cs-512x3-660-lr5e-3": ({"steps": 660, "seq_len": 512, "context_sample": 0.1, "lr": 5e-3}, {}),
    "cs-512x2-1000-lr2e-3": ({"steps": 1000, "seq_len": 512, "batch_size": 2, "context_sample": 0.1, "lr": 2e-3}, {}),
    "cs-512x3-660-mixR": ({"steps": 660, "seq_len": 512, "context_sample": 0.1}, {"family_weights": MIX_RESTRAINT}),
    "cs-512x3-660-mixR-2x": ({"steps": 660, "seq_len": 512, "context_sample": 0.1}, {"family_weights": MIX_RESTRAINT, "train_transcripts": 1920}),
    "cs-512x3-660-2x": ({"steps": 660, "seq_len": 512, "context_sample": 0.1}, {"train_transcripts": 1920}),
    "cs-512x3-660-ctx03": ({"steps": 660, "seq_len": 512, "context_sample": 0.03, "context_loss_weight": 0.03}, {}),
    "cs-1024x3-330-mixR": ({"steps": 330, "context_sample": 0.1}, {"family_weights": MIX_RESTRAINT}),
    "cs-512x3-660-mixS": ({"steps": 660, "seq_len": 512, "context_sample": 0.1}, {"family_weights": MIX_SESSION}),
    "cs-768x3-440": ({"steps": 440, "seq_len": 768, "context_sample": 0.1}, {}),
    "cs-512x3-1320": ({"steps": 1320, "seq_len": 512, "context_sample": 0.1}, {}),
    "cs-768x3-440-mixS": ({"steps": 440, "seq_len": 768, "context_sample": 0.1}, {"family_weights": MIX_SESSION}),
    "cs-768x3-880": ({"steps": 880, "seq_len": 768, "context_sample": 0.1}, {}),
    # High-entropy entity values (a fresh pseudo-word per city, name, ticker, product,
    # path...), so only copying from the request predicts an argument; the default recipe otherwise.
    "ent-768x3-440": ({"steps": 440, "seq_len": 768, "context_sample": 0.1}, {"entities": "generated"}),
    "ent-768x3-440-lr5e-3": ({"steps": 440, "seq_len": 768, "context_sample": 0.1, "lr": 5e-3}, {"entities": "generated"}),
    "ent-768x3-440-mixS": ({"steps": 440, "seq_len": 768, "context_sample": 0.1}, {"entities": "generated", "family_weights": MIX_SESSION}),
    # A BPE fitted to the generated corpus (28 % fewer tokens than the stdlib BPE on it), and longer
    # sessions (more requests per rendered tool list); the untrained init with the fitted tokenizer
    # (one step at a negligible learning rate) for the floor.
    "fit-768x3-440": ({"steps": 440, "seq_len": 768, "context_sample": 0.1}, {"tokenizer": "corpus"}),
    "long-768x3-440": ({"steps": 440, "seq_len": 768, "context_sample": 0.1}, {"session_turns": (8, 16)}),
    # Longer sessions with the suite's restraint kinds as a larger share: does the model keep the
    # restraint points the untrained model collects while it learns tool choice?
    "long-mixR-768x3-440": ({"steps": 440, "seq_len": 768, "context_sample": 0.1}, {"session_turns": (8, 16), "family_weights": MIX_RESTRAINT}),
    "fit-long-768x3-440": ({"steps": 440, "seq_len": 768, "context_sample": 0.1}, {"tokenizer": "corpus", "session_turns": (8, 16)}),
    "untrained-fit": ({"steps": 1, "lr": 1e-12, "router_bias_rate": 0.0}, {"tokenizer": "corpus"}),
}


def run_variant(name: str, out: Path, device: str, steps: int | None, max_new_tokens: int) -> dict:
    import torch

    from fp4forge.lab.diagnostics.offline_suite import evaluate
    from fp4forge.lab.trained import training as trained
    from fp4forge.lab.trained.build import corpus_and_tokenizer
    from fp4forge.lab.trained.training_corpus import CorpusSpec

    if device != "cpu":
        # bincount (router loads) has no deterministic CUDA kernel; exploration does not need bytes.
        @contextlib.contextmanager
        def loose(threads: int):
            torch.set_num_threads(threads)
            yield

        trained.deterministic_torch = loose
    # NAME@SEED: the same recipe from another seed (corpus and training), to see the spread.
    recipe, _, seed_text = name.partition("@")
    seed = int(seed_text or 0)
    overrides, corpus_overrides = VARIANTS[recipe]
    config = replace(trained.TrainingConfig(), **overrides, **({"steps": steps} if steps else {}))
    spec = replace(CorpusSpec(), **corpus_overrides)
    started = time.monotonic()
    corpus, tokenizer = corpus_and_tokenizer(seed, spec)
    corpus_s = time.monotonic() - started
    model_dir = out / name / "model"
    result = trained.train_laguna(model_dir, corpus.train, corpus.heldout, seed=seed, config=config, device=device, tokenizer=tokenizer)
    train_s = time.monotonic() - started - corpus_s
    suite = evaluate(model_dir, device=device, max_new_tokens=max_new_tokens)
    indist = evaluate(model_dir, device=device, max_new_tokens=48, generated=40, entities=spec.entities)
    report = result.report
    summary = {
        "variant": name, "training": config.to_json(), "train_tokens_in_corpus": sum(len(tokenizer(d, add_special_tokens=False).input_ids) for d in corpus.train), "corpus_s": round(corpus_s, 1), "train_s": round(train_s, 1),
        "loss_last_10_mean": report["loss_last_10_mean"], "heldout_perplexity": report["heldout_perplexity"],
        "heldout_assistant_perplexity": report["heldout_assistant_perplexity"],
        "weights": report["weights"], "activations": report["activations"],
        "suite": {k: suite[k] for k in ("earned", "max", "tool_choice", "restraint", "turns_with_calls", "turns")},
        "generated_tool_choice": indist["tool_choice"], "generated_points": [indist["earned"], indist["max"]],
    }
    (out / name / "result.json").write_text(json.dumps(summary, indent=1) + "\n")
    (out / name / "suite.json").write_text(json.dumps(suite, indent=1) + "\n")
    (out / name / "generated.json").write_text(json.dumps(indist, indent=1) + "\n")
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated; NAME@SEED trains NAME from another seed")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--steps", type=int, default=None, help="override every variant's steps (smoke tests)")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.one:
        run_variant(args.one, args.out, args.device, args.steps, args.max_new_tokens)
        return 0
    names = args.variants.split(",")
    procs = {}
    for name in names:
        (args.out / name).mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "fp4forge.lab.diagnostics.sweep_trained", str(args.out), "--one", name, "--device", args.device, "--max-new-tokens", str(args.max_new_tokens)]
        if args.steps:
            cmd += ["--steps", str(args.steps)]
        log = open(args.out / name / "log.txt", "w")
        procs[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "2"})
    for name, proc in procs.items():
        proc.wait()
    print(f"{'variant':16} {'points':>9} {'choice':>7} {'restr':>6} {'calls':>7} {'ppl':>6} {'a-ppl':>6} {'loss10':>6} {'train s':>7} {'exp kurt':>8} {'gen choice':>10} {'gen pts':>7}")
    for name in names:
        path = args.out / name / "result.json"
        if not path.is_file():
            print(f"{name:16} FAILED: " + (args.out / name / "log.txt").read_text()[-600:])
            continue
        r = json.loads(path.read_text())
        s = r["suite"]
        print(f"{name:16} {s['earned']:>4}/{s['max']:<4} {s['tool_choice'][0]:>3}/{s['tool_choice'][1]:<3} {s['restraint'][0]:>2}/{s['restraint'][1]:<3}"
              f" {s['turns_with_calls']:>3}/{s['turns']:<3} {r['heldout_perplexity']:6.2f} {r['heldout_assistant_perplexity']:6.2f} {r['loss_last_10_mean']:6.3f}"
              f" {r['train_s']:7.0f} {r['weights']['routed_experts']['kurtosis_median']:8.2f} {r['generated_tool_choice'][0]:>5}/{r['generated_tool_choice'][1]:<4} {r['generated_points'][0]:>3}/{r['generated_points'][1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
