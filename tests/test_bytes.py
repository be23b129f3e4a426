"""`fp4forge bytes` against an independent count made with the safetensors library itself.

The independent side uses only ``safetensors.safe_open`` (dtype and shape of every tensor), the
file sizes on disk, and the documented accounting rule: a packed-FP4 ``U8`` byte holds two
parameters (CT ``weight_packed``; ModelOpt ``U8`` ``weight`` beside an ``F8_E4M3`` ``weight_scale``),
scales / global scales / KV scales hold none, every other tensor holds one per element.
"""

from __future__ import annotations

import json
import math
import re
import struct
import subprocess
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from safetensors import safe_open

from fp4forge.audit.byte_table import ByteTable, compute_byte_table
from fp4forge.checkpoint.layout import layout_for_config
from fp4forge.checkpoint.reader import open_checkpoint

DTYPE_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I32": 4, "I64": 8}
SCALE_SUFFIXES = (
    "weight_scale",
    "weight_scale_2",
    "weight_global_scale",
    "input_scale",
    "input_global_scale",
    "k_scale",
    "v_scale",
    "q_scale",
)
# Independent component rules, over full tensor names (KV scales first: they sit under self_attn).
COMPONENT_PATTERNS = {
    "kv_cache_scales": re.compile(r"^model\.layers\.\d+\.self_attn\.(?:[kv]_proj\.)?[qkv]_scale$"),
    "routed_experts": re.compile(r"^model\.layers\.\d+\.mlp\.experts\.\d+\.(?:gate|up|down)_proj\.[a-z_0-9]+$"),
    "attention": re.compile(r"^model\.layers\.\d+\.self_attn\.[qkvog]_proj\.[a-z_0-9]+$"),
}


@dataclass
class Count:
    tensors: int = 0
    bytes: int = 0
    params: int = 0


@dataclass
class Independent:
    total: Count = field(default_factory=Count)
    components: dict[str, Count] = field(default_factory=lambda: defaultdict(Count))
    dtypes: dict[str, Count] = field(default_factory=lambda: defaultdict(Count))
    data_bytes_on_disk: int = 0


def shard_files(ckpt_dir: Path) -> list[Path]:
    index = ckpt_dir / "model.safetensors.index.json"
    files = sorted(ckpt_dir.glob("*.safetensors"))
    if index.is_file():
        assert sorted(set(json.loads(index.read_text())["weight_map"].values())) == [f.name for f in files]
    return files


def independent_count(ckpt_dir: Path) -> Independent:
    entries: dict[str, tuple[str, list[int]]] = {}
    result = Independent()
    for shard in shard_files(ckpt_dir):
        with safe_open(shard, framework="pt") as fh:
            for name in fh.keys():
                tensor_slice = fh.get_slice(name)
                entries[name] = (tensor_slice.get_dtype(), list(tensor_slice.get_shape()))
        with open(shard, "rb") as raw:
            (header_len,) = struct.unpack("<Q", raw.read(8))
        result.data_bytes_on_disk += shard.stat().st_size - 8 - header_len
    for name, (dtype, shape) in entries.items():
        numel = math.prod(shape)
        nbytes = numel * DTYPE_BYTES[dtype]
        suffix = name.rpartition(".")[2]
        packed = dtype == "U8" and (
            suffix == "weight_packed"
            or (suffix == "weight" and entries.get(name[: -len("weight")] + "weight_scale", ("",))[0] == "F8_E4M3")
        )
        params = 2 * nbytes if packed else 0 if suffix in SCALE_SUFFIXES else numel
        counts = [result.total, result.dtypes[dtype]]
        component = next((c for c, pattern in COMPONENT_PATTERNS.items() if pattern.match(name)), None)
        if component is not None:
            counts.append(result.components[component])
        for count in counts:
            count.tensors += 1
            count.bytes += nbytes
            count.params += params
    return result


def byte_table(ckpt_dir: Path) -> ByteTable:
    ckpt = open_checkpoint(ckpt_dir)
    return compute_byte_table(ckpt, layout_for_config(ckpt.config))


def assert_table_matches(table: ByteTable, ind: Independent) -> None:
    assert table.unknown_tensors == []
    assert table.total_bytes == ind.total.bytes == ind.data_bytes_on_disk
    assert table.total_params == ind.total.params
    assert sum(c.tensors for c in table.components) == ind.total.tensors
    assert table.dtypes == {d: {"bytes": c.bytes, "tensors": c.tensors} for d, c in ind.dtypes.items()}
    by_name = {c.name: c for c in table.components}
    for name, count in ind.components.items():
        got = by_name[name]
        assert (got.tensors, got.bytes, got.params) == (count.tensors, count.bytes, count.params), name
        if count.params:
            assert got.bpp == count.bytes * 8 / count.params
    assert {"routed_experts", "attention"} <= set(ind.components)


