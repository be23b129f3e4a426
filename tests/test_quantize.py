"""`fp4forge quantize`: recipes, both layouts, streaming resume, and oracles outside fp4forge
(the safetensors reader, compressed-tensors' own config models and dequantizer, llm-compressor's
export of the same testbed)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from fp4forge.audit.byte_table import compute_byte_table
from fp4forge.checkpoint.layout import layout_by_name
from fp4forge.checkpoint.reader import open_checkpoint
from fp4forge.errors import ConfigError
from fp4forge.quantize.act_scales import ConstantAmax
from fp4forge.quantize.export import QuantizeOptions, quantize_checkpoint
from fp4forge.quantize.recipe import builtin_recipe_names, load_recipe, parse_recipe

REPO = Path(__file__).resolve().parents[1]
ACT = ConstantAmax(8.0)


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    from fp4forge.testbed import build_tiny_laguna

    return build_tiny_laguna(tmp_path_factory.mktemp("q") / "tiny-laguna", seed=0)


@pytest.fixture(scope="module")
def exports(source, tmp_path_factory) -> dict[tuple[str, str], Path]:
    """Every built-in recipe in both layouts (fp8_dynamic has no ModelOpt form)."""
    root = tmp_path_factory.mktemp("exports")
    out = {}
    for recipe in builtin_recipe_names():
        for layout_format in ("compressed-tensors", "modelopt"):
            target = root / f"{recipe}-{layout_format}"
            quantize_checkpoint(source, target, QuantizeOptions(load_recipe(recipe), layout_format, act_amax=ACT))
            out[(recipe, layout_format)] = target
    return out


# -- recipes -----------------------------------------------------------------------------------
def test_builtin_recipes_are_the_issue_s_four():
    assert {"nvfp4-experts-fp8-attn", "nvfp4-experts", "nvfp4-all-linear", "fp8"} <= set(builtin_recipe_names())


@pytest.mark.parametrize(
    "text, message",
    [
        ('name="x"\n[[rules]]\ncomponents=["routed_experts"]\nscheme="nvfp9"', "is not one of"),
        ('name="x"\n[[rules]]\ncomponents=["embeddings"]\nscheme="nvfp4"', "cannot be quantized"),
        ('name="x"\n[[rules]]\ncomponents=["routed_experts"]\nscheme="nvfp4"\ncolour="red"', "unknown keys"),
        ('name="x"\nrules=[]', "no rules"),
        ('name="x"\n[[rules]]\ncomponents=["attention"]\nscheme="fp8"\nignore=["re:("]', "bad regex"),
    ],
)
def test_malformed_recipes_fail_before_work(text, message):
    with pytest.raises(ConfigError, match=message):
        parse_recipe(text)


def test_recipe_that_targets_nothing_or_is_ambiguous_fails_before_any_output(source, tmp_path):
    nothing = parse_recipe(
        """
        name = "x"
        [[rules]]
        components = ["routed_experts"]
        modules = ['re:.*experts\\.99\\..*']
        scheme = "nvfp4"
        """
    )
    with pytest.raises(ConfigError, match="targets nothing"):
        quantize_checkpoint(source, tmp_path / "a", QuantizeOptions(nothing, act_amax=ACT))
    ambiguous = parse_recipe(
        'name="x"\n[[rules]]\ncomponents=["attention"]\nscheme="fp8"\n[[rules]]\ncomponents=["attention"]\nscheme="nvfp4"'
    )
    with pytest.raises(ConfigError, match="ambiguous"):
        quantize_checkpoint(source, tmp_path / "b", QuantizeOptions(ambiguous, act_amax=ACT))
    split_qkv = parse_recipe('name="x"\n[[rules]]\ncomponents=["attention"]\nmodules=["re:.*q_proj"]\nscheme="fp8"')
    with pytest.raises(ConfigError, match="mixes schemes"):
        quantize_checkpoint(source, tmp_path / "c", QuantizeOptions(split_qkv, act_amax=ACT))
    assert list(tmp_path.iterdir()) == []


def test_w4a4_without_activation_scales_is_refused(source, tmp_path):
    with pytest.raises(ConfigError, match="explicit constant amax") as refused:
        quantize_checkpoint(source, tmp_path / "out", QuantizeOptions(load_recipe("nvfp4-experts")))
    assert refused.value.option == "act_amax"  # the library names its option; each front end spells it
    assert list(tmp_path.iterdir()) == []


# -- the exports --------------------------------------------------------------------------------
def test_exports_read_back_with_safetensors_and_match_the_declared_layout(exports):
    for (recipe, layout_format), path in exports.items():
        names = {}
        for shard in path.glob("*.safetensors"):
            with safe_open(shard, framework="pt") as fh:
                for name in fh.keys():
                    names[name] = fh.get_slice(name).get_dtype()
        expert = "model.layers.1.mlp.experts.0.gate_proj"
        if recipe == "fp8":
            assert names[f"{expert}.weight"] == "F8_E4M3" and f"{expert}.input_scale" in names
        elif layout_format == "compressed-tensors":
            assert names[f"{expert}.weight_packed"] == "U8" and names[f"{expert}.weight_global_scale"] == "F32"
            assert names[f"{expert}.input_global_scale"] == "F32"
        else:
            assert names[f"{expert}.weight"] == "U8" and names[f"{expert}.weight_scale_2"] == "F32"
            assert names[f"{expert}.input_scale"] == "F32"
            assert json.loads((path / "hf_quant_config.json").read_text())["quantization"]["kv_cache_quant_algo"] in (None, "FP8")
        assert names[f"{expert}.weight_scale"] == ("F8_E4M3" if recipe != "fp8" else ("BF16" if layout_format == "compressed-tensors" else "F32"))
        assert names["model.layers.1.mlp.experts.e_score_correction_bias"] in ("F32", "BF16")
        config = json.loads((path / "config.json").read_text())
        assert config["quantization_config"]["quant_method"] in ("compressed-tensors", "modelopt")
        assert (path / "tokenizer.json").is_file() and (path / "fp4forge.json").is_file()


def test_expert_format_is_4_5_bits_per_parameter(exports):
    """(4 bits + one 8-bit scale per 16) = 4.5, plus one F32 global (and input) scale per expert
    matrix: here 2 x 32 bits over 128 x 256 parameters."""
    layout = layout_by_name("laguna")
    for (recipe, _), path in exports.items():
        if recipe == "fp8":
            continue
        table = compute_byte_table(open_checkpoint(path), layout)
        assert table.experts_bpp == pytest.approx(4.5 + 64 / (128 * 256), abs=1e-9)


def test_fused_groups_share_one_global_scale(exports):
    ckpt = open_checkpoint(exports[("nvfp4-all-linear", "compressed-tensors")])
    for prefix in ("model.layers.2.self_attn", "model.layers.2.mlp.experts.5"):
        members = ("q_proj", "k_proj", "v_proj") if prefix.endswith("self_attn") else ("gate_proj", "up_proj")
        scales = [ckpt.read_tensor(f"{prefix}.{m}.weight_global_scale") for m in members]
        assert all(torch.equal(s, scales[0]) for s in scales)
        amax = max(float(open_checkpoint(exports[("nvfp4-all-linear", "compressed-tensors")]).read_tensor(f"{prefix}.{m}.weight_scale").float().max()) for m in members)
        assert amax > 0


def test_constant_activation_scales_are_recorded_as_uncalibrated(exports):
    provenance = json.loads((exports[("nvfp4-experts-fp8-attn", "modelopt")] / "fp4forge.json").read_text())
    assert provenance["activation_scales"] == {"source": "constant", "amax": 8.0, "note": "explicit constant, not calibrated"}
    assert provenance["kv_cache"]["layers"] == 4
    assert provenance["weight_error"]["by_component"]["routed_experts:nvfp4"]["linears"] == 3 * 3 * 16


def test_compressed_tensors_config_validates_with_compressed_tensors_models(exports):
    quant_config = pytest.importorskip("compressed_tensors.quantization").QuantizationConfig
    for (recipe, layout_format), path in exports.items():
        if layout_format != "compressed-tensors":
            continue
        declared = json.loads((path / "config.json").read_text())["quantization_config"]
        parsed = quant_config.model_validate(declared)  # extra="forbid" on every nested model
        assert set(parsed.config_groups) == set(declared["config_groups"])


def test_compressed_tensors_targets_match_exactly_the_quantized_modules(exports):
    """compressed-tensors' own matcher, fed our targets and ignore list, picks out exactly the
    modules that carry quantized tensors, and nothing else."""
    match = pytest.importorskip("compressed_tensors.utils.match")
    for (recipe, layout_format), path in exports.items():
        if layout_format != "compressed-tensors":
            continue
        declared = json.loads((path / "config.json").read_text())["quantization_config"]
        ckpt = open_checkpoint(path)
        names = [info.name for _, info in ckpt.tensors()]
        quantized = {n.rsplit(".", 1)[0] for n in names if n.endswith((".weight_packed", ".weight_scale"))}
        linears = {n.rsplit(".", 1)[0] for n in names if n.endswith((".weight", ".weight_packed")) and "norm" not in n and "embed" not in n}
        for module in sorted(linears):
            hits = [
                g for g, group in declared["config_groups"].items()
                if any(match.is_match(module, _FakeLinear(), t) for t in group["targets"])
                and not any(match.is_match(module, _FakeLinear(), i) for i in declared["ignore"])
            ]
            assert (len(hits) == 1) == (module in quantized), (recipe, module, hits)


class _FakeLinear(torch.nn.Module):
    """A stand-in module whose class name is not 'Linear', so only name targets can match."""


# -- resume and interruption ---------------------------------------------------------------------
def _quantize_cmd(src: Path, out: Path) -> list[str]:
    # The MSE block-scale sweep makes each unit slow enough to interrupt reliably mid-run.
    return [
        sys.executable, "-m", "fp4forge.cli", "quantize", str(src), str(out), "--recipe", "nvfp4-experts-fp8-attn",
        "--act-scales", "constant:8", "--block-scales", "mse", "--json",
    ]


def _journal_lines(out: Path) -> int:
    journal = out.parent / f".{out.name}.partial" / ".fp4forge-journal"
    return len(journal.read_text().splitlines()) if journal.is_file() else 0


@pytest.fixture(scope="module")
def mse_reference(source, tmp_path_factory) -> Path:
    """An uninterrupted export with the options the interrupted runs use."""
    out = tmp_path_factory.mktemp("mse") / "reference"
    return quantize_checkpoint(source, out, QuantizeOptions(load_recipe("nvfp4-experts-fp8-attn"), block_scales="mse", act_amax=ACT)) and out


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT])
def test_killed_export_resumes_to_identical_bytes(source, mse_reference, tmp_path, sig):
    reference = mse_reference
    out = tmp_path / "out"
    # A shell may start children with SIGINT ignored (then Python never raises KeyboardInterrupt);
    # restore the default so the signal acts as Ctrl-C in a terminal does.
    proc = subprocess.Popen(
        _quantize_cmd(source, out), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.monotonic() + 120
    while _journal_lines(out) < 12:
        assert proc.poll() is None, proc.stderr.read()
        assert time.monotonic() < deadline
        time.sleep(0.05)
    proc.send_signal(sig)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode != 0 and not out.exists()
    if sig == signal.SIGINT:
        assert "interrupted" in stderr and "Traceback" not in stderr
    done = subprocess.run(_quantize_cmd(source, out), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["resumed_units"] >= 11
    for ref_file in sorted(reference.iterdir()):
        assert (out / ref_file.name).read_bytes() == ref_file.read_bytes(), ref_file.name
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in reference.iterdir())
    assert not (tmp_path / ".out.partial").exists()


def test_audit_finds_no_errors_in_any_recipe_output(exports):
    """The issue's bar: every built-in recipe, both layouts, audits clean (the constant
    activation scales and vLLM 0.32's Laguna router-bias blind spot are warnings)."""
    from fp4forge.audit.engine import audit_checkpoint

    for key, path in exports.items():
        report = audit_checkpoint(str(path))
        errors = [f.rule for f in report.findings if f.severity == "error"]
        assert errors == [], (key, errors)
        assert {f.rule for f in report.findings} <= {"activation-scales-constant", "serving-blind-spot"}, key


def test_mse_export_shares_the_searched_global_scale_in_fused_groups(source, mse_reference):
    # gate/up of one expert: one global scale, searched (2688 / group amax times 2**(-t/16))
    src, ckpt = open_checkpoint(source), open_checkpoint(mse_reference)
    prefix = "model.layers.2.mlp.experts.5"
    scales = [ckpt.read_tensor(f"{prefix}.{m}.weight_global_scale") for m in ("gate_proj", "up_proj")]
    assert torch.equal(scales[0], scales[1])
    amax = max(src.read_tensor(f"{prefix}.{m}.weight").abs().max() for m in ("gate_proj", "up_proj"))
    ratio = float(2688.0 / amax.to(torch.bfloat16).float()) / float(scales[0])
    assert any(abs(ratio - 2.0 ** (t / 16)) < 1e-2 for t in range(16)), ratio
