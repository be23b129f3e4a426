"""The trained testbed's corpus, template, statistics and determinism, on small settings.

The full ten-minute training is not run here (``tests/trained_fixtures.py`` serves the testbed
fp4forge ships); these tests use a few optimizer steps on a few dozen documents, which exercise
the same code path, and the cache on them.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from fp4forge.lab.trained.build import corpus_digest, trained_laguna_cache_key
from fp4forge.quality.suite import load_suite
from fp4forge.lab.trained.training_corpus import FAMILIES, Corpus, CorpusSpec, build_corpus, generate_scenarios, play, render, rendered_messages
from fp4forge.testbed.tokenizer import build_tokenizer
from fp4forge.lab.trained.training import REPORT_FILE, TrainingConfig, tail_stats, train_laguna

# What vLLM's poolside_v1 tool parser matches (vllm/tool_parsers/poolside_v1_tool_parser.py, 0.32),
# and the poolside_v1 reasoning split: everything before the turn's first </think> is reasoning.
VLLM_TOOL_CALL = re.compile(r"<tool_call>.*?</tool_call>", re.DOTALL)
VLLM_TOOL_DETAIL = re.compile(r"<tool_call>\s*([^\n<]+?)\s*\n?\s*(<arg_key>.*?)?</tool_call>", re.DOTALL)
VLLM_TOOL_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)
ASSISTANT_TURN = re.compile(r"<assistant>(.*?)</assistant>", re.DOTALL)


@pytest.fixture(scope="module")
def tokenizer():  # type: ignore[no-untyped-def]
    return build_tokenizer()


@pytest.fixture(scope="module")
def generated():  # type: ignore[no-untyped-def]
    return generate_scenarios(len(FAMILIES) * 25, seed=7)


# -- disjointness from the scored suite ------------------------------------------------------------
FIELD_NAME = re.compile(r"^[a-z_]+$")  # structural keys (orders, customer_id, fixtures), not entity ids


def _strings(value: Any) -> set[str]:
    if isinstance(value, str):
        return {value}
    if isinstance(value, dict):
        keys = {k for k in value if isinstance(k, str) and not FIELD_NAME.match(k)}
        return keys.union(*(_strings(v) for v in value.values())) if value else set()
    if isinstance(value, (list, tuple)):
        return set().union(*(_strings(v) for v in value)) if value else set()
    return set()


def _enum_values(tools: Any) -> set[str]:
    """Values a tool schema fixes (enums): shared by construction, not entities."""
    found: set[str] = set()

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            found.update(v for v in node.get("enum", []) if isinstance(v, str))
            for child in node.values():
                walk(child)
        elif isinstance(node, list):
            for child in node:
                walk(child)

    walk(list(tools))
    return found


def _scenario_entities(scenario: Any) -> set[str]:
    """Every string a scenario author chose: in its world (state, fixtures), its messages and the
    argument values and answers it expects; minus the tool schemas' enum values."""
    values = _strings(scenario.world) | _strings([m.get("content") for m in scenario.messages])
    for step in scenario.steps:
        for call in step.calls:
            for spec in call.arguments.values():
                values |= _strings(list(spec.allowed or ()))
        if step.content is not None:
            values |= set(step.content.any_of)
    return {v.strip().casefold() for v in values if v.strip()} - {e.casefold() for e in _enum_values(scenario.tools)}


# Not entities: order statuses the simulated shop's rules read (cancel_order accepts only placed or
# processing orders), and the booking reference the simulated tool mints (BK-1001 for a first booking).
SIMULATOR_VOCABULARY = {"placed", "processing", "delivered", "bk-1001"}


@pytest.fixture(scope="module")
def generated_entities():  # type: ignore[no-untyped-def]
    return generate_scenarios(len(FAMILIES) * 25, seed=7, entities="generated")