def moe_linears(config: dict) -> list[tuple[int, int]]:
    """(out, in) of every routed-expert Linear, from config.json alone."""
    hidden, inter = config["hidden_size"], config["moe_intermediate_size"]
    sparse_layers = sum(1 for t in config["mlp_layer_types"] if t == "sparse")
    per_expert = [(inter, hidden), (inter, hidden), (hidden, inter)]  # gate, up, down
    return per_expert * config["num_experts"] * sparse_layers


def config_of(ckpt_dir: Path) -> dict:
    return json.loads((ckpt_dir / "config.json").read_text())


# -- BF16 ---------------------------------------------------------------------------------------
def test_bf16_tiny_laguna(lc_source_dir: Path) -> None:
    table, ind = byte_table(lc_source_dir), independent_count(lc_source_dir)
    assert_table_matches(table, ind)
    assert len(shard_files(lc_source_dir)) > 1  # the index path is exercised
    assert set(table.dtypes) == {"BF16"}
    assert table.total_bytes == 2 * table.total_params and table.bpp == 16.0
    linears = moe_linears(config_of(lc_source_dir))
    experts = {c.name: c for c in table.components}["routed_experts"]
    assert experts.params == sum(n * k for n, k in linears) and experts.bpp == 16.0


# -- llm-compressor exports ---------------------------------------------------------------------
@pytest.mark.slow
def test_lc_fp8_dynamic(lc_fp8_dynamic_dir: Path) -> None:
    table, ind = byte_table(lc_fp8_dynamic_dir), independent_count(lc_fp8_dynamic_dir)
    assert_table_matches(table, ind)
    assert set(table.dtypes) == {"BF16", "F8_E4M3"}
    # by hand: F8_E4M3 weight [N, K] (1 byte/param) + BF16 per-channel scale [N, 1]
    linears = moe_linears(config_of(lc_fp8_dynamic_dir))
    experts = {c.name: c for c in table.components}["routed_experts"]
    assert experts.bytes == sum(n * k + 2 * n for n, k in linears)
    assert experts.params == sum(n * k for n, k in linears)
    assert 8.0 < experts.bpp < 8.2


