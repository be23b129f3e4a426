"""GPTQ for MoE, layer-streamed: the streamed Hessians equal the whole model's (from_pretrained +
hooks), per expert from its routed tokens; the fallback and the all-experts policy; the exporter
writes exactly GPTQ's tensors and says so in its provenance."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from fp4forge.quantize.gptq import GptqOptions, gptq_weights
from fp4forge.calibrate.run import CalibrationOptions, calibration_samples
from fp4forge.checkpoint.names import PROVENANCE_JSON
from fp4forge.checkpoint.reader import open_checkpoint
from fp4forge.errors import ConfigError
from fp4forge.numerics.gptq import HessianAccumulator, gptq_quantize
from fp4forge.numerics.nvfp4 import nvfp4_quantize
from fp4forge.quantize.recipe import load_recipe
from tests.calibration_fixtures import one_thread, tiny  # noqa: F401 (shared fixtures)

CAL = CalibrationOptions(samples=4, seq_len=32)  # the CLI's batch size (4): the same Hessian sums
LAYER = 1  # a MoE layer of the tiny Laguna (layer 0 is dense)


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny(tmp_path_factory, "laguna")  # the session's tiny Laguna, shared with the calibration tests


@pytest.fixture(scope="module")
def routed(moe: Path):
    laguna = moe
    ckpt = open_checkpoint(laguna)
    samples = calibration_samples(ckpt, CAL)
    return samples, gptq_weights(ckpt, load_recipe("nvfp4-all-linear"), GptqOptions(calibration=CAL, min_expert_tokens=1), samples=samples)


def _reference_hessians(model_dir: Path, samples) -> tuple[dict[str, HessianAccumulator], dict[int, HessianAccumulator], dict[int, HessianAccumulator]]:
    """The whole model from from_pretrained, the same batches: q_proj's input, and each expert's
    gate/up input (its routed tokens) and down input (act(gate) * up of those tokens)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, experts_implementation="eager").eval()
    layer = model.model.layers[LAYER]
    q_acc = HessianAccumulator(model.config.hidden_size)
    gate_up: dict[int, HessianAccumulator] = {}
    down: dict[int, HessianAccumulator] = {}
    experts = layer.mlp.experts

    def on_experts(_module, args, kwargs):
        hidden, top_k = (args + (None, None))[:2] if len(args) >= 2 else (args[0], kwargs["top_k_index"])
        for expert in range(experts.num_experts):
            # the eager loop's row order (by top-k slot, then token): the same sums in the same order
            _slot, tokens = torch.where((top_k == expert).T)
            if tokens.numel() == 0:
                continue
            x = hidden[tokens]
            h = F.linear(x, experts.gate_up_proj[expert])
            gate, up = h.chunk(2, dim=-1)
            gate_up.setdefault(expert, HessianAccumulator(x.shape[-1])).add(x)
            down.setdefault(expert, HessianAccumulator(up.shape[-1])).add(experts.act_fn(gate) * up)

    hooks = [
        layer.self_attn.q_proj.register_forward_pre_hook(lambda _m, a: q_acc.add(a[0])),
        experts.register_forward_pre_hook(on_experts, with_kwargs=True),
    ]
    with torch.inference_mode():
        for ids in samples.batches(CAL.batch_size):
            model(input_ids=ids, use_cache=False)
    for h in hooks:
        h.remove()
    return {"q_proj": q_acc}, gate_up, down


def _same(a, b) -> None:
    assert torch.equal(a.packed, b.packed)
    assert torch.equal(a.block_scale.view(torch.uint8), b.block_scale.view(torch.uint8))
    assert torch.equal(a.global_scale, b.global_scale)


