"""`fp4forge serve cmd`: one snapshot per hardware target, plus the review points behind them.

Snapshots live in tests/fixtures/serve_cmd/; regenerate with FP4FORGE_UPDATE_SNAPSHOTS=1 and
review the diff. Review points, each asserted below (sources: docs/formats.md#nvfp4-moe-backends,
docs/laguna-card.md#gb10-serve-line):

* GB10 (sm_121): a fused CUTLASS MoE backend (FLASHINFER_CUTLASS; CUTLASS as alternative), never
  TRTLLM/CUTEDSL (family 100) nor MARLIN/HUMMING (drop activation scales) for W4A4;
* Blackwell B200: a fused backend that honours activation scales;
* Hopper (H100/H200): the warning that W4A4 runs as W4A16, and the emulation alternative;
* CPU: the fp4forge-vllm plugin and its numerics switch;
* `--kv-cache-dtype auto` explained: resolves FP8 from the declaration, cannot remove it nor
  invent missing scales; the benign q-scale line vs the scale-1.0 line;
* Laguna: poolside_v1 tool parser + fp4forge's fixed reasoning parser;
* weight tracking on for quantized checkpoints; env vars; versioned spelling (v0.25 --kernel-config).
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from fp4forge.cli import serve as cli_serve
from fp4forge.errors import ConfigError
from fp4forge.serve.recommend import HARDWARE, CheckpointFacts, read_checkpoint_facts, recommend

SNAPSHOTS = Path(__file__).parent / "fixtures" / "serve_cmd"
UPDATE = os.environ.get("FP4FORGE_UPDATE_SNAPSHOTS") == "1"
MODEL_LABEL = "tiny-laguna-nvfp4"  # what the user typed as MODEL; keeps snapshots path-free
VLLM = "0.32.0"
W4A16_RECIPE = """name = "nvfp4a16-experts"
description = "routed experts NVFP4 weight-only"
[[rules]]
components = ["routed_experts"]
scheme = "nvfp4a16"
"""


def _quantize(src: Path, out: Path, recipe: str, layout: str = "compressed-tensors") -> Path:
    from fp4forge.quantize.act_scales import parse_act_scales
    from fp4forge.quantize.export import QuantizeOptions, quantize_checkpoint
    from fp4forge.quantize.recipe import load_recipe

    act = parse_act_scales("constant:8", None) if "a16" not in recipe else None
    quantize_checkpoint(src, out, QuantizeOptions(recipe=load_recipe(recipe), layout_format=layout, act_amax=act))
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from fp4forge.testbed import build_tiny_laguna

    root = tmp_path_factory.mktemp("serve-cmd")
    bf16 = build_tiny_laguna(root / "bf16", seed=0)
    recipe = root / "w4a16.toml"
    recipe.write_text(W4A16_RECIPE)
    return {
        "bf16": bf16,
        "w4a4": _quantize(bf16, root / "w4a4", "nvfp4-experts-fp8-attn"),
        "w4a16": _quantize(bf16, root / "w4a16", str(recipe)),
    }


@pytest.fixture(scope="module")
def w4a4_facts(checkpoints: dict[str, Path]) -> CheckpointFacts:
    return read_checkpoint_facts(str(checkpoints["w4a4"]))


def check_snapshot(name: str, text: str) -> None:
    path = SNAPSHOTS / f"{name}.txt"
    if UPDATE:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert path.is_file(), f"no snapshot {path}; run with FP4FORGE_UPDATE_SNAPSHOTS=1 and review it"
    assert text == path.read_text()


# -- what the checkpoint is ----------------------------------------------------------------------
def test_facts_of_fp4forge_checkpoints(checkpoints: dict[str, Path], w4a4_facts: CheckpointFacts) -> None:
    # 3 MoE layers, each with its mlp.experts.e_score_correction_bias (the testbed's non-zero router bias)
    assert w4a4_facts == CheckpointFacts(
        "LagunaForCausalLM", "compressed-tensors", ("nvfp4",), ("fp8",), "fp8", 8, 4, {"laguna-router-bias-dropped": 3}
    )
    w4a16 = read_checkpoint_facts(str(checkpoints["w4a16"]))
    assert (w4a16.expert_schemes, w4a16.linear_schemes, w4a16.kv_declared) == (("nvfp4a16",), (), None)
    bf16 = read_checkpoint_facts(str(checkpoints["bf16"]))
    assert (bf16.quant_format, bf16.expert_schemes) == (None, ())


# -- snapshots ------------------------------------------------------------------------------------
@pytest.mark.parametrize("hardware", HARDWARE)
def test_snapshot_w4a4_per_hardware(w4a4_facts: CheckpointFacts, hardware: str) -> None:
    # cpu: a CPU that keeps the declared FP8 KV cache (AVX-512/AMX); the other kind below
    check_snapshot(f"w4a4-{hardware}", recommend(MODEL_LABEL, w4a4_facts, hardware, VLLM, cpu_fp8_kv=True).render())


def test_snapshot_w4a4_cpu_without_avx512(w4a4_facts: CheckpointFacts) -> None:
    check_snapshot("w4a4-cpu-avx2", recommend(MODEL_LABEL, w4a4_facts, "cpu", VLLM, cpu_fp8_kv=False).render())


@pytest.mark.parametrize("hardware", ["gb10", "cpu"])
def test_snapshot_w4a16(checkpoints: dict[str, Path], hardware: str) -> None:
    facts = read_checkpoint_facts(str(checkpoints["w4a16"]))
    check_snapshot(f"w4a16-{hardware}", recommend(MODEL_LABEL, facts, hardware, VLLM).render())


def test_snapshot_seed_version_spelling(w4a4_facts: CheckpointFacts) -> None:
    check_snapshot("w4a4-gb10-vllm-0.25.1", recommend(MODEL_LABEL, w4a4_facts, "gb10", "0.25.1").render())


def test_snapshot_kv_declared_without_scales(w4a4_facts: CheckpointFacts) -> None:
    facts = replace(w4a4_facts, kv_scales_shipped=0)
    check_snapshot("w4a4-gb10-kv-without-scales", recommend(MODEL_LABEL, facts, "gb10", VLLM).render())


# -- review points ------------------------------------------------------------------------------
def flags(rec) -> list[str]:  # type: ignore[no-untyped-def]
    return [part for flag in rec.args for part in flag]


def test_gb10_uses_a_fused_cutlass_backend(w4a4_facts: CheckpointFacts) -> None:
    rec = recommend(MODEL_LABEL, w4a4_facts, "gb10", VLLM)
    argv = flags(rec)
    assert argv[argv.index("--moe-backend") + 1] == "flashinfer_cutlass"
    text = rec.render()
    for why in ("family 100", "MARLIN and HUMMING", "drop its activation scales", "`cutlass`"):
        assert why in text
    assert rec.env == {"CUTE_DSL_ARCH": "sm_121a"}
    assert not rec.warnings


def test_b200_honours_activation_scales(w4a4_facts: CheckpointFacts) -> None:
    argv = flags(recommend(MODEL_LABEL, w4a4_facts, "b200", VLLM))
    assert argv[argv.index("--moe-backend") + 1] in {"flashinfer_cutlass", "cutlass", "flashinfer_trtllm"}


@pytest.mark.parametrize("hardware", ["h100", "h200"])
def test_hopper_warns_w4a16_and_offers_emulation(w4a4_facts: CheckpointFacts, hardware: str) -> None:
    rec = recommend(MODEL_LABEL, w4a4_facts, hardware, VLLM)
    assert "--moe-backend" not in flags(rec)
    (warning,) = rec.warnings
    assert "W4A16" in warning and "--moe-backend emulation --linear-backend emulation" in warning


def test_w4a16_checkpoint_is_marlin_on_blackwell(checkpoints: dict[str, Path]) -> None:
    rec = recommend(MODEL_LABEL, read_checkpoint_facts(str(checkpoints["w4a16"])), "gb10", VLLM)
    argv = flags(rec)
    assert argv[argv.index("--moe-backend") + 1] == "marlin"


CPUINFO_AVX2 = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse2 avx avx2 fma bmi2\n"
CPUINFO_AVX512 = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 avx512f avx512bw avx512vl\n"
CPUINFO_AMX = "processor\t: 0\nflags\t\t: fpu avx2 amx_bf16 amx_tile amx_int8\n"
CPUINFO_ARM = "processor\t: 0\nFeatures\t: fp asimd evtstrm aes sve\n"


def test_cpu_fp8_kv_needs_avx512_or_amx() -> None:
    from fp4forge.serve.recommend import cpu_flags, cpu_has_fp8_kv

    assert cpu_flags(CPUINFO_AVX2) == {"fpu", "sse2", "avx", "avx2", "fma", "bmi2"}
    assert [cpu_has_fp8_kv(cpu_flags(t)) for t in (CPUINFO_AVX2, CPUINFO_AVX512, CPUINFO_AMX, CPUINFO_ARM, "")] == [
        False, True, True, False, False]
    # this machine's answer is its /proc/cpuinfo flags'
    local = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    assert cpu_has_fp8_kv() == bool({"avx512f", "amx_tile"} & set(cpu_flags(local)))


def test_cpu_without_avx512_serves_the_declared_fp8_kv_unquantized(w4a4_facts: CheckpointFacts, checkpoints: dict[str, Path]) -> None:
    rec = recommend(MODEL_LABEL, w4a4_facts, "cpu", VLLM, cpu_fp8_kv=False)
    argv = flags(rec)
    assert argv[argv.index("--kv-cache-dtype") + 1] == "bfloat16" and argv[argv.index("--dtype") + 1] == "bfloat16"
    assert argv.count("--kv-cache-dtype") == 1
    assert any("not exercised" in w for w in rec.warnings)
    doc = rec.to_json()
    assert doc["kv_fallback"]["served_dtype"] == "bfloat16" and doc["kv_fallback"]["declared"] == "fp8"
    assert any("AVX-512 or AMX" in note["why"] for note in doc["notes"])
    # where the CPU keeps FP8 KV, or the checkpoint declares none, or the target is a GPU: no override
    assert recommend(MODEL_LABEL, w4a4_facts, "cpu", VLLM, cpu_fp8_kv=True).kv_fallback is None
    w4a16 = read_checkpoint_facts(str(checkpoints["w4a16"]))
    assert recommend(MODEL_LABEL, w4a16, "cpu", VLLM, cpu_fp8_kv=False).kv_fallback is None
    assert recommend(MODEL_LABEL, w4a4_facts, "gb10", VLLM, cpu_fp8_kv=False).kv_fallback is None


def test_cpu_uses_the_plugin(w4a4_facts: CheckpointFacts) -> None:
    rec = recommend(MODEL_LABEL, w4a4_facts, "cpu", VLLM)
    assert rec.env["FP4FORGE_VLLM_NUMERICS"] == "w4a4"
    # the CPU server reproduces the recommended GB10 backend (FLASHINFER_CUTLASS: one global-max input scale)
    assert rec.env["FP4FORGE_VLLM_MOE_INPUT_SCALE"] == "global"
    assert any("fp4forge-vllm" in note["why"] for note in rec.notes)
    assert "--enforce-eager" in flags(rec)


def test_kv_auto_is_explained(w4a4_facts: CheckpointFacts) -> None:
    calibrated = recommend(MODEL_LABEL, w4a4_facts, "gb10", VLLM)
    why = next(n["why"] for n in calibrated.notes if n["flag"] == "--kv-cache-dtype auto")
    assert "benign" in why and "scaling factor 1.0" in why
    missing = recommend(MODEL_LABEL, replace(w4a4_facts, kv_scales_shipped=0), "gb10", VLLM)
    assert any("scale 1.0" in w and "0/8" in w for w in missing.warnings)
    assert "cannot remove" in next(n["why"] for n in missing.notes if n["flag"] == "--kv-cache-dtype auto")


def test_laguna_parsers_and_weight_tracking(w4a4_facts: CheckpointFacts, checkpoints: dict[str, Path]) -> None:
    argv = flags(recommend(MODEL_LABEL, w4a4_facts, "gb10", VLLM))
    for flag, value in [("--tool-call-parser", "poolside_v1"), ("--reasoning-parser", "poolside_v1_fixed"),
                        ("--reasoning-parser-plugin", "fp4forge_vllm.reasoning"),
                        ("--model-loader-extra-config", '{"enable_weights_track": true}')]:
        assert argv[argv.index(flag) + 1] == value
    unquantized = flags(recommend(MODEL_LABEL, read_checkpoint_facts(str(checkpoints["bf16"])), "gb10", VLLM))
    assert "--model-loader-extra-config" not in unquantized and "--moe-backend" not in unquantized


def test_versions_are_data(w4a4_facts: CheckpointFacts) -> None:
    seed = recommend(MODEL_LABEL, w4a4_facts, "gb10", "0.25.1")
    assert ["--kernel-config", '{"moe_backend":"FLASHINFER_CUTLASS"}'] in seed.args
    with pytest.raises(ConfigError, match="knows no serve line"):
        recommend(MODEL_LABEL, w4a4_facts, "gb10", "0.9.0")
    with pytest.raises(ConfigError, match="unknown hardware"):
        recommend(MODEL_LABEL, w4a4_facts, "mi300", VLLM)


def test_cli_json(checkpoints: dict[str, Path]) -> None:
    app = typer.Typer()

    @app.callback()
    def main() -> None:
        """fp4forge (test harness)"""

    cli_serve.register(app)
    result = CliRunner().invoke(app, ["serve", "cmd", str(checkpoints["w4a4"]), "--hardware", "h200", "--vllm-version", VLLM, "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert {"vllm_version", "hardware", "model", "checkpoint", "env", "argv", "command", "notes", "warnings"} <= set(doc)
    assert doc["argv"][:3] == ["vllm", "serve", str(checkpoints["w4a4"])]
    assert doc["warnings"]


# -- one MoE numerics setting: backend -> serve line -> plugin -> fidelity ---------------------------
def test_target_numerics_come_from_the_backend_table() -> None:
    from fp4forge.serve.recommend import knowledge, target_numerics

    backends = knowledge()["moe_backends"]
    for hardware in ("gb10", "b200"):
        numerics = target_numerics(hardware)
        assert numerics.moe_backend == knowledge()["hardware"][hardware]["moe_backend"]
        assert (numerics.activations, numerics.moe_input_scale) == ("w4a4", backends[numerics.moe_backend]["moe_input_scale"])
    assert target_numerics("gb10").moe_input_scale == "global"  # FLASHINFER_CUTLASS
    assert backends["cutlass"]["moe_input_scale"] == "per_expert"  # vLLM's own CUTLASS
    for hardware in ("h100", "h200"):  # HUMMING/MARLIN drop the activation scales
        assert (target_numerics(hardware).activations, target_numerics(hardware).moe_input_scale) == ("w4a16", "none")
    assert target_numerics("gb10", weight_only=True).activations == "w4a16"
    cpu = target_numerics("cpu")
    assert cpu == target_numerics("gb10")
    assert cpu.plugin_env() == {"FP4FORGE_VLLM_NUMERICS": "w4a4", "FP4FORGE_VLLM_MOE_INPUT_SCALE": "global"}
    assert cpu.fidelity_options() == {"numerics": "w4a4", "moe_input_scale": "global-max"}


def test_plugin_switch_values_are_the_plugins() -> None:
    """The env values serve cmd writes are values the plugin's settings accept."""
    import sys

    sys.path.insert(0, str(Path(__file__).parents[1] / "plugins" / "fp4forge-vllm" / "src"))
    try:
        from fp4forge_vllm.settings import ENV_MOE_INPUT_SCALE, ENV_NUMERICS, MoeInputScale, Numerics
    finally:
        sys.path.pop(0)
    from fp4forge.serve.recommend import PLUGIN_MOE_INPUT_SCALE_ENV, PLUGIN_NUMERICS_ENV, knowledge

    assert (PLUGIN_NUMERICS_ENV, PLUGIN_MOE_INPUT_SCALE_ENV) == (ENV_NUMERICS, ENV_MOE_INPUT_SCALE)
    for entry in knowledge()["moe_backends"].values():
        Numerics(entry["activations"])
        if entry["moe_input_scale"] != "none":
            MoeInputScale(entry["moe_input_scale"])