def nvfp4_expert_bytes(linears: list[tuple[int, int]], *, w4a4: bool) -> int:
    """Packed E2M1 (4 bits) + one F8_E4M3 scale per 16 (8/16 bits) per weight, plus per Linear a
    4-byte F32 weight global scale and, for W4A4, a 4-byte F32 input global scale."""
    per_linear = 4 + (4 if w4a4 else 0)
    return sum(n * k // 2 + n * k // 16 + per_linear for n, k in linears)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["compressed-tensors", "modelopt"])
def test_lc_nvfp4_w4a4(layout: str, lc_nvfp4_kv_dir: Path, request: pytest.FixtureRequest) -> None:
    ckpt_dir = lc_nvfp4_kv_dir if layout == "compressed-tensors" else request.getfixturevalue("modelopt_nvfp4_kv_dir")
    table, ind = byte_table(ckpt_dir), independent_count(ckpt_dir)
    assert_table_matches(table, ind)
    assert {"U8", "F8_E4M3", "F32", "BF16"} == set(table.dtypes)

    linears = moe_linears(config_of(ckpt_dir))
    experts = {c.name: c for c in table.components}["routed_experts"]
    assert experts.bytes == nvfp4_expert_bytes(linears, w4a4=True)
    assert experts.params == sum(n * k for n, k in linears)
    # every tiny-Laguna expert Linear has N*K = moe_intermediate * hidden, so the overhead of the
    # two F32 global scales is 64 bits over N*K params: 4 + 8/16 + 64/(N*K)
    (nk,) = {n * k for n, k in linears}
    assert experts.bpp == pytest.approx(4 + 8 / 16 + 64 / nk, rel=1e-12)
    assert abs(experts.bpp - 4.5) < 0.005

    kv = {c.name: c for c in table.components}["kv_cache_scales"]
    layers = config_of(ckpt_dir)["num_hidden_layers"]
    # CT: BF16 [1] per k/v; ModelOpt: F32 [] per k/v
    assert (kv.tensors, kv.bytes, kv.params) == (2 * layers, 2 * layers * (2 if layout == "compressed-tensors" else 4), 0)


@pytest.mark.slow
def test_cli_json_matches_independent_count(lc_nvfp4_kv_dir: Path) -> None:
    cli = Path(sys.executable).with_name("fp4forge")
    cmd = [str(cli)] if cli.exists() else [sys.executable, "-c", "from fp4forge.cli import main; main()"]
    proc = subprocess.run([*cmd, "bytes", str(lc_nvfp4_kv_dir), "--json"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    ind = independent_count(lc_nvfp4_kv_dir)
    assert doc["total"]["bytes"] == ind.total.bytes and doc["total"]["params"] == ind.total.params
    assert doc["total"]["bpp"] == pytest.approx(ind.total.bytes * 8 / ind.total.params, rel=1e-12)
    assert doc["dtypes"] == {d: {"bytes": c.bytes, "tensors": c.tensors} for d, c in ind.dtypes.items()}
    components = {c["name"]: c for c in doc["components"]}
    for name, count in ind.components.items():
        assert (components[name]["bytes"], components[name]["params"]) == (count.bytes, count.params), name
    assert doc["experts_bpp"] == components["routed_experts"]["bpp"]
    assert doc["unknown_tensors"] == []


@pytest.mark.slow
def test_ct_and_modelopt_layouts_count_the_same_parameters(lc_nvfp4_kv_dir: Path, modelopt_nvfp4_kv_dir: Path) -> None:
    ct, mo = byte_table(lc_nvfp4_kv_dir), byte_table(modelopt_nvfp4_kv_dir)
    assert ct.total_params == mo.total_params
    ct_c, mo_c = {c.name: c for c in ct.components}, {c.name: c for c in mo.components}
    assert ct_c.keys() == mo_c.keys()
    for name in ct_c:
        assert (ct_c[name].tensors, ct_c[name].params) == (mo_c[name].tensors, mo_c[name].params), name
        if name != "kv_cache_scales":  # BF16 [1] -> F32 []: 2 more bytes per KV scale
            assert ct_c[name].bytes == mo_c[name].bytes, name


def test_fast_path_prints_what_the_typer_command_prints(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """`fp4forge bytes` runs without typer for plain command lines (fp4forge.cli.fast): its JSON and
    Markdown equal the typer command's, byte for byte, and a bad path exits with the same code."""
    from typer.testing import CliRunner

    from fp4forge.checkpoint.safetensors_format import encode_header
    from fp4forge.cli import app, main

    prefix, _ = encode_header([("model.embed_tokens.weight", "BF16", (4, 2)), ("model.layers.0.mlp.experts.0.down_proj.weight", "U8", (2, 2)),
                               ("model.layers.0.mlp.experts.0.down_proj.weight_scale", "F8_E4M3", (2, 1))], None)
    (tmp_path / "model.safetensors").write_bytes(prefix + bytes(16 + 4 + 2))
    for args in (["--json"], ["--markdown"], ["--json", "--layout", "qwen3_moe"], ["--layout", "no-such-layout"]):
        typer_run = CliRunner().invoke(app, ["bytes", str(tmp_path), *args])
        monkeypatched = ["fp4forge", "bytes", str(tmp_path), *args]
        sys.argv, saved = monkeypatched, sys.argv
        try:
            main()
            code = 0
        except SystemExit as exc:
            code = exc.code
        finally:
            sys.argv = saved
        fast = capsys.readouterr()
        expected_code = typer_run.exit_code if typer_run.exception is None or isinstance(typer_run.exception, SystemExit) else typer_run.exception.exit_code
        assert code == expected_code, (args, fast.err, typer_run.output)
        if code == 0:
            assert fast.out == typer_run.stdout, args


def test_name_templates_group_names_exactly_as_their_masked_digits():
    """The joined-text masking against the per-name regex (its oracle) on names built from pieces
    that stress it: layer indices, digits next to "layers.", runs at either end, non-ASCII."""
    import random

    from fp4forge.audit.byte_table import masked_digits, name_templates

    pieces = ["model.", "layers.", "0", "12", "61", "sublayers.", "experts.", "7", "255", ".w", "x", "layers", ".", "١", "mtp"]
    rng = random.Random(3)
    for ascii_only in (True, False):
        names = ["".join(rng.choice(pieces[:-2] if ascii_only else pieces) for _ in range(rng.randint(0, 7))) for _ in range(3000)]
        keys, masked = name_templates(names), masked_digits(names)
        assert len(keys) == len(names)
        by_key = dict(zip(keys, masked))
        by_masked = dict(zip(masked, keys))
        assert all(by_key[k] == m and by_masked[m] == k for k, m in zip(keys, masked))


def test_a_layer_wide_kv_scale_is_a_kv_cache_scale() -> None:
    """AutoFP8 / AMD Quark exports of 2024 store one `self_attn.kv_scale` per layer, which vLLM's
    maybe_remap_kv_scale_name loads as the attention's k_scale (and v_scale): a KV-cache scale,
    not an unknown tensor."""
    layout = layout_for_config({"architectures": ["MixtralForCausalLM"], "model_type": "mixtral"})
    role = layout.classify("model.layers.3.self_attn.kv_scale", "F32")
    assert (role.module, role.kind, role.component) == ("model.layers.3.self_attn", "kv_scale", "kv_cache_scales")