def test_streamed_gptq_equals_whole_model_hessians(moe: Path, routed) -> None:
    laguna = moe
    samples, result = routed
    linear, gate_up, down = _reference_hessians(laguna, samples)
    ckpt = open_checkpoint(laguna)
    prefix = f"model.layers.{LAYER}"

    def gptq(module: str, hessian: torch.Tensor, amax=None):
        return gptq_quantize(ckpt.read_tensor(f"{module}.weight"), hessian, "nvfp4", global_amax=amax).quantized

    def group_amax(*modules: str) -> torch.Tensor:
        ws = [ckpt.read_tensor(f"{m}.weight") for m in modules]
        return torch.tensor(max(float(w.abs().max()) for w in ws), dtype=ws[0].dtype)

    qkv = [f"{prefix}.self_attn.{p}_proj" for p in "qkv"]
    _same(result.weights[qkv[0]], gptq(qkv[0], linear["q_proj"].hessian(), group_amax(*qkv)))
    assert result.modules[qkv[0]]["tokens"] == CAL.samples * CAL.seq_len
    checked = 0
    for expert, acc in gate_up.items():
        e = f"{prefix}.mlp.experts.{expert}"
        amax = group_amax(f"{e}.gate_proj", f"{e}.up_proj")
        _same(result.weights[f"{e}.gate_proj"], gptq(f"{e}.gate_proj", acc.hessian(), amax))
        _same(result.weights[f"{e}.down_proj"], gptq(f"{e}.down_proj", down[expert].hessian()))
        assert result.modules[f"{e}.up_proj"]["tokens"] == acc.count
        assert result.modules[f"{e}.up_proj"]["hessian"] == "own"
        checked += 1
    assert checked >= 4
    # experts the router never chose in this layer take the pooled Hessian (min_expert_tokens=1)
    unseen = [e for e in range(16) if e not in gate_up]
    for expert in unseen:
        assert result.modules[f"{prefix}.mlp.experts.{expert}.down_proj"]["hessian"] == "pooled"
    prov = result.provenance()
    assert prov["method"] == "gptq" and prov["settings"]["expert_hessian"] == "routed" and prov["settings"]["sequential"] is False


def test_fallback_rtn_below_min_tokens_and_all_experts_policy(moe: Path) -> None:
    laguna = moe
    ckpt = open_checkpoint(laguna)
    samples = calibration_samples(ckpt, CAL)
    recipe = load_recipe("nvfp4-experts")
    rtn = gptq_weights(ckpt, recipe, GptqOptions(calibration=CAL, min_expert_tokens=10**9, fallback="rtn"), samples=samples)
    e = "model.layers.2.mlp.experts.3"
    amax = torch.maximum(ckpt.read_tensor(f"{e}.gate_proj.weight").abs().max(), ckpt.read_tensor(f"{e}.up_proj.weight").abs().max())
    _same(rtn.weights[f"{e}.gate_proj"], nvfp4_quantize(ckpt.read_tensor(f"{e}.gate_proj.weight"), global_amax=amax))
    assert {m["hessian"] for m in rtn.modules.values()} == {"none"}
    every = gptq_weights(ckpt, recipe, GptqOptions(calibration=CAL, expert_hessian="all"), samples=samples)
    assert {m["hessian"] for m in every.modules.values()} == {"all"}
    assert {m["tokens"] for m in every.modules.values()} == {CAL.samples * CAL.seq_len}


def test_bad_gptq_options_are_named_errors() -> None:
    with pytest.raises(ConfigError) as err:
        GptqOptions(expert_hessian="some")
    assert err.value.option == "expert_hessian"
    with pytest.raises(ConfigError):
        GptqOptions(fallback="zero")
    with pytest.raises(ConfigError):
        GptqOptions(damp=0)


