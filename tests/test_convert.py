"""compressed-tensors NVFP4 -> ModelOpt conversion: lossless, streaming, and loadable by vLLM's
ModelOpt path (the keys it requires are present).

Reciprocal bound used throughout: for an fp32 x whose reciprocal is a normal fp32 number,
``fl(1/fl(1/x))`` is x or one of its two fp32 neighbours. (Each correctly rounded division has
relative error at most u/(1+u), u = 2^-24, so the round trip is within a factor (1 + 2u) of x,
i.e. under 2 ulp(x); the only fp32 numbers that close are x and its neighbours.) So ModelOpt's
``weight_scale_2``/``input_scale`` inverted back equal CT's global scales to within 1 ulp.
"""

from __future__ import annotations

import fnmatch
import json
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from fp4forge.checkpoint.convert import (
    ct_global_to_modelopt_scale,
    ct_nvfp4_to_modelopt,
    expand_ignore,
    map_tensor,
    modelopt_scale_to_ct_global,
)
from fp4forge.checkpoint.writer import CheckpointWriter, TensorSpec
from fp4forge.errors import ConfigError, WriteError

E2M1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])
INF = torch.tensor(float("inf"))


def within_one_ulp(got: torch.Tensor, want: torch.Tensor) -> bool:
    """got is want or one of want's fp32 neighbours (elementwise)."""
    got, want = got.to(torch.float32), want.to(torch.float32)
    return bool(((got == want) | (got == torch.nextafter(want, INF)) | (got == torch.nextafter(want, -INF))).all())


