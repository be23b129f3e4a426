"""GPTQ NVFP4 vs min-max (RTN) NVFP4 vs llm-compressor's GPTQ NVFP4 on the trained testbed.

    PYTHONPATH=src .venv/bin/python benchmarks/bench_gptq.py --lc-venv .venv-lc

Every arm quantizes the same Linears (routed experts + attention q/k/v/o, the output gate
excluded) of the trained tiny Laguna (``fp4forge testbed trained-laguna``, from the cache) to
NVFP4 weight-only (W4A16: activations stay BF16 so only the weight rounding differs), and is
measured by fidelity against the BF16 teacher on held-out text of the testbed's own corpus.
GPTQ arms (fp4forge's and llm-compressor's) calibrate on the *same token rows* (written to
``ids.json`` for llm-compressor). KL is per predicted position; CIs are 95 % bootstrap intervals
over sequences (2000 resamples, seed 0), and each arm's difference to the RTN arm, to
llm-compressor's and to fp4forge's default GPTQ is a paired bootstrap over the same sequences.

Arms: ``rtn``, ``rtn-mse``, ``lc-gptq`` and ``gptq-<routed|all>[-mse][-actorder][-seq][-damp<X>][-block<N>]``
(``mse``: the MSE search's global and block scales fixed before the sweep; ``seq``: sequential, each
layer calibrated on the outputs of the already-rounded layers before it). Each arm's
per-sequence KL is kept in ``per-sequence-kl-<arm>.json``; a later run into the same ``--out``
(same ``ids.json``, same held-out text) pairs its arms with the earlier ones.

``--heldout-factor K`` draws K times the build's held-out documents from the same held-out seed
stream (one build's split holds only about 100 sequences of 256 tokens). ``--quantize-only`` and
``--eval-only`` split the work: llm-compressor's venv stays on the CPU machine, and the checkpoints
(``--out`` with the teacher copied, ``--teacher`` naming the copy) can be measured elsewhere.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
RECIPE = """name = "bench-gptq-nvfp4a16"
description = "Routed experts + attention q/k/v/o NVFP4 weight-only"

[[rules]]
components = ["routed_experts"]
scheme = "nvfp4a16"