def test_the_serve_line_names_its_numerics(w4a4_facts: CheckpointFacts, checkpoints: dict[str, Path]) -> None:
    for hardware in HARDWARE:
        rec = recommend(MODEL_LABEL, w4a4_facts, hardware, VLLM)
        assert rec.to_json()["numerics"]["moe_input_scale"] in {"global", "per_expert", "none"}
        assert "# MoE numerics: " in rec.render()
    bf16 = recommend(MODEL_LABEL, read_checkpoint_facts(str(checkpoints["bf16"])), "gb10", VLLM)
    assert bf16.to_json()["numerics"] is None


# -- lines that would serve the checkpoint wrong ---------------------------------------------------
GPU_TARGETS = ("gb10", "b200", "h100", "h200")


@pytest.mark.parametrize("hardware", GPU_TARGETS)
def test_router_bias_warning_on_every_gpu_target_where_the_plugin_does_not_fix_it(
    checkpoints: dict[str, Path], w4a4_facts: CheckpointFacts, hardware: str
) -> None:
    """vLLM <= 0.32's Laguna loader drops mlp.experts.e_score_correction_bias on every platform; the
    plugin (0.2.0) loads it on vLLM 0.32.0 only. Every other line must warn, in text and --json."""
    for facts in (w4a4_facts, read_checkpoint_facts(str(checkpoints["bf16"]))):
        assert facts.engine_quirks == {"laguna-router-bias-dropped": 3}
        unfixed = recommend(MODEL_LABEL, facts, hardware, "0.25.1")
        (warning,) = [w for w in unfixed.warnings if "laguna-router-bias-dropped" in w]
        assert "e_score_correction_bias" in warning and "only on vLLM 0.32.0" in warning
        assert f"# WARNING: {warning}" in unfixed.render()
        fixed = recommend(MODEL_LABEL, facts, hardware, VLLM)
        assert not [w for w in fixed.warnings if "router" in w]
        (note,) = [n for n in fixed.notes if n["flag"] == "(fp4forge-vllm plugin, required)"]
        assert "e_score_correction_bias" in note["why"]
        assert "fp4forge_vllm.reasoning" in fixed.command()  # the plugin package is on the line


