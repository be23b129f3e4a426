"""The quality suite offline: a checkpoint behind transformers' greedy generation instead of a server.

A diagnostic, not the suite's measurement (that is ``fp4forge quality run`` against vLLM): the
suite's own runner, simulated tools and scorer play every scenario, and each request is rendered
with the checkpoint's chat template (thinking on, as the runner's default request), generated
(greedy, or sampled with seeded draws per request; each turn of every scenario in one batched
generation), and split the way vLLM's ``poolside_v1`` parsers split a reply (reasoning before
``</think>``, ``<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value></tool_call>`` blocks,
values typed by the tool's schema). Prints the total, the first-step tool-choice accuracy (the
first step of every scenario that expects calls: did the first call name the expected function)
and the restraint rate (scenarios whose first step expects no call: did the model call nothing).

    python -m fp4forge.lab.diagnostics.offline_suite MODEL [--device cuda] [--max-new-tokens 128] [--json OUT]
    python -m fp4forge.lab.diagnostics.offline_suite --paired A.json B.json   # per-scenario paired test of two --json results
    python -m fp4forge.lab.diagnostics.offline_suite MODEL --temperature 0.7 --seed 3 --json OUT   # one sampled run
    python -m fp4forge.lab.diagnostics.offline_suite --compare A1.json A2.json --against B1.json B2.json   # the suite's verdict
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer, LagunaForCausalLM, LogitsProcessor, LogitsProcessorList

from fp4forge.endpoint import NO_SERVER_URL
from fp4forge.quality.runner import Reply, run_config, run_scenario
from fp4forge.quality.suite import load_suite

CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)
ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)


def _typed(value: str, schema: dict[str, Any] | None) -> Any:
    kind = (schema or {}).get("type")
    if kind == "string":
        return value
    try:
        return json.loads(value)
    except ValueError:
        return value


def parse_reply(text: str, tools: list[dict[str, Any]]) -> dict[str, Any]:
    reasoning, _, rest = text.partition("</think>") if "</think>" in text else ("", "", text)
    schemas = {t["function"]["name"]: t["function"].get("parameters", {}).get("properties", {}) for t in tools}
    calls = []
    for k, block in enumerate(CALL.findall(rest)):
        name = block.split("<arg_key>", 1)[0].strip()
        arguments = {key.strip(): _typed(value, schemas.get(name, {}).get(key.strip())) for key, value in ARG.findall(block)}
        calls.append({"id": f"x{k}", "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}})
    content = CALL.sub("", rest.split("<tool_call>", 1)[0] if "</tool_call>" not in rest else rest).strip() or None
    message: dict[str, Any] = {"role": "assistant", "reasoning": reasoning.strip() or None, "content": content}
    if calls:
        message["tool_calls"] = calls
    return message


def wire_for_template(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What vLLM renders: tool-call arguments parsed from their JSON strings."""
    out = []
    for message in messages:
        message = dict(message)
        if message.get("tool_calls"):
            message["tool_calls"] = [
                {**call, "function": {**call["function"], "arguments": _loads(call["function"]["arguments"])}} for call in message["tool_calls"]
            ]
        out.append(message)
    return out


def _loads(text: Any) -> Any:
    if not isinstance(text, str):
        return text
    try:
        return json.loads(text)
    except ValueError:
        return {}


