"""FP8 KV scales: calibrate into a checkpoint (both layouts, atomically, with the declaration),
transplant between layouts bit-exactly, refuse mismatched donors, show scales and findings."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import typer
from typer.testing import CliRunner

from fp4forge.calibrate import CalibrationOptions, calibrate_checkpoint
from fp4forge.calibrate import kv
from fp4forge.checkpoint.reader import open_checkpoint
from fp4forge.cli.calibrate import register
from fp4forge.errors import ConfigError
from fp4forge.checkpoint.stats import write_stats
from tests.calibration_fixtures import laguna, one_thread, tiny  # noqa: F401 (shared fixtures)


@pytest.fixture(scope="module")
def stats(laguna: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    result = calibrate_checkpoint(laguna, CalibrationOptions(samples=4, seq_len=96, batch_size=4))
    return write_stats(tmp_path_factory.mktemp("kvstats") / "stats.safetensors", result.tensors, result.metadata)


def copy_of(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def cli() -> typer.Typer:
    app = typer.Typer()
    app.callback()(lambda: None)
    register(app)
    return app


@pytest.mark.parametrize(("layout", "name", "dtype", "shape"), [("compressed-tensors", "model.layers.3.self_attn.k_scale", torch.bfloat16, (1,)), ("modelopt", "model.layers.3.self_attn.k_proj.k_scale", torch.float32, ())])
def test_kv_calibrate_into_writes_shard_index_and_declaration(laguna: Path, stats: Path, tmp_path: Path, layout: str, name: str, dtype: torch.dtype, shape: tuple) -> None:
    target = copy_of(laguna, tmp_path / "ckpt")
    before = {p.name: p.read_bytes() for p in target.glob("*.safetensors")}
    result = CliRunner().invoke(cli(), ["kv", "calibrate", str(stats), "--into", str(target), "--format", layout, "--json"])
    assert result.exit_code == 0, result.output
    assert {p.name: p.read_bytes() for p in target.glob("model-0*.safetensors")} == before, "existing shards are never rewritten"
    assert not list(target.glob(".*partial")), "no staging files left behind"
    ckpt = open_checkpoint(target)
    assert ckpt.index.weight_map[name] == kv.KV_SHARD
    amax = stats_value(stats, "model.layers.3.self_attn.k_amax")
    scale = ckpt.read_tensor(name)
    assert scale.dtype == dtype and tuple(scale.shape) == shape and torch.equal(scale.reshape(1), (amax / 448).to(dtype))
    assert ckpt.index.metadata["total_size"] == sum(info.nbytes for _, info in ckpt.tensors())
    report = kv.show(target).to_json()
    assert report["layout"] == layout and report["declared"] and report["findings"] == []
    assert [r["layer"] for r in report["layers"]] == [f"model.layers.{i}" for i in range(4)]
    qc = ckpt.config["quantization_config"]
    if layout == "modelopt":
        assert ckpt.extra_json["hf_quant_config.json"]["quantization"]["kv_cache_quant_algo"] == "FP8"
        assert qc["kv_cache_scheme"] == {"dynamic": False, "num_bits": 8, "type": "float"} and qc["quant_algo"] == "FP8"
        assert "model.layers.1.mlp.experts.0.gate_proj" in qc["ignore"], "a KV-only ModelOpt declaration quantizes no Linear"
    else:
        assert qc["kv_cache_scheme"]["strategy"] == "tensor" and qc["config_groups"] == {}
    provenance = json.loads((target / "fp4forge.json").read_text())["kv_cache"]["scales"]
    assert provenance["source"] == "calibration" and provenance["formula"] == "amax / 448"


def stats_value(path: Path, name: str) -> torch.Tensor:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as fh:
        return fh.get_tensor(name)


def test_per_head_scales_and_refusals(laguna: Path, stats: Path, tmp_path: Path) -> None:
    target = copy_of(laguna, tmp_path / "ct")
    layers = kv.attention_layers(open_checkpoint(target))
    kv.install_kv_scales(target, kv.scales_from_stats(stats, layers, per_head=True), "compressed-tensors")
    ckpt = open_checkpoint(target)
    scale = ckpt.read_tensor("model.layers.0.self_attn.v_scale")
    assert scale.shape == (2, 1, 1) and ckpt.config["quantization_config"]["kv_cache_scheme"]["strategy"] == "attn_head"
    assert isinstance(kv.show(target).layers[0]["v_scale"], list)
    with pytest.raises(ConfigError, match="per-tensor KV scales only"):
        kv.install_kv_scales(copy_of(laguna, tmp_path / "mo"), kv.scales_from_stats(stats, layers, per_head=True), "modelopt")
    with pytest.raises(ConfigError, match="choose the layout"):
        kv.install_kv_scales(copy_of(laguna, tmp_path / "bare"), kv.scales_from_stats(stats, layers))
    with pytest.raises(ConfigError, match="no KV scales for 1 attention layers"):
        kv.install_kv_scales(copy_of(laguna, tmp_path / "few"), kv.KvScales({k: v for k, v in kv.scales_from_stats(stats, layers).layers.items() if k != layers[2]}), "modelopt")


def test_transplant_round_trips_between_layouts_bit_exactly(laguna: Path, stats: Path, tmp_path: Path) -> None:
    layers = kv.attention_layers(open_checkpoint(laguna))
    for start, other in (("compressed-tensors", "modelopt"), ("modelopt", "compressed-tensors")):
        donor = copy_of(laguna, tmp_path / f"donor-{start}")
        kv.install_kv_scales(donor, kv.scales_from_stats(stats, layers), start)
        bare_other = copy_of(laguna, tmp_path / f"bare-{start}-{other}")
        kv.write_declaration(bare_other, other)
        assert [f["code"] for f in kv.show(bare_other).findings] == ["declared-without-scales"]
        there = kv.transplant(donor, bare_other, tmp_path / f"{start}-to-{other}")
        assert there["approximation"] is True and there["donor_layout"] == start and there["layout"] == other
        bare_start = copy_of(laguna, tmp_path / f"bare-{start}-{start}")
        kv.write_declaration(bare_start, start)
        kv.transplant(tmp_path / f"{start}-to-{other}", bare_start, tmp_path / f"{start}-back")
        assert (donor / kv.KV_SHARD).read_bytes() == (tmp_path / f"{start}-back" / kv.KV_SHARD).read_bytes()
        provenance = json.loads((tmp_path / f"{start}-back" / "fp4forge.json").read_text())["kv_cache"]["scales"]
        assert provenance["source"] == "transplant" and "noise" in provenance["note"]


def test_transplant_refuses_other_architectures_and_existing_scales(laguna: Path, stats: Path, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    donor = copy_of(laguna, tmp_path / "donor")
    kv.install_kv_scales(donor, kv.scales_from_stats(stats, kv.attention_layers(open_checkpoint(donor))), "modelopt")
    qwen = tiny(tmp_path_factory, "qwen3_moe")
    with pytest.raises(ConfigError, match="different architectures"):
        kv.transplant(donor, qwen, tmp_path / "nope")
    assert not (tmp_path / "nope").exists()
    truncated = copy_of(laguna, tmp_path / "truncated")
    config = json.loads((truncated / "config.json").read_text())
    config["num_hidden_layers"] = 3
    (truncated / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="num_hidden_layers"):
        kv.transplant(donor, truncated, tmp_path / "nope")
    from fp4forge.quantize.act_scales import StatsAmax
    from fp4forge.quantize.export import QuantizeOptions, quantize_checkpoint
    from fp4forge.quantize.recipe import load_recipe

    exported = tmp_path / "exported"
    quantize_checkpoint(laguna, exported, QuantizeOptions(recipe=load_recipe("nvfp4-experts-fp8-attn"), act_amax=StatsAmax(stats)))
    with pytest.raises(ConfigError, match="already carries KV scales"):
        kv.install_kv_scales(exported, kv.scales_from_stats(stats, kv.attention_layers(open_checkpoint(exported))))


def test_show_flags_constant_scales_and_large_amax(laguna: Path, tmp_path: Path) -> None:
    layers = kv.attention_layers(open_checkpoint(laguna))
    ones = kv.KvScales({layer: {"k_scale": torch.tensor(1.0), "v_scale": torch.tensor(1.0)} for layer in layers})
    constant = copy_of(laguna, tmp_path / "ones")
    kv.install_kv_scales(constant, ones, "modelopt")
    result = CliRunner().invoke(cli(), ["kv", "show", str(constant), "--json"])
    doc = json.loads(result.output)
    assert result.exit_code == 0 and set(doc) >= {"layout", "layers", "findings"}
    assert [f["code"] for f in doc["findings"]] == ["constant-1.0"]
    large = kv.KvScales({layer: {"k_scale": torch.tensor(2.0), "v_scale": torch.tensor(0.01)} for layer in layers})
    big = copy_of(laguna, tmp_path / "big")
    kv.install_kv_scales(big, large, "compressed-tensors")
    findings = {f["code"]: f for f in kv.show(big).findings}
    assert set(findings) == {"amax-over-448"} and len(findings["amax-over-448"]["layers"]) == 4
    bare = copy_of(laguna, tmp_path / "declared-only")
    kv.write_declaration(bare, "compressed-tensors")
    assert CliRunner().invoke(cli(), ["kv", "show", str(bare)]).exit_code == 1


def test_kv_calibrate_refuses_a_checkpoint_with_kv_scales_before_calibrating(
    laguna: Path, stats: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch  # noqa: F811 (the shared fixture)
) -> None:
    """issue 17: the refusal used to come after a whole calibration of SOURCE."""
    from fp4forge.calibrate import run as calibrate_run
    from fp4forge.quantize.act_scales import StatsAmax
    from fp4forge.quantize.export import QuantizeOptions, quantize_checkpoint
    from fp4forge.quantize.recipe import load_recipe

    exported = tmp_path / "exported"  # the recipe's FP8 KV: scales inside the exporter's shards
    quantize_checkpoint(laguna, exported, QuantizeOptions(recipe=load_recipe("nvfp4-experts-fp8-attn"), act_amax=StatsAmax(stats)))
    before = {p.name: p.read_bytes() for p in exported.iterdir()}
    calls: list[Path] = []
    monkeypatch.setattr(calibrate_run, "calibrate_to_file", lambda source, *args, **kwargs: calls.append(source))
    with pytest.raises(ConfigError, match="already carries KV scales"):
        kv.calibrate_kv(laguna, exported, kv.KvOptions(calibration=CalibrationOptions(samples=2, seq_len=16)))
    assert calls == []  # no calibration was started
    assert {p.name: p.read_bytes() for p in exported.iterdir()} == before  # nothing written, no stats left beside it
    assert not list(tmp_path.glob(".*kv-stats*"))