@pytest.mark.parametrize("fixture", ["generated", "generated_entities"])
def test_generated_entities_are_disjoint_from_the_scored_suite(fixture: str, request: pytest.FixtureRequest) -> None:
    generated = request.getfixturevalue(fixture)
    scored: set[str] = set()
    for scenario in load_suite().scenarios:
        scored |= _scenario_entities(scenario)
    ours: set[str] = set()
    for item in generated:
        ours |= _scenario_entities(item.scenario)
    shared = (ours & scored) - SIMULATOR_VOCABULARY
    assert shared == set()
    # And no scored user message is reproduced word for word.
    scored_messages = {m["content"] for s in load_suite().scenarios for m in s.messages if m["role"] == "user"}
    assert not scored_messages & {m["content"] for g in generated for m in g.scenario.messages}


def test_every_family_plays_to_full_marks(generated) -> None:  # type: ignore[no-untyped-def]
    transcripts = [play(item) for item in generated]
    assert {t.family for t in transcripts} == set(FAMILIES)
    assert all(t.earned == t.max_points > 0 for t in transcripts)
    # Multi-step families really went through the simulated tools: results came back as tool messages.
    flight = next(t for t in transcripts if t.family == "book_cheapest_flight")
    results = [json.loads(m["content"]) for m in flight.messages if m["role"] == "tool"]
    assert results[-1]["booking_reference"] == "BK-1001" and results[-1]["status"] == "confirmed"


# -- the poolside_v1 format, read back ---------------------------------------------------------------
def _typed(value: str, schema: dict[str, Any]) -> Any:
    """How the poolside_v1 tool parser types an <arg_value>: raw for strings, JSON otherwise."""
    return value if schema.get("type") == "string" else json.loads(value)


def test_rendered_transcripts_parse_back_through_poolside_v1(generated, tokenizer) -> None:  # type: ignore[no-untyped-def]
    for item in generated[: len(FAMILIES) * 3]:
        transcript = play(item)
        text = render(transcript, tokenizer)
        assistants = [m for m in transcript.messages if m["role"] == "assistant"]
        as_rendered = [m for m in rendered_messages(transcript) if m["role"] == "assistant"]
        turns = ASSISTANT_TURN.findall(text)
        assert len(turns) == len(assistants)
        tools = {t["function"]["name"]: t["function"]["parameters"]["properties"] for t in transcript.tools}
        # The last turn always carries its reasoning; earlier ones keep it or read as a client sends them back.
        assert as_rendered[-1].get("reasoning") == assistants[-1]["reasoning"]
        for turn, message in zip(turns, as_rendered):
            if message.get("reasoning"):
                assert turn.startswith("<think>")
                reasoning, content = turn[len("<think>"):].split("</think>", 1)
                assert reasoning == message["reasoning"]
            else:
                assert turn.startswith("</think>")
                content = turn[len("</think>"):]
            calls = []
            for block in VLLM_TOOL_CALL.findall(content):
                detail = VLLM_TOOL_DETAIL.search(block)
                name = detail.group(1).strip()
                arguments = {k: _typed(v, tools[name][k]) for k, v in VLLM_TOOL_ARG.findall(detail.group(2) or "")}
                calls.append({"name": name, "arguments": arguments})
            assert calls == [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in message.get("tool_calls") or []]
            assert VLLM_TOOL_CALL.sub("", content) == (message["content"] or "")


def test_training_text_continues_the_serving_prompt(generated, tokenizer) -> None:  # type: ignore[no-untyped-def]
    """The prompt a server builds (no kwargs: thinking on) is a prefix of the text trained on, at every turn."""
    for item in generated[: len(FAMILIES)]:
        transcript = play(item)
        full = render(transcript, tokenizer)
        messages = rendered_messages(transcript)
        for index, message in enumerate(messages):
            if message["role"] != "assistant" or "reasoning" not in message:
                continue
            prompt = tokenizer.apply_chat_template(messages[:index], tools=transcript.tools, tokenize=False, add_generation_prompt=True)
            assert prompt.endswith("<assistant><think>")
            assert full.startswith(prompt)
            off = tokenizer.apply_chat_template(
                messages[:index], tools=transcript.tools, tokenize=False, add_generation_prompt=True, enable_thinking=False
            )
            assert off == prompt[: -len("<think>")] + "</think>"


