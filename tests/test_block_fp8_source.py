"""A block-wise FP8 release as the source of `quantize`: a tiny testbed exported in DeepSeek's FP8
layout (`quant_method: fp8`, `weight_block_size`, F8_E4M3 `<m>.weight` + F32
`<m>.weight_scale_inv`, one scale per block; a block size that does not divide the shapes) is
dequantized exactly, then quantized to NVFP4.

Oracles: the dequantization is recomputed by hand from the safetensors bytes (header parsed with
json, E4M3 decoded from its bit fields, float32 product, round-to-nearest-even to BF16 on the bit
pattern) and must match bit for bit; the NVFP4 export of the FP8 source must equal, tensor for
tensor, the export of that hand-dequantized BF16 checkpoint written out with safetensors."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from fp4forge.audit.engine import audit_checkpoint
from fp4forge.audit.options import AuditOptions
from fp4forge.checkpoint.convert import BlockFp8Source, dequantized_source
from fp4forge.checkpoint.reader import open_checkpoint
from fp4forge.errors import ConfigError
from fp4forge.numerics.fp8 import fp8_quantize_weight
from fp4forge.quantize.act_scales import ConstantAmax
from fp4forge.quantize.export import QuantizeOptions, quantize_checkpoint
from fp4forge.quantize.recipe import load_recipe

BLOCK = [48, 80]  # divides none of the testbed's shapes: partial blocks on both axes
UNQUANTIZED_LEAVES = ("gate", "lm_head", "embed_tokens")


@pytest.fixture(scope="module")
def fp8_source(tiny_qwen3_moe_dir: Path, tmp_path_factory) -> Path:
    """The tiny Qwen3-MoE testbed written as DeepSeek writes its FP8 release."""
    bf16 = tiny_qwen3_moe_dir
    out = tmp_path_factory.mktemp("blockfp8") / "fp8"
    out.mkdir()
    weight_map = {}
    for shard in sorted(bf16.glob("*.safetensors")):
        tensors = {}
        for name, tensor in load_file(shard).items():
            module = name.removesuffix(".weight")
            if name.endswith(".weight") and tensor.ndim == 2 and module.rpartition(".")[2] not in UNQUANTIZED_LEAVES:
                q = fp8_quantize_weight(tensor.to(torch.float32), "block", block_size=tuple(BLOCK))
                tensors[name] = q.weight
                tensors[f"{module}.weight_scale_inv"] = q.scale.to(torch.float32).contiguous()
            else:
                tensors[name] = tensor
        save_file(tensors, out / shard.name, metadata={"format": "pt"})
        weight_map.update({n: shard.name for n in tensors})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = json.loads((bf16 / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": BLOCK}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for extra in bf16.iterdir():
        if not extra.name.endswith(".safetensors") and not (out / extra.name).exists():
            shutil.copy(extra, out / extra.name)
    for path in out.iterdir():
        path.chmod(0o644)  # save_file writes owner-only files: a warning of its own, not this test's
    return out


# -- the oracle, by hand ----------------------------------------------------------------------------
def read_safetensors(path: Path) -> dict[str, tuple[str, list[int], bytes]]:
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    data = raw[8 + length :]
    return {n: (e["dtype"], e["shape"], data[e["data_offsets"][0] : e["data_offsets"][1]]) for n, e in header.items() if n != "__metadata__"}


def e4m3_to_float32(codes: np.ndarray) -> np.ndarray:
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exponent, mantissa = (codes >> 3) & 0xF, (codes & 0x7).astype(np.float64)
    value = np.where(exponent == 0, mantissa / 8 * 2.0**-6, (1 + mantissa / 8) * 2.0 ** (exponent.astype(np.float64) - 7))
    return (sign * value).astype(np.float32)  # exact: E4M3 values are float32 values


def float32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    bits = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)  # round to nearest, ties to even


def hand_dequantized(source: Path) -> dict[str, np.ndarray]:
    """weight name -> BF16 bit patterns of float32(code) * float32(scale_inv of its block)."""
    stored: dict[str, tuple[str, list[int], bytes]] = {}
    for shard in sorted(source.glob("*.safetensors")):
        stored.update(read_safetensors(shard))
    out = {}
    for name, (dtype, shape, data) in stored.items():
        if dtype != "F8_E4M3":
            continue
        codes = e4m3_to_float32(np.frombuffer(data, dtype=np.uint8)).reshape(shape)
        s_dtype, s_shape, s_data = stored[name.removesuffix(".weight") + ".weight_scale_inv"]
        assert s_dtype == "F32"
        scale = np.frombuffer(s_data, dtype="<f4").reshape(s_shape)
        expanded = np.repeat(np.repeat(scale, BLOCK[0], axis=0)[: shape[0]], BLOCK[1], axis=1)[:, : shape[1]]
        out[name] = float32_to_bf16_bits(codes * expanded)
    return out


def test_dequantized_source_equals_the_hand_dequantization_bit_for_bit(fp8_source):
    source = dequantized_source(open_checkpoint(str(fp8_source)))
    assert isinstance(source, BlockFp8Source) and source.block == tuple(BLOCK)
    expected = hand_dequantized(fp8_source)
    assert set(source.fp8_weights) == set(expected) and len(expected) > 50
    for name, bits in expected.items():
        got = source.read_tensor(name)
        assert got.dtype == torch.bfloat16
        assert np.array_equal(got.view(torch.int16).numpy().view(np.uint16), bits), name
        assert source.read_raw(name) == bits.tobytes()
    listed = {info.name: info for _, info in source.tensors()}
    assert not [n for n in listed if n.endswith("weight_scale_inv")]
    assert {listed[n].dtype for n in expected} == {"BF16"}
    assert "quantization_config" not in source.config


def test_quantize_from_block_fp8_equals_quantize_from_its_dequantization(fp8_source, tmp_path):
    # the hand-dequantized BF16 checkpoint, written with safetensors
    by_hand = tmp_path / "bf16-by-hand"
    shutil.copytree(fp8_source, by_hand)
    dequantized = hand_dequantized(fp8_source)
    for shard in sorted(by_hand.glob("*.safetensors")):
        tensors = load_file(shard)
        for name in list(tensors):
            if name in dequantized:
                tensors[name] = torch.from_numpy(dequantized[name].view(np.int16).copy()).view(torch.bfloat16)
            elif name.endswith(".weight_scale_inv"):
                del tensors[name]
        save_file(tensors, shard, metadata={"format": "pt"})
    index = json.loads((by_hand / "model.safetensors.index.json").read_text())
    index["weight_map"] = {n: s for n, s in index["weight_map"].items() if not n.endswith(".weight_scale_inv")}
    (by_hand / "model.safetensors.index.json").write_text(json.dumps(index))
    config = json.loads((by_hand / "config.json").read_text())
    del config["quantization_config"]
    (by_hand / "config.json").write_text(json.dumps(config, indent=2))

    options = QuantizeOptions(load_recipe("nvfp4-experts"), "compressed-tensors", act_amax=ConstantAmax(8.0))
    from_fp8 = tmp_path / "from-fp8"
    quantize_checkpoint(fp8_source, from_fp8, options)
    reference = tmp_path / "from-bf16"
    quantize_checkpoint(by_hand, reference, options)

    ours, theirs = {}, {}
    for shard in sorted(from_fp8.glob("*.safetensors")):
        ours.update(load_file(shard))
    for shard in sorted(reference.glob("*.safetensors")):
        theirs.update(load_file(shard))
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert torch.equal(ours[name].view(torch.uint8), theirs[name].view(torch.uint8)), name
    # the attention stayed unquantized under this recipe: written as the dequantized BF16
    assert ours["model.layers.0.self_attn.o_proj.weight"].dtype == torch.bfloat16
    assert any(n.endswith(".experts.0.down_proj.weight_packed") for n in ours)

    provenance = json.loads((from_fp8 / "fp4forge.json").read_text())
    assert provenance["source"]["dequantized_from"] == {"format": "fp8 block-wise", "weight_block_size": BLOCK, "weights": len(dequantized), "dequantized_to": "BF16"}
    assert "dequantized_from" not in json.loads((reference / "fp4forge.json").read_text())["source"]
    report = audit_checkpoint(str(from_fp8))
    assert not [f.rule for f in report.findings if f.severity == "error"]


def test_audit_reads_the_block_fp8_testbed(fp8_source):
    """The same testbed audits clean as block-FP8 (routers and lm_head unquantized by vLLM), and
    --deep finds every FP8 block reaching E4M3's top."""
    report = audit_checkpoint(str(fp8_source), AuditOptions(deep=True))
    assert not [f.message for f in report.findings if f.severity in ("error", "warning")]
    assert report.layout == "qwen3_moe"


def test_block_fp8_scales_that_do_not_fit_are_refused(fp8_source, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(fp8_source, broken)
    config = json.loads((broken / "config.json").read_text())
    config["quantization_config"]["weight_block_size"] = [128, 128]
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="weight_block_size"):
        dequantized_source(open_checkpoint(str(broken)))