def request_seed(seed: int, scenario_id: str, turn: int) -> int:
    """The sampling seed of one request: run ``seed``'s draws for turn ``turn`` of ``scenario_id``,
    whatever else is generated beside it (so two arms' run k sample each request the same way)."""
    digest = hashlib.sha256(f"{seed}:{scenario_id}:{turn}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def gumbel_noise(seeds: list[int], steps: int, vocab: int, device: torch.device | str) -> torch.Tensor:
    """``[len(seeds), steps, vocab]`` standard Gumbel draws, row r from ``seeds[r]`` alone (drawn
    on ``device``): argmax(logits / T + noise) is a draw from softmax(logits / T), the Gumbel-max
    trick, so each row's draws do not depend on the batch around it."""
    uniform = torch.stack([torch.rand(steps, vocab, generator=torch.Generator(device).manual_seed(s), device=device) for s in seeds])
    return -torch.log(-torch.log(uniform.clamp_min(torch.finfo(torch.float32).tiny)))


class GumbelSampler(LogitsProcessor):
    """Sampling at ``temperature`` inside a greedy ``generate``: each row's scores plus its own
    request's Gumbel noise at this step (no top-k/top-p, as the suite's request)."""

    def __init__(self, seeds: list[int], temperature: float, prompt_width: int, steps: int) -> None:
        self.seeds, self.temperature, self.prompt_width, self.steps = seeds, temperature, prompt_width, steps
        self.noise: torch.Tensor | None = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        # All steps up front (72 requests x 128 steps x a 4,096 vocabulary: 151 MB): on CUDA a [steps, vocab]
        # draw is not the same stream as `steps` draws of [vocab] (Philox's element-to-counter mapping
        # depends on the tensor's size), so drawing per step would change every seeded run.
        if self.noise is None:  # the vocabulary and device as the logits have them
            self.noise = gumbel_noise(self.seeds, self.steps, scores.shape[-1], scores.device)
        return scores.float() / self.temperature + self.noise[:, input_ids.shape[1] - self.prompt_width]


def generate_replies(model: Any, tokenizer: Any, device: str, max_new_tokens: int, temperature: float, seed: int,
                     requests: list[tuple[tuple[str, int], dict[str, Any]]]) -> list[tuple[Reply, dict[str, Any]]]:
    """One batched ``generate`` for ``requests`` ((scenario id, turn), body), left-padded: greedy at
    temperature 0, else sampled with each request's own seeded draws (``request_seed``). Returns
    each request's reply and its log entry."""
    stop = model.generation_config.eos_token_id
    stops = stop if isinstance(stop, list) else [stop]
    prompts = [tokenizer.apply_chat_template(wire_for_template(body["messages"]), tools=body["tools"], tokenize=False, add_generation_prompt=True)
               for _, body in requests]
    batch = tokenizer(prompts, add_special_tokens=False, return_tensors="pt", padding=True, padding_side="left").to(device)
    width = batch.input_ids.shape[1]
    processors = LogitsProcessorList()
    if temperature > 0:
        processors.append(GumbelSampler([request_seed(seed, *key) for key, _ in requests], temperature, width, max_new_tokens))
    started = time.monotonic()
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=stop, pad_token_id=tokenizer.pad_token_id,
                             logits_processor=processors)
    latency = time.monotonic() - started
    replies = []
    for row, (_, body) in enumerate(requests):
        new = out[row, width:].tolist()
        stop_at = next((i for i, token in enumerate(new) if token in stops), None)  # after it: padding
        finished = stop_at is not None
        new = new if stop_at is None else new[: stop_at + 1]
        text = tokenizer.decode(new, skip_special_tokens=False)
        for special in ("</assistant>", "<|EOS|>", "〈|EOS|〉"):
            text = text.replace(special, "")
        entry = {"prompt_tokens": int(batch.attention_mask[row].sum()), "text": text, "finished": finished}
        replies.append((Reply(parse_reply(text, body["tools"]), "stop" if finished else "length", None, latency, None), entry))
    return replies


class TurnBatcher:
    """Plays conversations side by side: each runs in its own thread and blocks in its ``post``;
    once every unfinished one waits, their requests go to ``answer`` as one batch (in player
    order), so a turn of every scenario costs one batched generation."""

    def __init__(self, answer: Callable[[list[tuple[tuple[int, int], dict[str, Any]]]], list[Reply]]) -> None:
        self.answer = answer

    def run(self, players: list[Callable[[Callable[[dict[str, Any]], Reply]], Any]]) -> list[Any]:
        cond = threading.Condition()
        waiting: dict[int, tuple[tuple[int, int], dict[str, Any]]] = {}
        replies: dict[int, Reply | BaseException] = {}
        results: list[Any] = [None] * len(players)
        errors: list[BaseException] = []
        alive = [len(players)]

        def play_one(index: int) -> None:
            turns = [0]

            def post(body: dict[str, Any]) -> Reply:
                with cond:
                    waiting[index] = ((index, turns[0]), body)
                    turns[0] += 1
                    cond.notify_all()
                    cond.wait_for(lambda: index in replies)
                    reply = replies.pop(index)
                if isinstance(reply, BaseException):
                    raise reply
                return reply

            try:
                results[index] = players[index](post)
            except BaseException as error:  # re-raised by run once every player stopped
                errors.append(error)
            finally:
                with cond:
                    alive[0] -= 1
                    cond.notify_all()

        threads = [threading.Thread(target=play_one, args=(i,), daemon=True) for i in range(len(players))]
        for thread in threads:
            thread.start()
        while True:
            with cond:
                cond.wait_for(lambda: alive[0] == len(waiting))
                if not waiting:
                    break
                batch = [waiting.pop(i) for i in sorted(waiting)]
            try:
                answers: list[Reply | BaseException] = list(self.answer(batch))
                if len(answers) != len(batch):
                    raise RuntimeError(f"{len(answers)} replies to a batch of {len(batch)} requests")
            except Exception as error:  # every waiting player stops with it
                answers = [error] * len(batch)
            with cond:
                replies.update({key[0]: answer for (key, _), answer in zip(batch, answers)})
                cond.notify_all()
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]
        return results