# -- statistics against hand-computed values ---------------------------------------------------------
def test_tail_stats_hand_computed() -> None:
    assert tail_stats(torch.tensor([1.0, -1.0, 1.0, -1.0])) == {"kurtosis": 1.0, "max_over_rms": 1.0}
    # x = [0, 0, 0, 2]: mean 0.5, centred [-.5,-.5,-.5,1.5], m2 = 0.75, m4 = (3*.0625 + 5.0625)/4 = 1.3125
    stats = tail_stats(torch.tensor([0.0, 0.0, 0.0, 2.0]))
    assert stats["kurtosis"] == pytest.approx(1.3125 / 0.75**2)
    assert stats["max_over_rms"] == pytest.approx(2.0 / 1.0)  # rms = sqrt(4/4)
    gaussian = torch.randn(200_000, generator=torch.Generator().manual_seed(0))
    assert tail_stats(gaussian)["kurtosis"] == pytest.approx(3.0, abs=0.05)


# -- determinism and the cache key ---------------------------------------------------------------------
SMALL_SPEC = CorpusSpec(train_transcripts=24, heldout_transcripts=6, train_structured=8, heldout_structured=2)
# Two threads and a sampled prompt side, as the default recipe: the bytes must still repeat.
SMALL_CONFIG = TrainingConfig(steps=3, batch_size=2, seq_len=96, warmup_steps=1, threads=2, eval_windows=2, context_sample=0.25)


@pytest.fixture(scope="module")
def small_corpus(tokenizer) -> Corpus:  # type: ignore[no-untyped-def]
    return build_corpus(SMALL_SPEC, 3, tokenizer)


def _weights(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.glob("*.safetensors"))}


def test_a_few_training_steps_are_byte_identical(small_corpus: Corpus, tmp_path: Path) -> None:
    first = train_laguna(tmp_path / "a", small_corpus.train, small_corpus.heldout, seed=1, config=SMALL_CONFIG)
    second = train_laguna(tmp_path / "b", small_corpus.train, small_corpus.heldout, seed=1, config=SMALL_CONFIG)
    other = train_laguna(tmp_path / "c", small_corpus.train, small_corpus.heldout, seed=2, config=SMALL_CONFIG)
    assert _weights(first.path) and _weights(first.path) == _weights(second.path)
    assert _weights(first.path) != _weights(other.path)
    for name in ("config.json", "tokenizer.json", "chat_template.jinja"):
        assert (first.path / name).read_bytes() == (second.path / name).read_bytes()
    report = json.loads((first.path / REPORT_FILE).read_text())
    second_report = json.loads((second.path / REPORT_FILE).read_text())
    report.pop("timing"), second_report.pop("timing")
    assert report == second_report
    # Load balancing moved the router bias off zero; the saved checkpoint carries it.
    assert report["router_bias_abs_mean"] > 0
    assert math.isfinite(report["heldout_perplexity"]) and report["loss_first"] > 0
    assert set(report["weights"]) == {"attention", "dense_mlp", "embeddings", "lm_head", "router", "routed_experts", "shared_expert"}
    from safetensors.torch import load_file

    biases = {k: v for p in first.path.glob("*.safetensors") for k, v in load_file(p).items() if k.endswith("e_score_correction_bias")}
    assert len(biases) == 3 and all(float(b.float().abs().sum()) > 0 for b in biases.values())
    assert torch.are_deterministic_algorithms_enabled() is False  # the caller's setting is restored
    _assert_ships_its_own_text(first.path, small_corpus)