[[rules]]
components = ["attention"]
scheme = "nvfp4a16"
ignore = ['re:.*\\.self_attn\\.g_proj$']
"""
LC_TARGETS = ["re:.*self_attn\\.(q|k|v|o)_proj$", "re:.*mlp\\.experts\\.\\d+\\.(gate|up|down)_proj$"]


def _capture_kl():
    """Wrap the fidelity summary to keep the per-sequence KL means (the report has only the mean)."""
    from fp4forge.fidelity import evaluate as fe

    captured: list[torch.Tensor] = []
    original = fe.PositionMetrics.summary

    def summary(self):
        parts = self.kl or self.kl_estimate
        captured.clear()
        captured.extend(p.reshape(p.shape[0], -1).to(torch.float64).mean(dim=1) for p in parts)
        return original(self)

    fe.PositionMetrics.summary = summary
    return captured


def _ci(values: torch.Tensor, resamples: int = 2000) -> tuple[float, float, float]:
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, values.numel(), (resamples, values.numel()), generator=g)
    means = values[idx].mean(dim=1)
    return float(values.mean()), float(torch.quantile(means, 0.025)), float(torch.quantile(means, 0.975))


def _weight_error(arm_dir: Path) -> dict | None:
    """fp4forge's per-component relative weight error from the export's provenance (fp4forge arms)."""
    from fp4forge.checkpoint.names import PROVENANCE_JSON

    path = arm_dir / PROVENANCE_JSON
    if not path.is_file():
        return None
    by_component = (json.loads(path.read_text()).get("weight_error") or {}).get("by_component", {})
    return {k: v["mean"] for k, v in by_component.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "out" / "gptq")
    parser.add_argument("--calib-samples", type=int, default=32)
    parser.add_argument("--eval-samples", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--heldout-factor", type=int, default=1,
                        help="draw K times the build's held-out documents from the same held-out seed stream (a superset of the build's held-out split, never trained on)")
    parser.add_argument("--teacher", type=Path, default=None, help="a trained-laguna checkpoint (default: the cache's, built if missing)")
    parser.add_argument("--lc-venv", type=Path, default=None, help="llm-compressor venv (omit to skip that arm)")
    parser.add_argument("--arms", nargs="*", default=["rtn", "rtn-mse", "gptq-routed", "gptq-all", "gptq-routed-actorder", "lc-gptq"],
                        help="rtn, rtn-mse, lc-gptq, gptq-<routed|all>[-mse][-actorder][-seq][-damp<X>][-block<N>]")
    parser.add_argument("--quantize-only", action="store_true", help="write the arms' checkpoints, measure nothing (a later --eval-only run measures them)")
    parser.add_argument("--eval-only", action="store_true", help="measure the arms already written into --out (e.g. on a GPU machine)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default 2)")
    parser.add_argument("--device", default=None, help="fidelity's device (default: CUDA when available, else CPU)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads or max(1, min(2, os.cpu_count() or 1)))

    from fp4forge.quantize.gptq import GptqOptions, gptq_weights
    from fp4forge.calibrate.run import CalibrationOptions
    from fp4forge.fidelity.evaluate import FidelityOptions, evaluate
    from fp4forge.model.samples import load_samples, load_tokenizer
    from fp4forge.lab.trained.build import MODEL_SUBDIR, _corpus_and_tokenizer, cache_root, cached_trained_laguna, trained_laguna_cache_key
    from fp4forge.lab.trained.training import TrainingConfig
    from fp4forge.lab.trained.training_corpus import CorpusSpec, build_corpus
    from fp4forge.testbed.tokenizer import build_tokenizer
    from fp4forge.quantize.export import QuantizeOptions, quantize_checkpoint
    from fp4forge.quantize.recipe import load_recipe

    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    calib_file, eval_file, teacher_file = out / "calib.jsonl", out / "eval.jsonl", out / "teacher.txt"
    if not teacher_file.is_file():  # generating the corpus takes minutes: once per output directory
        corpus, tokenizer_json = _corpus_and_tokenizer(0, CorpusSpec())
        key = trained_laguna_cache_key(0, TrainingConfig(), CorpusSpec(), corpus, tokenizer_json)
        print(f"corpus key {key} (the build trained on this corpus)", file=sys.stderr, flush=True)
        teacher = args.teacher or cache_root() / key / MODEL_SUBDIR
        if not teacher.is_dir():
            teacher = cached_trained_laguna()
        built = json.loads((teacher / "fp4forge-training.json").read_text()).get("cache_key")
        if built != key:  # the held-out text must be the held-out text of *this* build
            raise SystemExit(f"{teacher} was trained on corpus {built}, this code generates corpus {key}: give the matching --teacher")
        heldout = corpus.heldout
        if args.heldout_factor > 1:
            spec = CorpusSpec()
            more = replace(spec, train_transcripts=0, train_structured=0, heldout_transcripts=spec.heldout_transcripts * args.heldout_factor,
                           heldout_structured=spec.heldout_structured * args.heldout_factor)
            trained = set(corpus.train)
            extended = [t for t in build_corpus(more, 0, build_tokenizer()).heldout if t not in trained]
            missing = set(corpus.heldout) - set(extended)
            assert not missing, "the extended held-out stream must contain the build's held-out split"
            heldout = extended
            print(f"held-out: {len(heldout)} documents (build's split: {len(corpus.heldout)})", file=sys.stderr, flush=True)
        calib_file.write_text("".join(json.dumps({"text": t}) + "\n" for t in corpus.train))
        eval_file.write_text("".join(json.dumps({"text": t}) + "\n" for t in heldout))
        teacher_file.write_text(str(teacher))
    teacher = Path(teacher_file.read_text())
    if args.teacher is not None and args.teacher != teacher:  # the same build copied elsewhere (another machine)
        built = json.loads((args.teacher / "fp4forge-training.json").read_text()).get("cache_key")
        if built != json.loads((teacher_file.parent / "results.json").read_text()).get("build", built):
            raise SystemExit(f"{args.teacher} is build {built}, not the build this --out was made for")
        teacher = args.teacher
    recipe_file = out / "recipe.toml"
    recipe_file.write_text(RECIPE)
    recipe = load_recipe(str(recipe_file))

    tokenizer = load_tokenizer(teacher)
    if args.eval_only:  # the calibration happened in the --quantize-only run: its record stands
        calibration_record = json.loads((out / "results.json").read_text())["calibration"]
    else:
        samples = load_samples(tokenizer, samples=args.calib_samples, seq_len=args.seq_len, text_files=[calib_file], builtin=False)
        ids = samples.input_ids.tolist()
        if (out / "ids.json").is_file() and json.loads((out / "ids.json").read_text()) != ids:  # llm-compressor may have used them
            raise SystemExit(f"{out / 'ids.json'} holds other calibration ids than --calib-samples/--seq-len give: use a fresh --out")
        (out / "ids.json").write_text(json.dumps(ids))
        calibration_record = samples.describe()
    calibration = CalibrationOptions(samples=args.calib_samples, seq_len=args.seq_len, text_files=(calib_file,), builtin_corpus=False)

    captured = _capture_kl()
    fid = FidelityOptions(numerics="w4a16", samples=args.eval_samples, seq_len=args.seq_len, text_files=(eval_file,), builtin_corpus=False,
                          teacher_cache=None, device=args.device)  # exact KL (full vocabulary) for every arm: the teacher runs again per arm
    per_seq: dict[str, torch.Tensor] = {}
    results: dict[str, dict] = {}
    # arms of earlier runs into the same --out (same ids.json, same eval text): paired with this run's
    previous = json.loads((out / "results.json").read_text()).get("arms", {}) if (out / "results.json").is_file() else {}
    for arm, doc in previous.items():
        kl_file = out / f"per-sequence-kl-{arm}.json"
        if arm not in args.arms and kl_file.is_file():
            per_seq[arm] = torch.tensor(json.loads(kl_file.read_text()), dtype=torch.float64)
            results[arm] = doc

    def write_summary() -> dict:
        for arm in per_seq:
            for ref, key in (("rtn", "kl_minus_rtn"), ("lc-gptq", "kl_minus_lc"), ("gptq-routed", "kl_minus_gptq_routed"),
                             ("gptq-all-mse-actorder", "kl_minus_gptq_all_mse_actorder")):
                if arm != ref and ref in per_seq and per_seq[arm].shape == per_seq[ref].shape:
                    d, lo, hi = _ci(per_seq[arm] - per_seq[ref])  # paired: the same sequences resampled together
                    results[arm][key] = {"mean": d, "ci95": [lo, hi]}
        build = json.loads((teacher / "fp4forge-training.json").read_text()).get("cache_key")
        summary = {"teacher": str(teacher), "build": build, "calibration": calibration_record, "eval_samples": args.eval_samples, "seq_len": args.seq_len, "arms": results}
        (out / "results.json").write_text(json.dumps(summary, indent=1))
        return summary

    for arm in args.arms:
        arm_dir = out / arm
        started = time.perf_counter()
        cpu_started, children_started = sum(os.times()[:2]), sum(os.times()[2:4])
        if args.eval_only:
            if not arm_dir.is_dir():
                raise SystemExit(f"{arm_dir}: not written (run with --quantize-only first)")
            results.setdefault(arm, {}).update(json.loads((arm_dir / "bench-quantize.json").read_text()) if (arm_dir / "bench-quantize.json").is_file() else {})
        elif arm_dir.exists():
            import shutil

            shutil.rmtree(arm_dir)
        if args.eval_only:
            pass
        elif arm in ("rtn", "rtn-mse"):
            quantize_checkpoint(teacher, arm_dir, QuantizeOptions(recipe, block_scales="mse" if arm == "rtn-mse" else "minmax", workers=1))
        elif arm.startswith("gptq"):
            parts = arm.split("-")[1:]
            extra = {}
            for part in parts[1:]:
                if part == "mse":
                    extra["block_scales"] = "mse"
                elif part == "actorder":
                    extra["act_order"] = True
                elif part == "seq":
                    extra["sequential"] = True
                elif part.startswith("damp"):
                    extra["damp"] = float(part[4:])
                elif part.startswith("block"):
                    extra["block_size"] = int(part[5:])
                else:
                    raise SystemExit(f"unknown GPTQ arm part {part!r} in {arm}")
            options = GptqOptions(calibration=calibration, expert_hessian=parts[0], **extra)
            weights = gptq_weights(teacher, recipe, options, samples=samples)
            quantize_checkpoint(teacher, arm_dir, QuantizeOptions(recipe, precomputed=weights, workers=1))
            results.setdefault(arm, {})["hessians"] = weights.provenance()["hessians"]
            results[arm]["settings"] = {k: v for k, v in options.settings().items() if k != "calibration"}
        elif arm == "lc-gptq":
            if args.lc_venv is None:
                print("lc-gptq: no --lc-venv, skipped", file=sys.stderr)
                continue
            cmd = [str(args.lc_venv / "bin" / "python"), str(REPO / "benchmarks" / "lc_gptq_export.py"), str(teacher), str(arm_dir),
                   "--ids", str(out / "ids.json"), "--scheme", "NVFP4A16", "--targets", *LC_TARGETS]
            proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
            if proc.returncode != 0:
                print(proc.stdout[-3000:], proc.stderr[-3000:], file=sys.stderr)
                raise SystemExit(f"llm-compressor export failed ({proc.returncode})")
        else:
            raise SystemExit(f"unknown arm {arm}")
        if not args.eval_only:
            results.setdefault(arm, {})["quantize_s"] = time.perf_counter() - started
            results[arm]["quantize_cpu_s"] = sum(os.times()[:2]) - cpu_started  # this process only (llm-compressor's is a child: see children_cpu_s)
            results[arm]["children_cpu_s"] = sum(os.times()[2:4]) - children_started
            results[arm]["quantize_load_average"] = os.getloadavg()
            (arm_dir / "bench-quantize.json").write_text(json.dumps(results[arm]))
            print(f"{arm}: quantized in {results[arm]['quantize_s']:.1f} s", file=sys.stderr, flush=True)
        if args.quantize_only:
            continue
        started = time.perf_counter()
        report = evaluate(teacher, arm_dir, fid)
        results[arm]["eval_s"] = time.perf_counter() - started
        per_seq[arm] = torch.cat(list(captured)).cpu()  # measured on the GPU or not, paired with arms read from files
        (out / f"per-sequence-kl-{arm}.json").write_text(json.dumps(per_seq[arm].tolist()))  # for paired comparisons across runs
        kl, lo, hi = _ci(per_seq[arm])
        m = report.metrics
        results[arm].update(kl_mean=kl, kl_ci95=[lo, hi], top1=m["top1_agreement"], ppl_student=m["perplexity"]["student"], ppl_teacher=m["perplexity"]["teacher"],
                            positions=m["positions"], kl_estimator=m["kl"]["estimator"], weight_error=_weight_error(arm_dir))
        results[arm]["load_average"] = os.getloadavg()
        print(f"{arm}: KL {kl:.5f} [{lo:.5f}, {hi:.5f}] top1 {m['top1_agreement']:.4f} load {os.getloadavg()}", file=sys.stderr, flush=True)
        write_summary()

    summary = write_summary()
    if args.quantize_only:
        return 0
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
