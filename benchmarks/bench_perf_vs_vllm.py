"""`fp4forge bench perf` against vLLM's own `vllm bench serve`, same server, one run.

Starts one vLLM CPU server on the tiny dense Laguna testbed (prefix caching off, so vLLM's
ready-check and warmups, which repeat its first prompt, cannot turn a measured request into a
cache hit), then alternates the two clients REPEATS times on the same shape at concurrency 1:

    fp4forge bench perf --endpoint completions --prompt-tokens L --output-tokens O --warmups W --samples N
    vllm bench serve --backend openai --endpoint /v1/completions --dataset-name random
                     --random-input-len L --random-output-len O --random-range-ratio 0
                     --num-prompts N --num-warmups W --max-concurrency 1 --ignore-eos --temperature 0 --save-detailed

and reports, per tool: the median TTFT and TPOT of every run, their run-to-run spread (the noise
floor), the ratio fp4forge / vLLM with a bootstrap CI over the pooled requests, and the client's
CPU time per request: while requests were in flight (fp4forge records it in run.json; vLLM's
benchmark coroutine is timed by running `vllm bench serve`'s own parser and main under a thin
wrapper), and for the whole process, imports and start-up included.
TPOT is vLLM's (e2e - TTFT) / (n_out - 1) on both sides.

    .venv/bin/python benchmarks/bench_perf_vs_vllm.py [--repeats 3] [--prompt-tokens 512] [--output-tokens 64]
                     [--samples 20] [--warmups 3] [--url URL --model NAME --tokenizer DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._util import OUT, REPO  # noqa: E402
from fp4forge.bench import stats  # noqa: E402

VLLM_VENV = REPO / ".venv-vllm"
SERVED_NAME = "tiny-laguna-dense"
# `vllm bench serve` itself (its own parser and main), with its benchmark coroutine wrapped to
# measure the CPU the client spends from the ready check to the last response, written to argv[1].
VLLM_BENCH_WRAPPER = """
import json, sys, time
import vllm.benchmarks.serve as serve
from vllm.utils.argparse_utils import FlexibleArgumentParser
cpu_file, argv = sys.argv[1], sys.argv[2:]
original = serve.benchmark
async def timed_benchmark(*args, **kwargs):
    start = time.process_time()
    try:
        return await original(*args, **kwargs)
    finally:
        open(cpu_file, "w").write(json.dumps({"benchmark_cpu_s": time.process_time() - start}))
