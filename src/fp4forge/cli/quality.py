"""`fp4forge quality`: the agentic tool-use suite, arm comparison, KL and determinism probes.

    fp4forge quality list [--json] [--markdown] [--category C]
    fp4forge quality run --url URL --model NAME --out DIR [--arm A] [--runs 2] [--max-tokens 512]
                         [--seed 0] [--temperature 0] [--concurrency 1] [--system-prefix TEXT] [--chat-template-kwargs JSON]
                         [--only ID,ID] [--category C,C] [--no-stream] [--allow-unreadable] [--json]
    fp4forge quality score TRANSCRIPT.jsonl... [--out DIR] [--json] [--markdown] [--allow-unreadable]
    fp4forge quality compare RUNS_A... -- RUNS_B... [--out DIR] [--json] [--markdown] [--no-plots]
                             [--alpha 0.05] [--bootstrap 10000] [--seed 0] [--allow-unreadable]
    fp4forge quality kl --url-a URL --model-a NAME --url-b URL --model-b NAME --out DIR
                        [--sequences 8] [--top-k 20] [--mode prompt_logprobs|echo] [--json]
    fp4forge quality determinism --url URL --model NAME --out DIR [--prompts 4] [--replicates 8]
                                 [--max-tokens 32] [--top-k 5] [--mode prompt_logprobs|echo] [--json]

A RUNS argument is a transcript file or a directory (its ``*.jsonl``). ``compare`` also takes
``--b RUN`` (repeatable) instead of ``--``.

Exit codes. run: 0 every request succeeded; 1 the runs finished but some requests failed (recorded
in the transcripts and counted), or an arm's answers were unreadable and it was not scored
(``UnreadableAnswersError``: most turns cut at max_tokens or reasoning only; the transcripts and
the score files, which say why, are written; ``--allow-unreadable`` scores it with a warning);
2 unusable (bad options, no server, model not served, suite invalid); 3 a run wrote fewer
scenarios than the suite holds. score / compare: 0, 1 for unreadable answers as for run, or 2
when the inputs cannot be read or compared (incomplete runs). kl / determinism: 0, or 2 (different
tokenizers, failed probe).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Console
from typer.core import TyperCommand

from fp4forge.cli.common import console, fail
from fp4forge.cli.common import emit_json as _emit
from fp4forge.errors import ExitCode, Fp4forgeError
from fp4forge.quality.suite import load_suite
from fp4forge.endpoint import Endpoint
from fp4forge.quality.probes import MODES, determinism_probe, kl_probe, suite_sequences
from fp4forge.quality.evaluate import run_and_score
from fp4forge.quality.report import score_document
from fp4forge.quality.stats import DEFAULT_ALPHA, DEFAULT_BOOTSTRAP
from fp4forge.quality.answers import refusal_error
from fp4forge.quality.runner import IncompleteRunError, RunConfig, expand_transcripts, rescore_transcript, run_config
from fp4forge.report.quality_files import write_compare, write_determinism, write_kl, write_score
from fp4forge.report.quality_tables import (
    compare_markdown,
    compare_rich,
    determinism_markdown,
    kl_rich,
    listing_markdown,
    listing_rich,
    score_markdown,
    score_rich,
)

EXIT_SOME_FAILED = ExitCode.FINDINGS
EXIT_UNUSABLE = ExitCode.UNUSABLE
EXIT_INCOMPLETE = ExitCode.ABORTED

quality_app = typer.Typer(no_args_is_help=True, help="Agentic tool-use quality: suite, arm comparison with a noise floor, KL, determinism.")


def register(app: typer.Typer) -> None:
    app.add_typer(quality_app, name="quality")


def _err() -> Console:
    return console(stderr=True)


def _fail(message: object, code: int = EXIT_UNUSABLE, as_json: bool = False) -> SystemExit:
    return fail(message, code, as_json)


ALLOW_UNREADABLE_HELP = ("Score an arm even when most of its turns were cut at max tokens or held reasoning only "
                         "(default: refuse, exit 1); every report then carries the warning.")


def _refuse_or_warn(doc: dict[str, Any], where: Optional[Path]) -> None:
    """Exit 1 with the refusal (after the files are written), or print the override's warning.
    Under --json the document already went to stdout with its ``answers`` block: stderr only."""
    error = refusal_error(doc, file=str(where) if where is not None else None)
    if error is not None:
        raise _fail(error, EXIT_SOME_FAILED, False)
    block = doc.get("answers") or {}
    if block.get("allowed"):
        _err().print("[bold red]WARNING[/bold red]: scored although the answers are unreadable: " + "; ".join(block["unreadable"]),
                     highlight=False)


def _csv(text: Optional[str]) -> Optional[list[str]]:
    return [part.strip() for part in text.split(",") if part.strip()] if text else None


# -- list ---------------------------------------------------------------------------------------
@quality_app.command("list")
def list_command(
    as_json: bool = typer.Option(False, "--json", help="A JSON list of {id, category, max_points, steps, summary}."),
    markdown: bool = typer.Option(False, "--markdown"),
    category: Optional[str] = typer.Option(None, "--category", help="Comma-separated categories."),
) -> None:
    """List every scenario with its category and maximum points."""
    try:
        suite = load_suite()
        chosen = {s.id for s in suite.select(categories=_csv(category))}
    except Fp4forgeError as error:
        raise _fail(str(error), as_json=as_json) from error
    listing = [item for item in suite.listing() if item["id"] in chosen]
    if as_json:
        _emit(listing)
    elif markdown:
        sys.stdout.write(listing_markdown(listing))
    else:
        Console().print(listing_rich(listing))
        Console().print(f"suite {suite.name} {suite.version}: {len(suite.scenarios)} scenarios in {len(suite.categories)} categories, "
                        f"{sum(s.max_points for s in suite.scenarios)} points", highlight=False)


# -- run ----------------------------------------------------------------------------------------
@quality_app.command("run")
def run_command(
    url: str = typer.Option(..., "--url", help="Server root or its /v1 (OpenAI-compatible)."),
    model: str = typer.Option(..., "--model", help="Served model name."),
    out: Path = typer.Option(..., "--out", help="Directory for <arm>-runNN.jsonl transcripts and score.json/.md."),
    arm: str = typer.Option(RunConfig.arm, "--arm", help="Arm label, used in file names and reports."),
    runs: int = typer.Option(RunConfig.runs, "--runs", min=1, help="Runs of the whole suite; 2+ gives this arm's noise floor."),
    max_tokens: int = typer.Option(RunConfig.max_tokens, "--max-tokens", min=1),
    seed: int = typer.Option(RunConfig.seed, "--seed", help="Request seed; sampled runs use seed, seed + 1, ... run by run."),
    temperature: float = typer.Option(RunConfig.temperature, "--temperature", help="0 (default): greedy, the measurement protocol. Above 0: sampled "
                                      "runs, each with its own seed, so --runs 2+ measures how much the arm moves between samples "
                                      "(vLLM CPU 0.32: serve with --no-enable-chunked-prefill, or a seeded request kills the engine)."),
    concurrency: int = typer.Option(RunConfig.concurrency, "--concurrency", min=1, help="Scenarios in flight; 1 (default) keeps batches of one."),
    timeout_s: float = typer.Option(RunConfig.timeout_s, "--timeout", help="Per request, seconds."),
    system_prefix: Optional[str] = typer.Option(None, "--system-prefix", help="Text prepended to every system prompt (a request variant)."),
    chat_template_kwargs: Optional[str] = typer.Option(None, "--chat-template-kwargs", help='JSON, e.g. {"enable_thinking": true}.'),
    only: Optional[str] = typer.Option(None, "--only", help="Comma-separated scenario ids (a partial run)."),
    category: Optional[str] = typer.Option(None, "--category", help="Comma-separated categories (a partial run)."),
    stream: bool = typer.Option(RunConfig.stream, "--stream/--no-stream", help="Read answers streamed (default), as agent clients do "
                                "and as vLLM splits reasoning from answers by the rendered prompt; --no-stream for comparison."),
    allow_unreadable: bool = typer.Option(False, "--allow-unreadable", help=ALLOW_UNREADABLE_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print the score document as JSON."),
) -> None:
    """Run the suite N times against an endpoint; transcripts are written as scenarios finish."""
    try:
        kwargs = json.loads(chat_template_kwargs) if chat_template_kwargs else None
        if kwargs is not None and not isinstance(kwargs, dict):
            raise ValueError("must be a JSON object")
    except ValueError as error:
        raise _fail(f"--chat-template-kwargs: {error}", as_json=as_json) from error
    progress = _err()

    def on_scenario(run: int, record: dict[str, Any]) -> None:
        score = record.get("score") or {}
        failed = " request failed" if any(t.get("error") for t in record.get("turns", [])) else ""
        progress.print(f"run {run} {record['id']}: {score.get('earned', '?')}/{score.get('max', '?')}{failed}", highlight=False)

    try:
        config = run_config(base_url=url, model=model, arm=arm, runs=runs, max_tokens=max_tokens, seed=seed, temperature=temperature,
                           concurrency=concurrency,
                           timeout_s=timeout_s, system_prefix=system_prefix, chat_template_kwargs=kwargs, stream=stream)
        outcome = run_and_score(config, out, only=_csv(only), categories=_csv(category), on_scenario=on_scenario, write=write_score,
                                allow_unreadable=allow_unreadable)
    except IncompleteRunError as error:
        raise _fail(error, EXIT_INCOMPLETE, as_json) from error
    except Fp4forgeError as error:
        raise _fail(error, as_json=as_json) from error
    doc = outcome.document
    if as_json:
        _emit(doc)
    else:
        Console().print(score_rich(doc))
        Console().print(f"transcripts: {', '.join(str(p) for p in outcome.transcripts)}; report: {out / 'score.md'}", highlight=False)
    _refuse_or_warn(doc, out)
    if outcome.failed_requests:
        raise typer.Exit(EXIT_SOME_FAILED)


# -- score --------------------------------------------------------------------------------------
@quality_app.command("score")
def score_command(
    transcripts: list[Path] = typer.Argument(..., help="Transcript files or directories."),
    out: Optional[Path] = typer.Option(None, "--out", help="Also write score.json and score.md here."),
    as_json: bool = typer.Option(False, "--json"),
    markdown: bool = typer.Option(False, "--markdown"),
    allow_unreadable: bool = typer.Option(False, "--allow-unreadable", help=ALLOW_UNREADABLE_HELP),
) -> None:
    """Re-score saved transcripts offline with the current suite (tool calls are replayed)."""
    try:
        suite = load_suite()
        results = [rescore_transcript(path, suite) for path in expand_transcripts(transcripts)]
    except (Fp4forgeError, OSError) as error:
        raise _fail(str(error), as_json=as_json) from error
    if not results:
        raise _fail("no transcripts found", as_json=as_json)
    doc = score_document(results, suite, allow_unreadable=allow_unreadable)
    if out is not None:
        write_score(doc, out)
    if as_json:
        _emit(doc)
    elif markdown:
        sys.stdout.write(score_markdown(doc))
    else:
        Console().print(score_rich(doc))
    _refuse_or_warn(doc, out)


# -- compare ------------------------------------------------------------------------------------
class DashDashSplit(TyperCommand):
    """Keeps ``A... -- B...`` apart: click would drop the ``--`` and merge both lists.

    After ``--``, this command's own options (``--json``, ``--out DIR``...) still work; every other
    word is an arm B transcript.
    """

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        if "--" in args:
            cut = args.index("--")
            args = args[:cut] + self._arm_b_as_options(args[cut + 1:])
        return super().parse_args(ctx, args)

    def _arm_b_as_options(self, words: list[str]) -> list[str]:
        takes_value = {
            name: not param.is_flag
            for param in self.params
            if param.param_type_name == "option"  # typer vendors its own click: no isinstance
            for name in (*param.opts, *param.secondary_opts)
        }
        converted: list[str] = []
        index = 0
        while index < len(words):
            word = words[index]
            name = word.split("=", 1)[0]
            if name in takes_value:
                converted.append(word)
                if takes_value[name] and "=" not in word and index + 1 < len(words):
                    index += 1
                    converted.append(words[index])
            else:
                converted += ["--b", word]
            index += 1
        return converted


@quality_app.command("compare", cls=DashDashSplit)
def compare_command(
    runs_a: list[Path] = typer.Argument(..., help="Arm A transcripts (files or directories), then -- and arm B's."),
    runs_b: list[Path] = typer.Option([], "--b", help="An arm B transcript or directory (what follows -- becomes these)."),
    out: Optional[Path] = typer.Option(None, "--out", help="Write compare.json, compare.md and category_scores.png here."),
    as_json: bool = typer.Option(False, "--json"),
    markdown: bool = typer.Option(False, "--markdown"),
    plots: bool = typer.Option(True, "--plots/--no-plots"),
    alpha: float = typer.Option(DEFAULT_ALPHA, "--alpha"),
    bootstrap: int = typer.Option(DEFAULT_BOOTSTRAP, "--bootstrap", help="Bootstrap resamples."),
    seed: int = typer.Option(0, "--seed", help="Bootstrap / permutation seed."),
    allow_unreadable: bool = typer.Option(False, "--allow-unreadable", help=ALLOW_UNREADABLE_HELP),
) -> None:
    """Compare two arms: noise floor, paired sign test / McNemar, bootstrap CI, flips, power, verdict."""
    from fp4forge.quality.compare import compare_options, compare_runs

    if not runs_b:
        raise _fail("no arm B: write `quality compare A_RUNS... -- B_RUNS...`", as_json=as_json)
    try:
        options = compare_options(alpha=alpha, bootstrap=bootstrap, seed=seed, allow_unreadable=allow_unreadable)
        doc = compare_runs(runs_a, runs_b, options)
    except (Fp4forgeError, OSError) as error:
        raise _fail(error, as_json=as_json) from error
    if out is not None:
        write_compare(doc, out, plots=plots)
    if as_json:
        _emit(doc)
    elif markdown:
        sys.stdout.write(compare_markdown(doc))
    else:
        Console().print(compare_rich(doc))
    _refuse_or_warn(doc, out)


# -- probes -------------------------------------------------------------------------------------
def _check_mode(mode: str, as_json: bool) -> None:
    if mode not in MODES:
        raise _fail(f"--mode must be one of {', '.join(MODES)}", as_json=as_json)


@quality_app.command("kl")
def kl_command(
    url_a: str = typer.Option(..., "--url-a"),
    model_a: str = typer.Option(..., "--model-a"),
    url_b: str = typer.Option(..., "--url-b"),
    model_b: str = typer.Option(..., "--model-b"),
    out: Path = typer.Option(..., "--out", help="Write kl.json and kl.md here."),
    sequences: int = typer.Option(8, "--sequences", min=1, help="Scenario openings scored (one per category first)."),
    top_k: int = typer.Option(20, "--top-k", help="Logprobs per position (vLLM caps it at --max-logprobs, default 20); "
                              "-1: the whole vocabulary (exact KL; needs --max-logprobs -1)."),
    mode: str = typer.Option("prompt_logprobs", "--mode", help="prompt_logprobs (vLLM) or echo (echo + logprobs)."),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Teacher-forced KL (a top-k lower bound) and top-1 agreement, within each arm and between arms."""
    _check_mode(mode, as_json)
    if top_k == 0 or top_k < -1:
        raise _fail("--top-k is a positive count, or -1 for the whole vocabulary", as_json=as_json)
    arm_a, arm_b = Endpoint(url_a, model_a, "A"), Endpoint(url_b, model_b, "B")
    try:
        with arm_a, arm_b:
            seqs = suite_sequences(None, arm_a, load_suite().scenarios, sequences)
            doc = kl_probe(None, arm_a, arm_b, seqs, top_k, mode)
    except Fp4forgeError as error:
        raise _fail(error, as_json=as_json) from error
    write_kl(doc, out)
    if as_json:
        _emit(doc)
    else:
        Console().print(kl_rich(doc))