def load_all(ckpt_dir: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(ckpt_dir.glob("*.safetensors")):
        with safe_open(shard, framework="pt") as fh:
            for name in fh.keys():
                tensors[name] = fh.get_tensor(name)
    return tensors


def raw_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def dequant_ct(packed: torch.Tensor, block_scale: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """docs/formats.md#nvfp4-global-scale: e2m1(q) * fp8(weight_scale) / weight_global_scale, low nibble first."""
    q = torch.stack([E2M1[(packed & 0xF).long()], E2M1[(packed >> 4).long()]], dim=-1).reshape(packed.shape[0], -1)
    scaled = q.reshape(q.shape[0], -1, 16) * block_scale.float().unsqueeze(-1)
    return scaled.reshape(q.shape) / global_scale.float()


def dequant_modelopt(weight: torch.Tensor, block_scale: torch.Tensor, scale_2: torch.Tensor) -> torch.Tensor:
    q = torch.stack([E2M1[(weight & 0xF).long()], E2M1[(weight >> 4).long()]], dim=-1).reshape(weight.shape[0], -1)
    scaled = q.reshape(q.shape[0], -1, 16) * block_scale.float().unsqueeze(-1)
    return scaled.reshape(q.shape) * scale_2.float()


# -- numerics -----------------------------------------------------------------------------------
def test_reciprocal_round_trip_is_within_one_ulp() -> None:
    gen = torch.Generator().manual_seed(0)
    exponents = torch.randint(127 - 60, 127 + 60, (200_000,), generator=gen, dtype=torch.int32)
    mantissas = torch.randint(0, 1 << 23, (200_000,), generator=gen, dtype=torch.int32)
    x = ((exponents << 23) | mantissas).view(torch.float32)
    x = torch.cat([x, torch.tensor([1.0, 2688.0, 448.0 * 6 / 3.7, 30464.0, 568.0, 2.0**-20, 3.0])])
    back = torch.stack([modelopt_scale_to_ct_global(ct_global_to_modelopt_scale(v.reshape(1)))[0] for v in x[:2000]])
    assert within_one_ulp(back, x[:2000])
    assert within_one_ulp(torch.reciprocal(torch.reciprocal(x)), x)  # the same op, vectorised, all of them
    assert not bool((torch.reciprocal(torch.reciprocal(x)) == x).all())  # so "exactly equal" would be wrong


def test_scale_shapes_and_convention() -> None:
    gs = torch.tensor([2688.0 / 3.0])  # CT: 2688 / amax, amax = 3
    s2 = ct_global_to_modelopt_scale(gs)
    assert s2.shape == () and s2.dtype == torch.float32
    assert s2.item() == pytest.approx(3.0 / 2688.0, rel=2**-23)
    back = modelopt_scale_to_ct_global(s2)
    assert back.shape == (1,) and within_one_ulp(back, gs)
    with pytest.raises(ConfigError):
        ct_global_to_modelopt_scale(torch.ones(2))


def test_tensor_name_mapping() -> None:
    m = "model.layers.1.mlp.experts.3.gate_proj"
    assert map_tensor(f"{m}.weight_packed", "U8", (8, 8)).dst == f"{m}.weight"
    assert map_tensor(f"{m}.weight_scale", "F8_E4M3", (8, 1)).dst == f"{m}.weight_scale"
    assert map_tensor(f"{m}.weight_global_scale", "F32", (1,))[1:] == (f"{m}.weight_scale_2", "F32", (), "invert")
    assert map_tensor(f"{m}.input_global_scale", "F32", (1,))[1:] == (f"{m}.input_scale", "F32", (), "invert")
    a = "model.layers.2.self_attn"
    assert map_tensor(f"{a}.k_scale", "BF16", (1,))[1:] == (f"{a}.k_proj.k_scale", "F32", (), "kv")
    assert map_tensor(f"{a}.v_scale", "BF16", (1,))[1:] == (f"{a}.v_proj.v_scale", "F32", (), "kv")
    assert map_tensor(f"{a}.k_zero_point", "BF16", (1,)) is None
    bias = "model.layers.1.mlp.experts.e_score_correction_bias"
    assert map_tensor(bias, "BF16", (16,))[1:] == (bias, "BF16", (16,), "copy")


def test_expand_ignore() -> None:
    modules = ["lm_head", "model.layers.1.mlp.gate", "model.layers.1.mlp.gate_proj", "model.layers.2.mlp.gate"]
    got = expand_ignore(["lm_head", "re:.*mlp\\.gate$", "model.layers.1.mlp.gate"], modules)
    assert got == ["lm_head", "model.layers.1.mlp.gate", "model.layers.2.mlp.gate"]


# -- a hand-made compressed-tensors checkpoint ---------------------------------------------------
def ct_config(*, w4a4: bool = True, kv: bool = True) -> dict:
    args = {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "tensor_group", "group_size": 16, "dynamic": False}
    return {
        "architectures": ["LagunaForCausalLM"],
        "model_type": "laguna",
        "quantization_config": {
            "quant_method": "compressed-tensors",
            "format": "nvfp4-pack-quantized",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": args,
                    "input_activations": {**args, "dynamic": "local"} if w4a4 else None,
                }
            },
            "ignore": ["lm_head", "re:.*mlp\\.gate$"],
            "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
            if kv
            else None,
        },
    }