def generated_one_call_scenarios(count: int, entities: str = "pools") -> list[Any]:
    """Held-out one-call scenarios of the training generator (its held-out seed stream): in-distribution requests,
    entity values from the pools or fresh pseudo-words (``entities``: the points then say whether the model copies)."""
    from fp4forge.lab.trained.training_corpus import FAMILIES, HELDOUT_SEED_OFFSET, generate_scenarios

    weights = tuple((name, 1 if name == "one_call" else 0) for name in FAMILIES)
    return [g.scenario for g in generate_scenarios(count, HELDOUT_SEED_OFFSET + 1, weights, entities)]


def evaluate(model_dir: Path, device: str = "cpu", max_new_tokens: int = 128, limit: int | None = None, generated: int = 0,
             entities: str = "pools", temperature: float = 0.0, seed: int = 0) -> dict[str, Any]:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = LagunaForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(device).eval()
    scenarios = generated_one_call_scenarios(generated, entities) if generated else load_suite().scenarios
    return {"model": str(model_dir), **play(model, tokenizer, scenarios[:limit], device, max_new_tokens, temperature, seed)}


def play(model: Any, tokenizer: Any, scenarios: list[Any], device: str, max_new_tokens: int, temperature: float = 0.0, seed: int = 0) -> dict[str, Any]:
    """Every scenario played against ``model`` (any module with ``generate``: a BF16 checkpoint, or
    a quantized one through ``fp4forge.fidelity.reference``), scored by the suite's scorer. The
    scenarios are played side by side, each turn of all of them one batched generation
    (``TurnBatcher``); a request's draws depend on (seed, scenario, turn) alone."""
    logs: list[list[dict[str, Any]]] = [[] for _ in scenarios]
    config = run_config(base_url=NO_SERVER_URL, model="offline", max_tokens=max_new_tokens)

    def answer(batch: list[tuple[tuple[int, int], dict[str, Any]]]) -> list[Reply]:
        requests = [((scenarios[index].id, turn), body) for (index, turn), body in batch]
        replies = generate_replies(model, tokenizer, device, max_new_tokens, temperature, seed, requests)
        for ((index, _), _), (_, entry) in zip(batch, replies):
            logs[index].append(entry)
        return [reply for reply, _ in replies]

    records = TurnBatcher(answer).run([lambda post, s=s: run_scenario(s, config, post) for s in scenarios])
    return score_records(scenarios, records, logs, temperature, seed)


def score_records(scenarios: list[Any], records: list[dict[str, Any]], logs: list[list[dict[str, Any]]], temperature: float,
                  seed: int) -> dict[str, Any]:
    """The run's totals, first-step tool choice and restraint, and per-scenario points and texts."""
    earned = maximum = 0
    choice_hits = choice_total = restraint_hits = restraint_total = 0
    per_scenario = []
    for scenario, record, log in zip(scenarios, records, logs):
        earned += record["score"]["earned"]
        maximum += record["score"]["max"]
        first = scenario.steps[0]
        message = record["turns"][0]["message"] if record["turns"] else None
        called = [c["function"]["name"] for c in (message or {}).get("tool_calls") or []]
        if first.expect == "call":
            choice_total += 1
            choice_hits += bool(called) and called[0] == first.calls[0].name
        else:
            restraint_total += 1
            restraint_hits += not called
        per_scenario.append({"id": scenario.id, "earned": record["score"]["earned"], "max": record["score"]["max"],
                             "expected_first": [c.name for c in first.calls] if first.expect == "call" else first.expect,
                             "called_first": called, "texts": [entry["text"] for entry in log]})
    entries = [entry for log in logs for entry in log]
    return {"temperature": temperature, "seed": seed, "earned": earned, "max": maximum,
            "tool_choice": [choice_hits, choice_total], "restraint": [restraint_hits, restraint_total],
            "turns_with_calls": sum(1 for s in per_scenario for t in s["texts"] if "<tool_call>" in t),
            "turns": len(entries), "cut_at_max_tokens": sum(1 for entry in entries if not entry["finished"]), "scenarios": per_scenario}


