"""`fp4forge quality` end to end against the real vLLM CPU servers of tests/conftest.py.

Arms for the suite: both are the session's ``vllm_laguna_dense`` server (tiny random Laguna, fp32,
``--tool-call-parser poolside_v1 --reasoning-parser poolside_v1``), which is the only session server
with tool calling enabled (``vllm_qwen3_moe`` has no tool parser, so vLLM refuses ``tool_choice:
auto`` there). The testbed template thinks by default (the generation prompt opens ``<think>``);
the arms differ in request configuration only:

* arm A ("think-off"): no ``chat_template_kwargs``: vLLM's stock ``poolside_v1`` then becomes an
  identity parser, so the generated text lands in ``content``;
* arm B ("think-on"): ``chat_template_kwargs={"enable_thinking": true}``: the parser separates
  reasoning, and the random model, which never writes ``</think>``, gets everything moved into the
  ``reasoning`` field, which the scorer must not score.

Arm A runs the whole suite twice (its A/A noise floor), arm B once, with ``max_tokens`` 16 (the
budget is a few minutes on a shared 2-core CPU; the suite is 72+ requests per run). A random model
emits garbage cut at 16 tokens: every arm is unreadable (docs/quality.md#unreadable-answers), so
the runs pass ``--allow-unreadable`` and the refusal itself is checked once; the pipeline,
transcripts and statistics are what is tested. The KL probe compares Laguna (A) with the session's tiny Qwen3-MoE (B), which shares the
testbed tokenizer; the determinism probe uses the Laguna server with ``echo`` + logprobs.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from fp4forge.cli.quality import register
from fp4forge.quality.suite import load_suite
from fp4forge.quality.runner import read_transcript
from fp4forge.serve import VllmServer

pytestmark = pytest.mark.slow

MAX_TOKENS = "16"
RUNS = {"think-off": 2, "think-on": 1}
VERDICTS = {"no difference", "cannot order the arms", "A better", "B better"}


def invoke(*args: str) -> Any:
    app = typer.Typer()
    register(app)
    return CliRunner().invoke(app, ["quality", *args], catch_exceptions=False)


@pytest.fixture(scope="module")
def arm_runs(vllm_laguna_dense: VllmServer, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("quality")
    server = vllm_laguna_dense
    common = ["--url", server.base_url, "--model", server.served_model_name, "--max-tokens", MAX_TOKENS, "--json",
              "--allow-unreadable"]
    seconds = {}
    docs = {}
    for arm, extra in (("think-off", []), ("think-on", ["--chat-template-kwargs", '{"enable_thinking": true}'])):
        started = time.monotonic()
        result = invoke("run", "--out", str(out / arm), "--arm", arm, "--runs", str(RUNS[arm]), *common, *extra)
        seconds[arm] = time.monotonic() - started
        assert result.exit_code == 0, result.output  # 0: every request succeeded (unreadable allowed)
        docs[arm] = json.loads(result.stdout)
        assert docs[arm]["answers"]["allowed"] and "WARNING" in result.stderr
    return {"out": out, "docs": docs, "seconds": seconds}


def test_suite_runs_end_to_end_with_the_poolside_parsers(arm_runs: dict[str, Any]) -> None:
    suite = load_suite()
    out = arm_runs["out"]
    for arm in ("think-off", "think-on"):
        paths = sorted((out / arm).glob("*.jsonl"))
        assert [p.name for p in paths] == [f"{arm}-run{k:02d}.jsonl" for k in range(1, RUNS[arm] + 1)]
        for path in paths:
            header, records, footer = read_transcript(path)
            assert footer["complete"] and footer["scenario_count"] == len(suite.scenarios) == len(records)
            assert footer["failed_requests"] == 0
            assert header["request"]["temperature"] == 0.0 and header["request"]["max_tokens"] == int(MAX_TOKENS)
            assert header["endpoint"]["server_version"] and header["endpoint"]["max_model_len"] == 2048
            assert header["request"]["stream"] is True
            for record in records:
                assert record["turns"] and all(turn["message"]["role"] == "assistant" for turn in record["turns"])
                assert all(turn["usage"]["completion_tokens"] <= int(MAX_TOKENS) for turn in record["turns"])
        doc = arm_runs["docs"][arm]
        assert len(doc["runs"]) == RUNS[arm] and all(run["complete"] for run in doc["runs"])
        assert all(0 <= run["earned"] <= run["max"] for run in doc["runs"])
        assert (arm in doc["noise_floor"]) == (RUNS[arm] > 1)
        assert (out / arm / "score.md").is_file()
    # Thinking on: the reasoning parser moves the generated text out of content, so it is not scored.
    think_on = arm_runs["docs"]["think-on"]["runs"][0]["flags"]
    think_off = arm_runs["docs"]["think-off"]["runs"][0]["flags"]
    assert think_on["reasoning_field"] > len(suite.scenarios) // 2
    assert think_off["reasoning_field"] == 0
    print(f"suite timings (runs {RUNS}): {arm_runs['seconds']}")


def test_compare_report_between_the_two_arms(arm_runs: dict[str, Any], tmp_path: Path) -> None:
    out = arm_runs["out"]
    report = tmp_path / "compare"
    refused = invoke("compare", str(out / "think-off"), "--json", "--", str(out / "think-on"))
    assert refused.exit_code == 1 and json.loads(refused.stdout)["verdict"]["label"] == "refused"
    result = invoke("compare", str(out / "think-off"), "--out", str(report), "--json", "--allow-unreadable", "--", str(out / "think-on"))
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["scenarios"] == len(load_suite().scenarios) and doc["runs"] == {"A": 2, "B": 1}
    assert doc["arms"]["B"]["request"]["chat_template_kwargs"] == {"enable_thinking": True}
    assert doc["verdict"]["label"] in VERDICTS and doc["verdict"]["text"].startswith("UNREADABLE ANSWERS")
    assert doc["noise_floor"]["A"]["measured"] and not doc["noise_floor"]["B"]["measured"]
    assert 0.0 <= doc["sign_test"]["p"] <= 1.0
    assert doc["bootstrap_ci"][0] <= doc["mean_fraction_diff"] <= doc["bootstrap_ci"][1]
    assert {"compare.json", "compare.md", "category_scores.png"} <= {p.name for p in report.iterdir()}
    assert "## Per category" in (report / "compare.md").read_text()
    print(f"compare verdict on the real server: {doc['verdict']['text']}")


def test_kl_probe_within_and_between_arms(vllm_laguna_dense: VllmServer, vllm_qwen3_moe: VllmServer, tmp_path: Path) -> None:
    a, b = vllm_laguna_dense, vllm_qwen3_moe
    result = invoke("kl", "--url-a", a.base_url, "--model-a", a.served_model_name, "--url-b", b.base_url,
                    "--model-b", b.served_model_name, "--out", str(tmp_path), "--sequences", "2", "--top-k", "20", "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    positions = sum(doc["sequence_tokens"]) - doc["sequences"]  # position 0 of each sequence has no context
    for key in ("within_a", "within_b", "between", "between_repeat"):
        block = doc[key]
        assert block["positions"] == positions
        assert block["kl_lower_bound_mean"] >= 0.0 and 0.0 <= block["top1_agreement"] <= 1.0
    # Each position's set is the top-20 plus the actual token when it is outside them (20 or 21
    # entries). The same server asked twice returns the same sets (measured 20.999 / 20.998: the
    # whole set is shared); two different random models share little beyond the actual token,
    # which is in both sets by construction (measured 1.026).
    for key in ("within_a", "within_b"):
        assert 20.0 <= doc[key]["mean_shared_tokens"] <= 21.0, key
    for key in ("between", "between_repeat"):
        assert 1.0 <= doc[key]["mean_shared_tokens"] < 5.0, key
    assert "lower bound" in doc["estimator"]
    # Two different random models: the between-arm bound cannot be zero everywhere.
    assert doc["between"]["kl_lower_bound_mean"] > 0.0
    assert doc["between"]["top1_agreement"] < doc["within_a"]["top1_agreement"]
    assert doc["verdict"].startswith("the arms differ by more than each differs from itself")
    assert {"kl.json", "kl.md"} <= {p.name for p in tmp_path.iterdir()}
    print(f"KL: within A {doc['within_a']['kl_lower_bound_mean']:.4g}, within B {doc['within_b']['kl_lower_bound_mean']:.4g}, "
          f"between {doc['between']['kl_lower_bound_mean']:.4g}; {doc['verdict']}; shared tokens "
          + ", ".join(f"{k} {doc[k]['mean_shared_tokens']:.3f}" for k in ("within_a", "within_b", "between", "between_repeat")))


def test_determinism_probe(vllm_laguna_dense: VllmServer, tmp_path: Path) -> None:
    server = vllm_laguna_dense
    result = invoke("determinism", "--url", server.base_url, "--model", server.served_model_name, "--out", str(tmp_path),
                    "--prompts", "2", "--replicates", "4", "--max-tokens", "16", "--top-k", "5", "--mode", "echo", "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    forced, greedy = doc["teacher_forced"], doc["greedy"]
    assert forced["positions"] > 0 and 0 <= forced["bitwise_stable"] <= forced["positions"]
    assert greedy["replicate_pairs"] == 2 * 3
    assert sum(greedy["first_divergence_histogram"].values()) == greedy["diverged"]
    assert all(seq["generated_tokens"] == 16 for seq in greedy["per_sequence"])  # EOS ignored: equal lengths
    assert {"determinism.json", "determinism.md", "divergence_histogram.png"} <= {p.name for p in tmp_path.iterdir()}
    print(f"determinism: {forced['bitwise_stable']}/{forced['positions']} teacher-forced positions bitwise stable; "
          f"{greedy['diverged']}/{greedy['replicate_pairs']} greedy replicates diverged")