def write_ct(out: Path, *, w4a4: bool = True, kv: bool = True) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    tensors: dict[str, torch.Tensor] = {}
    for proj, (n, k) in {"q_proj": (64, 32), "k_proj": (32, 32), "v_proj": (32, 32)}.items():
        m = f"model.layers.0.self_attn.{proj}"
        tensors[f"{m}.weight_packed"] = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8)
        tensors[f"{m}.weight_scale"] = (torch.rand(n, k // 16, generator=gen) * 400 + 1).to(torch.float8_e4m3fn)
        tensors[f"{m}.weight_global_scale"] = torch.tensor([29952.0])
        if w4a4:
            tensors[f"{m}.input_global_scale"] = torch.tensor([568.0 + 0.1])
    if kv:
        tensors["model.layers.0.self_attn.k_scale"] = torch.tensor([0.0084228515625], dtype=torch.bfloat16)
        tensors["model.layers.0.self_attn.v_scale"] = torch.tensor([0.0030364990234375], dtype=torch.bfloat16)
    tensors["model.layers.0.mlp.gate.weight"] = torch.randn(16, 32, generator=gen).to(torch.bfloat16)
    tensors["model.layers.0.mlp.experts.e_score_correction_bias"] = torch.randn(16, generator=gen).to(torch.bfloat16)
    tensors["model.norm.weight"] = torch.ones(32, dtype=torch.bfloat16)
    tensors["lm_head.weight"] = torch.randn(64, 32, generator=gen).to(torch.bfloat16)
    dtypes = {torch.uint8: "U8", torch.float8_e4m3fn: "F8_E4M3", torch.float32: "F32", torch.bfloat16: "BF16"}
    specs = [TensorSpec(name, dtypes[t.dtype], tuple(t.shape)) for name, t in tensors.items()]
    with CheckpointWriter(out, specs, max_shard_bytes=3000) as writer:  # several shards + index
        for name, t in tensors.items():
            writer.write(name, t)
        writer.write_json("config.json", ct_config(w4a4=w4a4, kv=kv))
        writer.write_text("tokenizer.json", '{"tok": 1}\n')
        writer.write_text("chat_template.jinja", "{{ messages }}\n")
        writer.write_json("generation_config.json", {"eos_token_id": [0, 7]})
    return tensors


def test_hand_made_w4a4_kv_checkpoint(tmp_path: Path) -> None:
    src, out = tmp_path / "ct", tmp_path / "mo"
    ct = write_ct(src)
    assert (src / "model.safetensors.index.json").exists()
    assert ct_nvfp4_to_modelopt(src, out, max_shard_bytes=3000) == out
    mo = load_all(out)
    q = "model.layers.0.self_attn.q_proj"
    assert raw_bytes(mo[f"{q}.weight"]) == raw_bytes(ct[f"{q}.weight_packed"])
    assert mo[f"{q}.weight"].dtype == torch.uint8
    assert raw_bytes(mo[f"{q}.weight_scale"]) == raw_bytes(ct[f"{q}.weight_scale"])
    assert mo[f"{q}.weight_scale_2"].shape == () and mo[f"{q}.weight_scale_2"].dtype == torch.float32
    assert mo[f"{q}.weight_scale_2"] == torch.reciprocal(ct[f"{q}.weight_global_scale"])[0]
    assert mo[f"{q}.input_scale"].shape == () and mo[f"{q}.input_scale"] == torch.reciprocal(ct[f"{q}.input_global_scale"])[0]
    k_scale = mo["model.layers.0.self_attn.k_proj.k_scale"]
    assert k_scale.shape == () and k_scale.dtype == torch.float32 and k_scale == ct["model.layers.0.self_attn.k_scale"].float()[0]
    assert "model.layers.0.self_attn.v_proj.v_scale" in mo
    for name in ("model.layers.0.mlp.gate.weight", "model.layers.0.mlp.experts.e_score_correction_bias", "lm_head.weight"):
        assert raw_bytes(mo[name]) == raw_bytes(ct[name]) and mo[name].dtype == ct[name].dtype
    assert not [n for n in mo if n.endswith(("_packed", "_global_scale")) or re.search(r"self_attn\.[kv]_scale$", n)]
    assert len(mo) == len(ct)
    assert (out / "model.safetensors.index.json").exists()

    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "modelopt" and qc["quant_algo"] == "NVFP4"
    assert qc["ignore"] == ["lm_head", "model.layers.0.mlp.gate"]
    assert qc["kv_cache_scheme"] == {"dynamic": False, "num_bits": 8, "type": "float"}
    assert qc["config_groups"]["group_0"]["input_activations"]["num_bits"] == 4
    hf = json.loads((out / "hf_quant_config.json").read_text())["quantization"]
    assert hf == {"quant_algo": "NVFP4", "kv_cache_quant_algo": "FP8", "group_size": 16, "exclude_modules": qc["ignore"]}
    for name in ("tokenizer.json", "chat_template.jinja", "generation_config.json"):
        assert (out / name).read_bytes() == (src / name).read_bytes()


def test_hand_made_w4a16_checkpoint(tmp_path: Path) -> None:
    write_ct(tmp_path / "ct", w4a4=False, kv=False)
    ct_nvfp4_to_modelopt(tmp_path / "ct", tmp_path / "mo")
    mo = load_all(tmp_path / "mo")
    assert not [n for n in mo if n.endswith("input_scale") or n.endswith("k_scale")]
    qc = json.loads((tmp_path / "mo" / "config.json").read_text())["quantization_config"]
    assert qc["quant_algo"] == "W4A16_NVFP4" and "input_activations" not in qc["config_groups"]["group_0"]
    assert "kv_cache_scheme" not in qc
    hf = json.loads((tmp_path / "mo" / "hf_quant_config.json").read_text())["quantization"]
    assert hf["quant_algo"] == "W4A16_NVFP4" and hf["kv_cache_quant_algo"] is None


def test_refuses_non_nvfp4_and_existing_output(tmp_path: Path) -> None:
    write_ct(tmp_path / "ct")
    config_path = tmp_path / "ct" / "config.json"
    config = json.loads(config_path.read_text())
    config["quantization_config"]["config_groups"]["group_0"]["weights"].update(num_bits=8, strategy="channel", group_size=None)
    config_path.write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="not NVFP4"):
        ct_nvfp4_to_modelopt(tmp_path / "ct", tmp_path / "mo")
    assert not (tmp_path / "mo").exists()
    config["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "NVFP4"}
    config_path.write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="not a compressed-tensors"):
        ct_nvfp4_to_modelopt(tmp_path / "ct", tmp_path / "mo")
    write_ct(tmp_path / "ct2")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("x")
    with pytest.raises(WriteError):
        ct_nvfp4_to_modelopt(tmp_path / "ct2", tmp_path / "taken")


# -- the real llm-compressor export --------------------------------------------------------------
FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


@pytest.mark.slow
def test_lc_export_round_trips_losslessly(lc_nvfp4_kv_dir: Path, modelopt_nvfp4_kv_dir: Path) -> None:
    ct, mo = load_all(lc_nvfp4_kv_dir), load_all(modelopt_nvfp4_kv_dir)
    assert len(ct) == len(mo)
    mapped = 0
    for name, t in ct.items():
        if name.endswith(".weight_packed"):
            target = mo[name[: -len("_packed")]]
            assert target.dtype == torch.uint8 and raw_bytes(target) == raw_bytes(t), name
        elif name.endswith(("weight_global_scale", "input_global_scale")):
            new = name.replace("weight_global_scale", "weight_scale_2").replace("input_global_scale", "input_scale")
            assert mo[new].shape == () and mo[new].dtype == torch.float32
            assert within_one_ulp(modelopt_scale_to_ct_global(mo[new]), t), name
        elif m := re.fullmatch(r"(.+\.self_attn)\.([kv])_scale", name):
            target = mo[f"{m[1]}.{m[2]}_proj.{m[2]}_scale"]
            assert target.shape == () and target.dtype == torch.float32 and target == t.float()[0]
        else:
            assert mo[name].dtype == t.dtype and raw_bytes(mo[name]) == raw_bytes(t), name
        mapped += 1
    assert mapped == len(ct)

    # same weights to fp32 rounding: e2m1*s is exact in fp32; /gs and *fl(1/gs) differ by <= ~3 u
    for module in ("model.layers.1.mlp.experts.7.down_proj", "model.layers.2.self_attn.q_proj", "model.layers.3.mlp.shared_expert.up_proj"):
        a = dequant_ct(ct[f"{module}.weight_packed"], ct[f"{module}.weight_scale"], ct[f"{module}.weight_global_scale"])
        b = dequant_modelopt(mo[f"{module}.weight"], mo[f"{module}.weight_scale"], mo[f"{module}.weight_scale_2"])
        torch.testing.assert_close(b, a, rtol=2**-21, atol=0)

    # fused shards keep bit-identical scales (vLLM takes max / w1's otherwise)
    modules = {n.rpartition(".")[0] for n in mo if n.endswith(".weight_scale_2")}
    groups = 0
    for module in modules:
        parent, _, proj = module.rpartition(".")
        for group in FUSED:
            if proj == group[0] and all(f"{parent}.{p}" in modules for p in group):
                values = {mo[f"{parent}.{p}.weight_scale_2"].item() for p in group}
                assert len(values) == 1, parent
                groups += 1
    assert groups > 16 * 3  # every expert of the 3 MoE layers, plus attention and shared experts


@pytest.mark.slow
def test_lc_export_conversion_has_the_keys_vllm_requires(lc_nvfp4_kv_dir: Path, modelopt_nvfp4_kv_dir: Path) -> None:
    out = modelopt_nvfp4_kv_dir
    config = json.loads((out / "config.json").read_text())
    qc = config["quantization_config"]
    assert qc["quant_method"] == "modelopt" and qc["quant_algo"] == "NVFP4"
    assert qc["kv_cache_scheme"] == {"dynamic": False, "num_bits": 8, "type": "float"}
    group = qc["config_groups"]["group_0"]
    assert group["weights"]["group_size"] == group["input_activations"]["group_size"] == 16
    hf = json.loads((out / "hf_quant_config.json").read_text())
    assert {"group_size", "kv_cache_quant_algo", "exclude_modules", "quant_algo"} <= hf["quantization"].keys()
    assert hf["quantization"]["kv_cache_quant_algo"] == "FP8" and hf["quantization"]["group_size"] == 16
    exclude = hf["quantization"]["exclude_modules"]
    assert exclude == qc["ignore"]
    ct_ignore = json.loads((lc_nvfp4_kv_dir / "config.json").read_text())["quantization_config"]["ignore"]
    assert set(ct_ignore) <= set(exclude)

    mo = load_all(out)
    layers = config["num_hidden_layers"]

    def excluded(module: str) -> bool:  # vLLM ModelOpt: exact name or `*` wildcard, full match
        return any(fnmatch.fnmatchcase(module, pattern) for pattern in exclude)

    quantized = sorted(n[: -len(".weight")] for n, t in mo.items() if n.endswith(".weight") and t.dtype == torch.uint8)
    assert len(quantized) == 172
    for module in quantized:  # every NVFP4 Linear carries the full ModelOpt set, usable values
        assert not excluded(module), module
        assert mo[f"{module}.weight_scale"].dtype == torch.float8_e4m3fn
        assert mo[f"{module}.weight_scale"].shape[1] * 16 == mo[f"{module}.weight"].shape[1] * 2
        for scale in ("weight_scale_2", "input_scale"):
            value = mo[f"{module}.{scale}"]
            assert value.shape == () and torch.isfinite(value) and value > 0, f"{module}.{scale}"
    # every BF16 Linear that vLLM builds with the quant config is excluded: lm_head, routers, g_proj
    bf16_linears = [n[: -len(".weight")] for n, t in mo.items() if n.endswith(".weight") and t.dim() == 2 and "embed" not in n]
    assert bf16_linears and all(excluded(m) for m in bf16_linears if mo[f"{m}.weight"].dtype == torch.bfloat16)
    assert all(excluded(f"model.layers.{i}.mlp.gate") for i in range(1, layers))
    for i in range(layers):
        for kv in "kv":
            value = mo[f"model.layers.{i}.self_attn.{kv}_proj.{kv}_scale"]
            assert value.dtype == torch.float32 and value.shape == () and value > 0
    assert not [n for n in mo if n.endswith(("weight_packed", "global_scale"))]
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        assert (out / name).read_bytes() == (lc_nvfp4_kv_dir / name).read_bytes(), name