def paired(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """B minus A, scenario by scenario (points): exact sign test on the scenarios that differ,
    sign-flip permutation p of the total, 95 % bootstrap CI of the mean per-scenario difference."""
    from fp4forge.quality.stats import paired_bootstrap_ci, sign_flip_p, sign_test

    points_a = {s["id"]: s["earned"] for s in a["scenarios"]}
    points_b = {s["id"]: s["earned"] for s in b["scenarios"]}
    if points_a.keys() != points_b.keys():
        raise SystemExit("the two results did not play the same scenarios")
    diffs = [points_b[k] - points_a[k] for k in sorted(points_a)]
    better, worse = sum(d > 0 for d in diffs), sum(d < 0 for d in diffs)
    low, high = paired_bootstrap_ci(diffs)
    return {"a": a["model"], "b": b["model"], "a_points": sum(points_a.values()), "b_points": sum(points_b.values()),
            "difference": sum(diffs), "scenarios": len(diffs), "b_better": better, "b_worse": worse,
            "sign_test_p": sign_test(better, worse), "sign_flip_p": sign_flip_p(diffs),
            "mean_difference_ci95": [low, high]}


def compare_runs(runs_a: list[dict[str, Any]], runs_b: list[dict[str, Any]]) -> dict[str, Any]:
    """The suite's own arm comparison (fp4forge.quality.stats.compare_arms: noise floor, paired tests,
    verdict) over several --json results per arm (e.g. sampled runs with different seeds)."""
    from fp4forge.quality.stats import compare_arms
    from fp4forge.quality.suite import load_suite

    categories = {s.id: s.category for s in load_suite().scenarios}
    def as_run(result: dict[str, Any]) -> dict[str, tuple[int, int]]:
        return {s["id"]: (s["earned"], s["max"]) for s in result["scenarios"]}

    # each play's sampling (temperature, seed): seeded samples scale the A/A band to the means' difference
    requests = {arm: [{"temperature": r.get("temperature"), "seed": r.get("seed")} for r in runs] for arm, runs in (("A", runs_a), ("B", runs_b))}
    result = compare_arms([as_run(r) for r in runs_a], [as_run(r) for r in runs_b], categories, requests=requests)
    keep = ("runs", "points", "mean_fraction_diff", "bootstrap_ci", "sign_test", "sign_flip_p", "discordant", "verdict", "power")
    out = {k: result[k] for k in keep}
    out["noise_floor"] = {arm: {k: floor[k] for k in ("total_per_run", "band_points", "max_discordant")} for arm, floor in result["noise_floor"].items()}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path, nargs="?")
    parser.add_argument("--paired", type=Path, nargs=2, metavar=("A_JSON", "B_JSON"), help="compare two --json results instead of playing")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--limit", type=int, default=None, help="only the first N scenarios")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy; else sampled")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed of this run")
    parser.add_argument("--compare", type=Path, nargs="+", metavar="A_JSON", help="arm A's --json results (one per run): the suite's verdict vs --against")
    parser.add_argument("--against", type=Path, nargs="+", metavar="B_JSON", help="arm B's --json results, with --compare")
    parser.add_argument("--generated", type=int, default=0, help="play N held-out generated one-call scenarios instead of the suite")
    args = parser.parse_args(argv)
    if args.paired:
        print(json.dumps(paired(*(json.loads(path.read_text()) for path in args.paired)), indent=1))
        return 0
    if args.compare or args.against:
        if not (args.compare and args.against):
            parser.error("--compare A.json... needs --against B.json...")
        runs_a, runs_b = ([json.loads(path.read_text()) for path in paths] for paths in (args.compare, args.against))
        print(json.dumps(compare_runs(runs_a, runs_b), indent=1))
        return 0
    if args.model is None:
        parser.error("MODEL is required unless --paired")
    torch.manual_seed(0)
    result = evaluate(args.model, args.device, args.max_new_tokens, args.limit, args.generated, temperature=args.temperature, seed=args.seed)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{args.model}: {result['earned']}/{result['max']} points; first-step tool choice {result['tool_choice'][0]}/{result['tool_choice'][1]};"
          f" restraint {result['restraint'][0]}/{result['restraint'][1]}; turns with calls {result['turns_with_calls']}/{result['turns']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
