"""Layer-streamed calibration: materialised layers equal from_pretrained's, streamed statistics
equal whole-model hooks to the last bit, observers keep running maxima, data is deterministic,
and `quantize --stats` takes its activation scales from calibration."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from fp4forge.calibrate import CalibrationOptions, calibrate_checkpoint, calibrate_in_memory, calibration_samples
from fp4forge.model.samples import builtin_documents, file_documents, load_samples, load_tokenizer
from fp4forge.model.hooks import NoTap, experts_forward
from fp4forge.model.streaming import StreamedModel, call_layer
from fp4forge.checkpoint.reader import open_checkpoint
from fp4forge.errors import ConfigError
from tests.calibration_fixtures import BUILDERS, laguna, one_thread, tiny  # noqa: F401 (shared fixtures)
SMALL = CalibrationOptions(samples=6, seq_len=96, batch_size=4)  # 96 > Laguna's sliding window 64


@pytest.fixture(scope="module")
def qwen(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny(tmp_path_factory, "qwen3_moe")


# -- streaming -------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["laguna", "qwen3_moe"])
@torch.inference_mode()
def test_materialised_layers_and_logits_equal_from_pretrained(kind: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    path = tiny(tmp_path_factory, kind)
    streamed = StreamedModel.from_checkpoint(open_checkpoint(path))
    assert streamed.plan.unexpected == []
    reference = AutoModelForCausalLM.from_pretrained(path).eval()
    reference_state = reference.state_dict()
    ids = torch.randint(0, 4000, (2, 100), generator=torch.Generator().manual_seed(1))
    with streamed.embedding():
        hidden, calls = streamed.prologue(ids)
    for index in range(streamed.num_layers):
        with streamed.layer(index) as layer:
            for name, tensor in layer.state_dict().items():
                expected = reference_state[f"{streamed.layer_prefix(index)}.{name}"]
                assert tensor.dtype == expected.dtype and torch.equal(tensor, expected), name
            hidden = call_layer(layer, hidden, calls[index])
        assert all(p.is_meta for p in streamed.layers[index].parameters()), "a finished layer must be freed"
    with streamed.final_norm() as norm, streamed.lm_head() as head:
        logits = head(norm(hidden))
    assert torch.equal(logits, reference(ids).logits)


@pytest.mark.parametrize(
    ("kind", "policy", "ram_budget"),
    [("laguna", "routed", 200_000), ("qwen3_moe", "routed", 2**30), ("laguna", "all-experts", 2**30)],
)
def test_streamed_statistics_equal_whole_model_hooks_bit_for_bit(kind: str, policy: str, ram_budget: int, tmp_path_factory: pytest.TempPathFactory) -> None:
    path = tiny(tmp_path_factory, kind)
    ckpt = open_checkpoint(path)
    options = CalibrationOptions(samples=6, seq_len=96, batch_size=4, policy=policy, ram_budget_bytes=ram_budget)
    samples = calibration_samples(ckpt, options)
    streamed = calibrate_checkpoint(ckpt, options, samples=samples)
    whole = calibrate_in_memory(ckpt, options, samples=samples)
    assert streamed.tensors.keys() == whole.tensors.keys()
    assert [n for n in streamed.tensors if not torch.equal(streamed.tensors[n], whole.tensors[n])] == []
    for key in ("tokens_per_expert", "experts_without_tokens", "moe_policy"):
        assert streamed.metadata[key] == whole.metadata[key]
    if ram_budget < 2**20:
        assert streamed.spilled_batches > 0, "the small budget must exercise the disk spill"
    layers = ckpt.config["num_hidden_layers"]
    for layer in range(layers):
        k = streamed.tensors[f"model.layers.{layer}.self_attn.k_amax"]
        per_head = streamed.tensors[f"model.layers.{layer}.self_attn.k_amax_per_head"]
        assert per_head.shape == (ckpt.config["num_key_value_heads"],) and torch.equal(per_head.max().reshape(1), k)
    assert "lm_head.input_amax" in streamed.tensors


@torch.inference_mode()
def test_expert_loop_equals_transformers_eager_experts(laguna: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(laguna, experts_implementation="eager").eval()
    experts = model.model.layers[1].mlp.experts
    hidden = torch.randn(50, model.config.hidden_size, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    top_k = torch.stack([torch.randperm(16, generator=torch.Generator().manual_seed(i))[:4] for i in range(50)])
    weights = torch.rand(50, 4, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    assert torch.equal(experts_forward(experts, hidden, top_k, weights, NoTap()), experts(hidden, top_k, weights))
    # routes to no local expert (index num_experts) are skipped by both; a token may keep none
    top_k[::3, 0] = 16
    top_k[7] = 16
    assert torch.equal(experts_forward(experts, hidden, top_k, weights, NoTap()), experts(hidden, top_k, weights))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@torch.inference_mode()
def test_expert_loop_equals_transformers_eager_experts_on_cuda(laguna: Path) -> None:
    """On a GPU too (the eager loop's index_add_ is an atomic add there; the sums must still agree)."""
    model = AutoModelForCausalLM.from_pretrained(laguna, experts_implementation="eager").eval().to("cuda")
    experts = model.model.layers[1].mlp.experts
    generator = torch.Generator().manual_seed(5)
    hidden = torch.randn(300, model.config.hidden_size, generator=generator).to(torch.bfloat16).cuda()
    top_k = torch.stack([torch.randperm(16, generator=generator)[:4] for _ in range(300)]).cuda()
    weights = torch.rand(300, 4, generator=generator).to(torch.bfloat16).cuda()
    assert torch.equal(experts_forward(experts, hidden, top_k, weights, NoTap()), experts(hidden, top_k, weights))


def test_running_max_not_last_batch_and_unseen_experts(laguna: Path) -> None:
    ckpt = open_checkpoint(laguna)
    samples = calibration_samples(ckpt, SMALL)
    whole = calibrate_checkpoint(ckpt, SMALL, samples=samples)
    last = calibrate_checkpoint(ckpt, SMALL, samples=replace(samples, input_ids=samples.input_ids[4:], document_ids=samples.document_ids[4:]))
    first = calibrate_checkpoint(ckpt, SMALL, samples=replace(samples, input_ids=samples.input_ids[:4], document_ids=samples.document_ids[:4]))
    filled = tuple(f"{e}." for e in first.metadata["experts_without_tokens"] + last.metadata["experts_without_tokens"])
    for name, value in whole.tensors.items():
        if not name.startswith(filled):  # a half without tokens for an expert filled it from peers
            assert torch.equal(value, torch.maximum(first.tensors[name], last.tensors[name])), name
    # The tiny Laguna's biased router leaves some experts without tokens: peers' max, listed.
    unseen = whole.metadata["experts_without_tokens"]
    assert unseen
    expert = unseen[0]
    layer_experts = expert.rsplit(".", 1)[0]
    counts = whole.metadata["tokens_per_expert"][layer_experts]
    assert counts[int(expert.rsplit(".", 1)[1])] == 0
    peers = [whole.tensors[f"{layer_experts}.{e}.down_proj.input_amax"] for e, c in enumerate(counts) if c > 0]
    assert torch.equal(whole.tensors[f"{expert}.down_proj.input_amax"], torch.stack(peers).max().reshape(1))


# -- data -------------------------------------------------------------------------------------------
def test_samples_are_deterministic_packed_and_split(laguna: Path, tmp_path: Path) -> None:
    tokenizer = load_tokenizer(laguna)
    a = load_samples(tokenizer, samples=3, seq_len=64)
    b = load_samples(tokenizer, samples=3, seq_len=64)
    assert a.input_ids.shape == (3, 64) and torch.equal(a.input_ids, b.input_ids) and a.digest == b.digest
    heldout = load_samples(tokenizer, samples=3, seq_len=64, split="heldout")
    assert not torch.equal(heldout.input_ids, a.input_ids)
    calibration_names = {d.origin for _, d in zip(range(200), builtin_documents("calibration"))}
    heldout_names = {d.origin for _, d in zip(range(200), builtin_documents("heldout"))}
    assert calibration_names.isdisjoint(heldout_names)
    assert tokenizer.decode(a.input_ids[0]).startswith(tokenizer.bos_token + "<user>")

    jsonl = tmp_path / "extra.jsonl"
    jsonl.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello " * 40}]}) + "\n" + json.dumps({"text": "raw " * 50}) + "\n")
    docs = file_documents([jsonl])
    assert docs[0].messages and docs[1].text
    only_files = load_samples(tokenizer, samples=1, seq_len=32, text_files=[jsonl], builtin=False)
    assert only_files.sources == ("extra.jsonl",)
    # The built-in corpus is named as a source only when the files ran out and it filled the rest.
    enough = load_samples(tokenizer, samples=1, seq_len=32, text_files=[jsonl])
    assert enough.sources == ("extra.jsonl",) and enough.documents_used == 1
    topped_up = load_samples(tokenizer, samples=4, seq_len=64, text_files=[jsonl])
    assert topped_up.sources == ("extra.jsonl", "builtin:calibration") and topped_up.documents_used > 2
    with pytest.raises(ConfigError, match="tokens but"):
        load_samples(tokenizer, samples=50, seq_len=512, text_files=[jsonl], builtin=False)
    jsonl.write_text('{"neither": 1}\n')
    with pytest.raises(ConfigError, match="line 1"):
        file_documents([jsonl])


# -- quantize --stats ------------------------------------------------------------------------------
def test_quantize_takes_input_and_kv_scales_from_calibration(laguna: Path, tmp_path: Path) -> None:
    from fp4forge.audit.engine import audit_checkpoint
    from fp4forge.numerics.nvfp4 import nvfp4_global_scale
    from fp4forge.checkpoint.stats import write_stats
    from fp4forge.quantize.act_scales import StatsAmax
    from fp4forge.quantize.export import QuantizeOptions, quantize_checkpoint
    from fp4forge.quantize.recipe import load_recipe

    result = calibrate_checkpoint(laguna, SMALL)
    stats_path = write_stats(tmp_path / "stats.safetensors", result.tensors, result.metadata)
    with safe_open(str(stats_path), framework="pt") as fh:
        meta = fh.metadata()
    assert meta["fp4forge_stats"] == "1" and json.loads(meta["calibration"])["moe_policy"] == "routed"
    out = tmp_path / "w4a4"
    quantize_checkpoint(laguna, out, QuantizeOptions(recipe=load_recipe("nvfp4-experts-fp8-attn"), act_amax=StatsAmax(stats_path)))
    ckpt = open_checkpoint(out)
    stats = result.tensors
    for expert in (0, 5, 15):
        module = f"model.layers.2.mlp.experts.{expert}.down_proj"
        assert torch.equal(ckpt.read_tensor(f"{module}.input_global_scale"), nvfp4_global_scale(stats[f"{module}.input_amax"]))
        gate_up = torch.maximum(stats[f"model.layers.2.mlp.experts.{expert}.gate_proj.input_amax"], stats[f"model.layers.2.mlp.experts.{expert}.up_proj.input_amax"])
        assert torch.equal(ckpt.read_tensor(f"model.layers.2.mlp.experts.{expert}.gate_proj.input_global_scale"), nvfp4_global_scale(gate_up))
    q_amax = stats["model.layers.1.self_attn.q_proj.input_amax"]
    assert torch.equal(ckpt.read_tensor("model.layers.1.self_attn.q_proj.input_scale"), (q_amax / 448).to(torch.bfloat16))
    assert torch.equal(ckpt.read_tensor("model.layers.1.self_attn.k_scale"), (stats["model.layers.1.self_attn.k_amax"] / 448).to(torch.bfloat16))
    report = audit_checkpoint(out)
    rules = {f.rule for f in report.findings}
    assert "kv-scale-uncalibrated" not in rules
    assert [f.rule for f in report.findings if f.severity == "error"] == []


def test_calibrate_command_writes_statistics(qwen: Path, tmp_path: Path) -> None:
    import typer
    from typer.testing import CliRunner

    from fp4forge.cli.calibrate import register
    from fp4forge.quantize.act_scales import StatsAmax

    app = typer.Typer()
    app.callback()(lambda: None)
    register(app)
    out = tmp_path / "stats.safetensors"
    result = CliRunner().invoke(app, ["calibrate", str(qwen), "--out", str(out), "--samples", "2", "--seq-len", "64", "--policy", "all-experts", "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["tokens"] == 128 and summary["moe_policy"] == "all-experts" and summary["experts_without_tokens"] == []
    # no text given: the built-in corpus filled in, and the summary and stderr say it is not the model's own
    assert len(summary["warnings"]) == 1 and "not this model's own text" in summary["warnings"][0]
    assert "warning:" in result.stderr and "not this model's own text" in result.stderr
    stats = StatsAmax(out)
    assert stats.input_amax("model.layers.3.mlp.experts.15.down_proj") > 0 and min(stats.kv_amax("model.layers.0")) > 0
    bad = CliRunner().invoke(app, ["calibrate", str(qwen), "--out", str(out), "--policy", "some"])
    assert bad.exit_code != 0 and isinstance(bad.exception, ConfigError)