def test_router_bias_warning_in_json(checkpoints: dict[str, Path]) -> None:
    app = typer.Typer()

    @app.callback()
    def main() -> None:
        """fp4forge (test harness)"""

    cli_serve.register(app)
    for hardware in GPU_TARGETS:
        result = CliRunner().invoke(app, ["serve", "cmd", str(checkpoints["bf16"]), "--hardware", hardware, "--vllm-version", "0.25.1", "--json"])
        assert result.exit_code == 0, result.output
        assert any("e_score_correction_bias" in w for w in json.loads(result.stdout)["warnings"])


def test_no_router_bias_warning_without_the_bias(tmp_path: Path, checkpoints: dict[str, Path]) -> None:
    import shutil

    from safetensors.torch import load_file, save_file

    out = shutil.copytree(checkpoints["bf16"], tmp_path / "no-bias")
    for shard in out.glob("*.safetensors"):
        tensors = load_file(shard)
        save_file({k: v for k, v in tensors.items() if not k.endswith("e_score_correction_bias")}, shard, metadata={"format": "pt"})
    index = out / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    doc["weight_map"] = {k: v for k, v in doc["weight_map"].items() if not k.endswith("e_score_correction_bias")}
    index.write_text(json.dumps(doc))
    facts = read_checkpoint_facts(str(out))
    assert facts.engine_quirks == {}
    assert not [w for w in recommend(MODEL_LABEL, facts, "gb10", "0.25.1").warnings if "router" in w]