@quality_app.command("determinism")
def determinism_command(
    url: str = typer.Option(..., "--url"),
    model: str = typer.Option(..., "--model"),
    out: Path = typer.Option(..., "--out", help="Write determinism.json, .md and divergence_histogram.png here."),
    prompts: int = typer.Option(4, "--prompts", min=1),
    replicates: int = typer.Option(8, "--replicates", min=2),
    max_tokens: int = typer.Option(32, "--max-tokens", min=1),
    top_k: int = typer.Option(5, "--top-k", min=1),
    mode: str = typer.Option("prompt_logprobs", "--mode"),
    plots: bool = typer.Option(True, "--plots/--no-plots"),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """The same requests N times: bitwise-stable logprob positions, first divergence of greedy replicates."""
    _check_mode(mode, as_json)
    endpoint = Endpoint(url, model, "A")
    try:
        with endpoint:
            seqs = suite_sequences(None, endpoint, load_suite().scenarios, prompts)
            doc = determinism_probe(None, endpoint, seqs, replicates=replicates, max_tokens=max_tokens, top_k=top_k, mode=mode)
    except Fp4forgeError as error:
        raise _fail(error, as_json=as_json) from error
    write_determinism(doc, out, plots=plots)
    if as_json:
        _emit(doc)
    else:
        sys.stdout.write(determinism_markdown(doc))


def main() -> None:
    app = typer.Typer()
    register(app)
    app()


if __name__ == "__main__":
    main()