def test_quantize_command_writes_gptq_tensors_and_provenance(moe: Path, routed, tmp_path: Path) -> None:
    laguna = moe
    from typer.testing import CliRunner

    from fp4forge.cli import app

    samples, result = routed
    out = tmp_path / "gptq"
    cmd = ["quantize", str(laguna), str(out), "--recipe", "nvfp4-all-linear", "--method", "gptq", "--calib-samples", "4",
           "--calib-seq-len", "32", "--gptq-min-tokens", "1", "--act-scales", "constant:8", "--json"]
    run = CliRunner().invoke(app, cmd)
    assert run.exit_code == 0, run.output
    assert json.loads(run.stdout)["gptq"]["method"] == "gptq"
    written = open_checkpoint(out)
    for module in ("model.layers.1.self_attn.k_proj", "model.layers.2.mlp.experts.7.down_proj"):
        q = result.weights[module]  # the routed fixture ran on the same samples and batches
        assert torch.equal(written.read_tensor(f"{module}.weight_packed"), q.packed)
        assert torch.equal(written.read_tensor(f"{module}.weight_global_scale"), q.global_scale)
    provenance = json.loads((out / PROVENANCE_JSON).read_text())
    assert provenance["method"]["method"] == "gptq"
    assert provenance["method"]["settings"]["min_expert_tokens"] == 1


def test_sequential_gptq_sees_the_rounded_earlier_layers(moe: Path, routed) -> None:
    """sequential=True: the last layer's Hessians equal the whole model's with every earlier layer's
    Linears and experts replaced by their GPTQ weights (dequantized); layer 0 itself is rounded
    exactly as without it."""
    samples, plain = routed
    ckpt = open_checkpoint(moe)
    result = gptq_weights(ckpt, load_recipe("nvfp4-all-linear"), GptqOptions(calibration=CAL, min_expert_tokens=1, sequential=True), samples=samples)
    assert result.provenance()["settings"]["sequential"] is True
    model = AutoModelForCausalLM.from_pretrained(moe, experts_implementation="eager").eval()
    last = model.config.num_hidden_layers - 1
    assert last >= 2  # at least one MoE layer (layer 0 is dense) is replaced

    def rounded(name: str) -> torch.Tensor:
        return result.weights[name].dequantize(torch.float32)

    linears = experts = 0
    with torch.no_grad():
        for index in range(last):
            for name, module in model.model.layers[index].named_modules():
                full = f"model.layers.{index}.{name}".replace(".shared_experts.", ".shared_expert.")  # Laguna's on-disk name
                if isinstance(module, torch.nn.Linear) and full in result.weights:
                    if index == 0:
                        _same(result.weights[full], plain.weights[full])  # nothing before layer 0 was rounded
                    module.weight.copy_(rounded(full).to(module.weight.dtype))
                    linears += 1
                elif hasattr(module, "gate_up_proj"):  # fused experts: gate rows, then up rows (the test's chunk above)
                    for e in range(module.num_experts):
                        base = f"{full}.{e}"
                        module.gate_up_proj[e].copy_(torch.cat([rounded(f"{base}.gate_proj"), rounded(f"{base}.up_proj")]).to(module.gate_up_proj.dtype))
                        module.down_proj[e].copy_(rounded(f"{base}.down_proj").to(module.down_proj.dtype))
                        experts += 1
    assert linears >= 4 * last and experts >= 16  # at least q/k/v/o of each layer
    acc = HessianAccumulator(model.config.hidden_size)
    hook = model.model.layers[last].self_attn.q_proj.register_forward_pre_hook(lambda _m, a: acc.add(a[0]))
    with torch.inference_mode():
        for ids in samples.batches(CAL.batch_size):
            model(input_ids=ids, use_cache=False)
    hook.remove()
    prefix = f"model.layers.{last}.self_attn"
    ws = [ckpt.read_tensor(f"{prefix}.{p}_proj.weight") for p in "qkv"]
    amax = torch.tensor(max(float(w.abs().max()) for w in ws), dtype=ws[0].dtype)
    expected = gptq_quantize(ws[0], acc.hessian(), "nvfp4", global_amax=amax).quantized
    _same(result.weights[f"{prefix}.q_proj"], expected)
    assert not torch.equal(result.weights[f"{prefix}.q_proj"].packed, plain.weights[f"{prefix}.q_proj"].packed)