def test_zero_steps_write_the_untrained_init_of_the_same_seed(small_corpus: Corpus, tmp_path: Path) -> None:
    """--steps 0, the control arm: the init the build of that seed starts from, in bf16 as shipped,
    with the build's tokenizer and text files; a model with a few steps differs from it."""
    from dataclasses import replace

    from transformers import AutoConfig, LagunaForCausalLM

    from fp4forge.lab.trained.tables import training_summary_rich
    from fp4forge.testbed.tiny import init_model

    control = train_laguna(tmp_path / "init", small_corpus.train, small_corpus.heldout, seed=1, config=replace(SMALL_CONFIG, steps=0))
    trained = train_laguna(tmp_path / "trained", small_corpus.train, small_corpus.heldout, seed=1, config=SMALL_CONFIG)
    # transformers' own loader reads the shards back (per-expert names on disk, fused in memory)
    stored = LagunaForCausalLM.from_pretrained(control.path, dtype=torch.bfloat16).state_dict()
    init = init_model(LagunaForCausalLM, AutoConfig.from_pretrained(control.path), 1).to(torch.bfloat16).state_dict()
    assert stored.keys() == init.keys() and all(torch.equal(stored[k], init[k]) for k in init)
    assert _weights(control.path) != _weights(trained.path)
    for name in ("config.json", "tokenizer.json", "chat_template.jinja"):
        assert (control.path / name).read_bytes() == (trained.path / name).read_bytes()
    report = control.report
    assert report["loss_first"] is None and report["loss_last_10_mean"] is None and report["train_tokens_seen"] == 0
    assert report["router_bias_abs_mean"] == 0.0
    # the held-out perplexity as shipped (bf16) is the init's (fp32) up to the cast
    assert report["heldout_perplexity"] == pytest.approx(report["untrained_heldout_perplexity"], rel=0.02)
    _assert_ships_its_own_text(control.path, small_corpus)
    assert training_summary_rich(report).row_count >= 5  # renders without a loss to show


def _assert_ships_its_own_text(directory: Path, corpus: Corpus) -> None:
    """The text files beside the weights are what calibration and fidelity read with
    ``--calib-text`` / ``--fidelity-text``: held-out documents only for fidelity, training documents
    only for calibration, and the tokens those loaders make equal the tokens training saw."""
    from fp4forge.model.samples import file_documents, load_samples
    from fp4forge.lab.trained.training import CALIBRATION_TEXT_FILE, HELDOUT_TEXT_FILE

    heldout = [d.text for d in file_documents([directory / HELDOUT_TEXT_FILE])]
    calibration = [d.text for d in file_documents([directory / CALIBRATION_TEXT_FILE])]
    assert heldout == list(corpus.heldout)
    assert calibration and set(calibration) <= set(corpus.train) and not set(calibration) & set(corpus.heldout)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    samples = load_samples(tokenizer, samples=1, seq_len=64, text_files=[directory / HELDOUT_TEXT_FILE], split="heldout", builtin=False)
    expected = [t for doc in corpus.heldout for t in tokenizer(doc, add_special_tokens=False).input_ids][:64]
    assert samples.input_ids[0].tolist() == expected and expected[0] == tokenizer.bos_token_id


def test_cache_key_tracks_every_input(small_corpus: Corpus, tokenizer) -> None:  # type: ignore[no-untyped-def]
    tokenizer_json = tokenizer.backend_tokenizer.to_str()
    key = trained_laguna_cache_key(0, SMALL_CONFIG, SMALL_SPEC, small_corpus, tokenizer_json)
    assert key == trained_laguna_cache_key(0, SMALL_CONFIG, SMALL_SPEC, small_corpus, tokenizer_json)
    changed_corpus = Corpus(small_corpus.train[:-1], small_corpus.heldout, small_corpus.families)
    variants = {
        trained_laguna_cache_key(1, SMALL_CONFIG, SMALL_SPEC, small_corpus, tokenizer_json),
        trained_laguna_cache_key(0, TrainingConfig(steps=4, batch_size=2, seq_len=96, warmup_steps=1, threads=1, eval_windows=2), SMALL_SPEC, small_corpus, tokenizer_json),
        trained_laguna_cache_key(0, SMALL_CONFIG, SMALL_SPEC, changed_corpus, tokenizer_json),
        trained_laguna_cache_key(0, SMALL_CONFIG, SMALL_SPEC, small_corpus, tokenizer_json + " "),
    }
    assert key not in variants and len(variants) == 4
    assert corpus_digest(small_corpus) == corpus_digest(build_corpus(SMALL_SPEC, 3, tokenizer))  # the corpus is a function of the seed