serve.benchmark = timed_benchmark
parser = FlexibleArgumentParser()
serve.add_cli_args(parser)
serve.main(parser.parse_args(argv))
"""
# The test fixture's flags (tests/conftest.py) plus prefix caching off.
SERVER_ARGS = ["--enforce-eager", "--max-model-len", "2048", "--dtype", "float32", "--no-enable-prefix-caching"]


@dataclass
class ToolRun:
    tool: str
    repeat: int
    ttft_s: list[float]
    tpot_s: list[float]
    requests_sent: int
    process_cpu_s: float
    wall_s: float
    in_flight_cpu_s: float | None = None  # client CPU while its requests (warmups included) were in flight
    failed: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def median_ttft_s(self) -> float:
        return statistics.median(self.ttft_s)

    @property
    def median_tpot_s(self) -> float:
        return statistics.median(self.tpot_s)


def run_with_rusage(cmd: list[str], env: dict[str, str] | None = None) -> tuple[int, float, float, str, str]:
    """(returncode, user+sys CPU seconds of the child tree that was waited for, wall s, stdout, stderr)."""
    before = os.times()
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    after = os.times()
    cpu = (after.children_user - before.children_user) + (after.children_system - before.children_system)
    return proc.returncode, cpu, wall, proc.stdout, proc.stderr


def run_fp4forge(url: str, model: str, out: Path, args: argparse.Namespace, repeat: int) -> ToolRun:
    cmd = [
        sys.executable, "-m", "fp4forge.cli.bench", "bench", "perf", "--url", url, "--model", model, "--out", str(out),
        "--endpoint", "completions", "--prompt-tokens", str(args.prompt_tokens), "--output-tokens", str(args.output_tokens),
        "--warmups", str(args.warmups), "--samples", str(args.samples), "--seed", str(repeat), "--json", "--no-plots",
    ]
    code, cpu, wall, stdout, stderr = run_with_rusage(cmd)
    if code not in (0, 1):
        raise SystemExit(f"fp4forge bench perf failed ({code}):\n{stderr[-2000:]}")
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    kept = [s for s in samples if s["ok"] and not s["warmup"]]
    run = json.loads((out / "run.json").read_text())
    return ToolRun(
        tool="fp4forge",
        repeat=repeat,
        ttft_s=[s["ttft_s"] for s in kept],
        tpot_s=[s["tpot_s"] for s in kept if s["tpot_s"] is not None],
        requests_sent=len(samples) + 1,  # + the stream-options probe
        process_cpu_s=cpu,
        wall_s=wall,
        in_flight_cpu_s=run["client"]["cpu_s_in_flight"],
        failed=sum(not s["ok"] for s in samples),
        extra={"load_average_1m_after": os.getloadavg()[0]},
    )


def run_vllm_bench(url: str, model: str, tokenizer: str, out: Path, args: argparse.Namespace, repeat: int) -> ToolRun:
    out.mkdir(parents=True, exist_ok=True)
    cpu_file = out / "benchmark_cpu.json"
    cmd = [
        str(VLLM_VENV / "bin" / "python"), "-c", VLLM_BENCH_WRAPPER, str(cpu_file), "--backend", "openai", "--base-url", url,
        "--endpoint", "/v1/completions", "--model", tokenizer, "--served-model-name", model, "--tokenizer", tokenizer,
        "--dataset-name", "random", "--random-input-len", str(args.prompt_tokens), "--random-output-len", str(args.output_tokens),
        "--random-range-ratio", "0", "--num-prompts", str(args.samples), "--num-warmups", str(args.warmups),
        "--max-concurrency", "1", "--request-rate", "inf", "--ignore-eos", "--seed", str(repeat), "--disable-tqdm",
        # Greedy like fp4forge: without it vLLM >= 0.11 leaves sampling to the server's default.
        "--temperature", "0",
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--save-result", "--save-detailed",
        "--result-dir", str(out), "--result-filename", "result.json",
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    code, cpu, wall, stdout, stderr = run_with_rusage(cmd, env)
    (out / "stdout.txt").write_text(stdout)
    (out / "stderr.txt").write_text(stderr)
    if code != 0:
        raise SystemExit(f"vllm bench serve failed ({code}):\n{stderr[-3000:]}")
    result = json.loads((out / "result.json").read_text())
    ok = [i for i, error in enumerate(result["errors"]) if not error]
    ttfts = [result["ttfts"][i] for i in ok]
    # vLLM's own per-request TPOT: (latency - ttft) / (output_len - 1).
    tpots = [
        (result["latencies"][i] - result["ttfts"][i]) / (result["output_lens"][i] - 1)
        for i in ok
        if result["output_lens"][i] > 1
    ]
    return ToolRun(
        tool="vllm bench serve",
        repeat=repeat,
        ttft_s=ttfts,
        tpot_s=tpots,
        requests_sent=args.samples + args.warmups + 1,  # + the ready check
        process_cpu_s=cpu,
        wall_s=wall,
        in_flight_cpu_s=json.loads(cpu_file.read_text())["benchmark_cpu_s"],
        failed=result["failed"],
        extra={
            "reported_median_ttft_ms": result["median_ttft_ms"],
            "reported_median_tpot_ms": result["median_tpot_ms"],
            "load_average_1m_after": os.getloadavg()[0],
        },
    )


def relative_spread(values: list[float]) -> float:
    return (max(values) - min(values)) / statistics.median(values)


def tool_report(runs: list[ToolRun], requests_in_flight: int) -> dict[str, Any]:
    """``requests_in_flight``: requests per run covered by ``in_flight_cpu_s``."""
    ttft_medians = [r.median_ttft_s for r in runs]
    tpot_medians = [r.median_tpot_s for r in runs]
    requests = sum(r.requests_sent for r in runs)
    process_cpu = sum(r.process_cpu_s for r in runs)
    report = {
        "runs": len(runs),
        "median_ttft_ms_per_run": [round(m * 1000, 3) for m in ttft_medians],
        "median_tpot_ms_per_run": [round(m * 1000, 3) for m in tpot_medians],
        "median_ttft_ms": round(statistics.median(ttft_medians) * 1000, 3),
        "median_tpot_ms": round(statistics.median(tpot_medians) * 1000, 3),
        "run_to_run_spread_ttft": round(relative_spread(ttft_medians), 4),
        "run_to_run_spread_tpot": round(relative_spread(tpot_medians), 4),
        "failed_requests": sum(r.failed for r in runs),
        "process_cpu_ms_per_request": round(process_cpu / requests * 1000, 2),
        "in_flight_cpu_ms_per_request": round(sum(r.in_flight_cpu_s for r in runs) / (requests_in_flight * len(runs)) * 1000, 3),
    }
    return report


def ratio_report(ours: list[ToolRun], theirs: list[ToolRun], metric: str) -> dict[str, Any]:
    pooled_ours = [v for r in ours for v in getattr(r, metric)]
    pooled_theirs = [v for r in theirs for v in getattr(r, metric)]
    ratio, lo, hi = stats.bootstrap_ratio_of_medians_ci(pooled_theirs, pooled_ours)
    return {
        "fp4forge_over_vllm": round(ratio, 4),
        "ci95": [round(lo, 4), round(hi, 4)],
        "verdict": stats.ratio_verdict((lo, hi), higher="fp4forge higher", lower="fp4forge lower"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--samples", type=int, default=20)
    parser.add_argument("--warmups", type=int, default=3)
    parser.add_argument("--url", help="Use this running server instead of starting one (needs --model and --tokenizer).")
    parser.add_argument("--model", default=SERVED_NAME)
    parser.add_argument("--tokenizer", help="Model directory (vllm bench serve tokenizes with it).")
    args = parser.parse_args()

    stamp = time.strftime("%Y%m%dT%H%M%S")
    out = OUT / "bench_perf_vs_vllm" / stamp
    out.mkdir(parents=True, exist_ok=True)
    server = None
    if args.url:
        if not args.tokenizer:
            raise SystemExit("--url needs --tokenizer MODEL_DIR")
        url, model, tokenizer = args.url, args.model, args.tokenizer
    else:
        from fp4forge.serve import start_vllm
        from fp4forge.testbed import build_tiny_laguna

        model_dir = OUT / "bench_perf_vs_vllm" / "tiny-laguna-dense"
        if not (model_dir / "config.json").exists():
            build_tiny_laguna(model_dir, seed=0, dense=True)
        print(f"starting vllm serve {model_dir} {' '.join(SERVER_ARGS)} ...", flush=True)
        server = start_vllm(
            model_dir, venv=VLLM_VENV, served_model_name=SERVED_NAME, log_path=out / "vllm-serve.log",
            extra_args=SERVER_ARGS, env={"HF_HUB_OFFLINE": "1"}, ready_timeout_s=600,
        )
        url, model, tokenizer = server.base_url, SERVED_NAME, str(model_dir)
    try:
        ours: list[ToolRun] = []
        theirs: list[ToolRun] = []
        for repeat in range(args.repeats):  # interleaved, so slow drift hits both tools alike
            ours.append(run_fp4forge(url, model, out / f"fp4forge-{repeat}", args, repeat))
            print(f"repeat {repeat}: fp4forge  TTFT {ours[-1].median_ttft_s * 1000:8.2f} ms  TPOT {ours[-1].median_tpot_s * 1000:7.3f} ms", flush=True)
            theirs.append(run_vllm_bench(url, model, tokenizer, out / f"vllm-{repeat}", args, repeat))
            print(f"repeat {repeat}: vllm      TTFT {theirs[-1].median_ttft_s * 1000:8.2f} ms  TPOT {theirs[-1].median_tpot_s * 1000:7.3f} ms", flush=True)
    finally:
        if server is not None:
            server.stop()

    report = {
        "setup": {
            "server": f"vllm serve (tiny dense Laguna) {' '.join(SERVER_ARGS)}" if server else url,
            "shape": {"prompt_tokens": args.prompt_tokens, "output_tokens": args.output_tokens},
            "concurrency": 1,
            "samples_per_run": args.samples,
            "warmups_per_run": args.warmups,
            "repeats": args.repeats,
            "machine_cpus": os.cpu_count(),
            "load_average_at_end": os.getloadavg(),
        },
        # fp4forge: warmups + samples (its probe runs before); vLLM: ready check + warmups + samples.
        "fp4forge": tool_report(ours, args.warmups + args.samples),
        "vllm_bench_serve": tool_report(theirs, 1 + args.warmups + args.samples),
        "ttft_ratio": ratio_report(ours, theirs, "ttft_s"),
        "tpot_ratio": ratio_report(ours, theirs, "tpot_s"),
        "runs": [asdict(r) | {"median_ttft_s": r.median_ttft_s, "median_tpot_s": r.median_tpot_s} for r in ours + theirs],
    }
    for metric in ("ttft", "tpot"):
        ratio = report[f"{metric}_ratio"]["fp4forge_over_vllm"]
        noise = max(report["fp4forge"][f"run_to_run_spread_{metric}"], report["vllm_bench_serve"][f"run_to_run_spread_{metric}"])
        report[f"{metric}_ratio"]["run_to_run_noise"] = noise
        report[f"{metric}_ratio"]["within_noise"] = abs(ratio - 1.0) <= noise
    (out / "results.json").write_text(json.dumps(report, indent=2) + "\n")
    print_report(report, out)


def print_report(report: dict[str, Any], out: Path) -> None:
    ours, theirs = report["fp4forge"], report["vllm_bench_serve"]
    print()
    print(f"{'':34}{'fp4forge':>14}{'vllm bench':>14}")
    for label, key in (
        ("median TTFT (ms), median of runs", "median_ttft_ms"),
        ("median TPOT (ms), median of runs", "median_tpot_ms"),
        ("run-to-run spread TTFT", "run_to_run_spread_ttft"),
        ("run-to-run spread TPOT", "run_to_run_spread_tpot"),
        ("client CPU ms / request in flight", "in_flight_cpu_ms_per_request"),
        ("whole-process CPU ms / request", "process_cpu_ms_per_request"),
    ):
        print(f"{label:34}{ours[key]:>14}{theirs[key]:>14}")
    for metric in ("ttft", "tpot"):
        r = report[f"{metric}_ratio"]
        print(
            f"{metric.upper()} ratio fp4forge/vllm: {r['fp4forge_over_vllm']:.4f} (95% CI {r['ci95'][0]:.4f}-{r['ci95'][1]:.4f}, "
            f"{r['verdict']}); run-to-run noise {r['run_to_run_noise']:.1%}; within noise: {r['within_noise']}"
        )
    print(f"\nfull results: {out / 'results.json'}")


if __name__ == "__main__":
    main()