# -- the command --------------------------------------------------------------------------------------
def test_cli_refuses_bad_settings_before_writing(tmp_path: Path) -> None:
    import subprocess
    import sys

    out = tmp_path / "model"
    result = subprocess.run(
        [sys.executable, "-m", "fp4forge.cli", "testbed", "trained-laguna", str(out), "--steps", "-1"],
        capture_output=True, text=True, check=False,
    )
    assert result.returncode == 2
    assert "training steps must be at least 0" in result.stderr and "Traceback" not in result.stderr
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_cache_builds_once_then_reuses(small_corpus: Corpus, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from fp4forge.lab.trained import build as trained_testbed

    monkeypatch.setenv("FP4FORGE_CACHE_DIR", str(tmp_path / "cache"))
    built = trained_testbed.cached_trained_laguna(seed=0, config=SMALL_CONFIG, spec=SMALL_SPEC)
    assert built.parent.parent == tmp_path / "cache" / "trained-laguna"
    report = json.loads((built / REPORT_FILE).read_text())
    assert built.parent.name == report["cache_key"]

    def no_training(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("trained again although the cache holds this key")

    monkeypatch.setattr(trained_testbed, "train_laguna", no_training)
    assert trained_testbed.cached_trained_laguna(seed=0, config=SMALL_CONFIG, spec=SMALL_SPEC) == built
    copy = trained_testbed.copy_cached_trained_laguna(tmp_path / "copy", seed=0, config=SMALL_CONFIG, spec=SMALL_SPEC)
    copied = {p.name: p.read_bytes() for p in copy.path.iterdir()}
    assert b"license: apache-2.0" in copied.pop("README.md")  # the copy's own card, for an export's card to carry over
    assert copied == {p.name: p.read_bytes() for p in built.iterdir()}


def test_loss_weights_cover_the_assistant_turns_only() -> None:
    from fp4forge.lab.trained.training import token_weights

    # ids: 1 = <assistant>, 2 = </assistant>; a chat document and a plain one (hand-computed).
    chat, plain = [0, 5, 1, 7, 8, 2, 6, 1, 9, 2], [4, 4, 4]
    weights = token_weights([chat, plain], open_id=1, close_id=2, context_weight=0.1)
    assert weights[0] == [0.1, 0.1, 0.1, 1.0, 1.0, 1.0, 0.1, 0.1, 1.0, 1.0]
    assert weights[1] == [1.0, 1.0, 1.0]
    assert token_weights([plain], 1, 2, 0.0, plain_weight=0.0) == [[0.0, 0.0, 0.0]]


def test_every_family_including_the_one_call_family_plays_to_full_marks() -> None:
    generated = generate_scenarios(len(FAMILIES) * 4, seed=11)
    families = {g.scenario.category for g in generated}
    assert {"one_call", "restraint", "missing_tool", "session"} <= families
    for g in generated:
        transcript = play(g)  # raises if the scripted agent does not earn every point
        assert transcript.earned == transcript.max_points
        assert transcript.messages[-1]["role"] != "tool"


@pytest.mark.parametrize("args, message", [
    (["--device", "cuda", "--cache"], "--cache holds CPU builds only"),
    (["--device", "tpu"], "unknown device 'tpu'"),
])
def test_cli_refuses_a_device_it_cannot_build_on_before_writing(tmp_path: Path, args: list[str], message: str) -> None:
    import subprocess
    import sys

    out = tmp_path / "model"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # the same answer on a GPU host: no device is visible
    result = subprocess.run(
        [sys.executable, "-m", "fp4forge.cli", "testbed", "trained-laguna", str(out), *args],
        capture_output=True, text=True, check=False, env=env,
    )
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_sampled_loss_is_the_weighted_loss_where_it_keeps_every_position_and_unbiased_otherwise() -> None:
    from fp4forge.lab.trained.training import sampled_loss, weighted_loss

    torch.manual_seed(0)
    vocab, hidden = 11, 8

    class Tiny(torch.nn.Module):  # a model with LagunaForCausalLM's two halves: .model and .lm_head
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(vocab, hidden)
            self.lm_head = torch.nn.Linear(hidden, vocab, bias=False)
            outer = self

            class Body(torch.nn.Module):
                def forward(self, input_ids: torch.Tensor, use_cache: bool = False) -> Any:
                    return type("Out", (), {"last_hidden_state": outer.embed(input_ids)})()

            self.model = Body()

        def forward(self, input_ids: torch.Tensor, use_cache: bool = False) -> Any:
            return type("Out", (), {"logits": self.lm_head(self.model(input_ids).last_hidden_state)})()

    model = Tiny()
    batch = torch.randint(0, vocab, (2, 13))
    weights = torch.full((2, 13), 0.1)
    weights[:, 5:9] = 1.0  # an assistant turn
    full = weighted_loss(model(batch[:, :-1]).logits, batch[:, 1:], weights[:, 1:]).detach()
    exact = sampled_loss(model, batch, weights, 0.1, 1.0, torch.Generator().manual_seed(0))
    assert torch.allclose(exact, full)
    # Sampling a quarter of the prompt side: every draw differs, their mean is the full loss.
    with torch.no_grad():
        draws = torch.stack([sampled_loss(model, batch, weights, 0.1, 0.25, torch.Generator().manual_seed(k)) for k in range(400)])
    assert draws.std() > 0
    assert abs(float(draws.mean() - full)) < 4 * float(draws.std()) / math.sqrt(len(draws))
    with pytest.raises(Exception, match="context_sample"):
        TrainingConfig(context_sample=0.0)


def test_pseudo_word_entities_vary_and_play_to_full_marks(generated_entities) -> None:  # type: ignore[no-untyped-def]
    """entities="generated": values are fresh per scenario (so only copying predicts them), and the
    scripted agent still earns full marks with them."""
    cities = {g.raw["messages"][0]["content"] for g in generated_entities if g.scenario.category == "weather"}
    assert len(cities) == sum(1 for g in generated_entities if g.scenario.category == "weather")
    assert all(play(g).earned == play(g).max_points for g in generated_entities[: len(FAMILIES) * 2])


def test_corpus_spec_refuses_unknown_settings() -> None:
    from fp4forge.errors import ConfigError

    for bad in ({"entities": "random"}, {"tokenizer": "gpt2"}, {"session_turns": (5, 2)}, {"session_turns": (0, 3)}):
        with pytest.raises(ConfigError):
            CorpusSpec(**bad)


def test_corpus_fitted_tokenizer_keeps_the_control_tokens_and_is_deterministic(small_corpus: Corpus, tokenizer) -> None:  # type: ignore[no-untyped-def]
    from fp4forge.testbed.tokenizer import CONTROL_TOKENS

    fitted = build_tokenizer(fit_texts=small_corpus.train)
    assert fitted.backend_tokenizer.to_str() == build_tokenizer(fit_texts=small_corpus.train).backend_tokenizer.to_str()
    assert fitted.convert_tokens_to_ids(list(CONTROL_TOKENS)) == tokenizer.convert_tokens_to_ids(list(CONTROL_TOKENS))
    assert fitted.chat_template == tokenizer.chat_template
    text = small_corpus.train[0]
    assert fitted.decode(fitted(text, add_special_tokens=False).input_ids) == text
    # Fitted to the corpus, it writes the corpus in fewer tokens than the stdlib BPE.
    assert sum(len(fitted(d, add_special_tokens=False).input_ids) for d in small_corpus.train) < \
        sum(len(tokenizer(d, add_special_tokens=False).input_ids) for d in small_corpus.train)
