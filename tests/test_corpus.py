"""Real published checkpoints (tests/corpus, see CORPUS.md), rebuilt header-only, read by `bytes`
and `audit`.

Oracles, independent of fp4forge's accounting: the real index's own metadata (total_size,
total_parameters) where the release ships one, the release's shard file sizes (Git LFS pointers
of a git clone of its Hugging Face repository: tensor bytes plus headers), parameter counts the
model card states (1.5 %), the shard and index sizes the Hub's file listing shows (three significant
digits; an index's size follows from its tensor names and its writer's JSON formatting),
and bits/param computed by hand from the config and the format's definition (FP8 block-wise:
one F32 scale per 128x128 block; MXFP4: 4-bit codes plus one 8-bit exponent per 32 values).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fp4forge.audit.byte_table import compute_byte_table
from fp4forge.audit.engine import audit_checkpoint
from fp4forge.checkpoint.layout import layout_or_inferred
from fp4forge.checkpoint.reader import open_checkpoint
from fp4forge.testbed.corpus import bf16_specs, build_header_only, build_nvfp4_export, family, load_entry, unquantized_config
from fp4forge.testbed.moe_zoo import nvfp4_modules

CORPUS = Path(__file__).parent / "corpus"
# Each builds in a few seconds; the others hold 45k-92k tensors and take 10-30 s each.
FAST = ["olmoe-1b-7b-0125-instruct", "phi-3.5-moe-instruct", "llama-4-scout-17b-16e", "glm-4.5v", "jamba-1.5-mini", "qwen2-57b-a14b", "deepseek-coder-v2-lite-instruct", "nemotron-3-nano-30b-a3b", "qwen3-30b-a3b", "wizardlm-2-8x22b", "mixtral-8x7b-instruct", "granite-3.1-1b-a400m", "qwen3.5-25b-reap-a3b", "qwen3.5-18b-reap-a3b", "gpt-oss-120b", "gpt-oss-20b", "mixtral-8x7b-instruct-awq", "mixtral-8x7b-instruct-fp8-kv", "dart-v2-moe-sft-bnb-4bit", "mixtral-8x7b-instruct-bnb-nf4", "qwen3-vl-32b-w4a16-ct"]
SLOW = ["qwen3.5-35b-a3b", "deepseek-r1-nvfp4-modelopt", "deepseek-v3-fp8", "deepseek-r1-fp8", "deepseek-v3.2-fp8", "qwen3-235b-a22b", "qwen3-next-80b-a3b", "qwen3.5-122b-a10b-fp8"]
# AutoGPTQ releases of two dense LLaMA models (3, 4 and 8 bits): their shard files are the oracle
# of the rebuild's layout (test_gptq_release_matches_its_files), the format's arithmetic that of
# their bytes (test_gptq_linears_by_hand).
GPTQ = ["wizard-vicuna-30b-gptq-4bit-128g", "wizard-vicuna-30b-gptq-8bit-128g", "wizard-vicuna-30b-gptq-3bit-128g", "mythomax-l2-13b-gptq-4bit-128g", "mythomax-l2-13b-gptq-8bit"]
FAST += GPTQ
ENTRIES = [pytest.param(name, id=name) for name in FAST] + [pytest.param(name, id=name, marks=pytest.mark.slow) for name in SLOW]


def test_every_corpus_entry_is_tested_and_documented():
    on_disk = sorted(p.name for p in CORPUS.iterdir() if p.is_dir())
    assert on_disk == sorted(FAST + SLOW)
    table = (CORPUS / "CORPUS.md").read_text(encoding="utf-8")
    for name in on_disk:
        provenance = json.loads((CORPUS / name / "PROVENANCE.json").read_text(encoding="utf-8"))
        assert provenance["files"]["config.json"]["repository"] or provenance["files"]["config.json"]["url"]
        assert f"`{name}`" in table, name


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    cache: dict[str, Path] = {}

    def build(name: str) -> Path:
        if name not in cache:
            cache[name] = build_header_only(CORPUS / name, tmp_path_factory.mktemp(name) / "ckpt")
        return cache[name]

    return build


CARD_TOLERANCE = 0.015  # a parameter count a model card rounds to 2-3 digits


def close(value: float, expected: float, rel: float = 0.01) -> bool:
    return abs(value / expected - 1) <= rel


@pytest.mark.parametrize("name", ENTRIES)
def test_bytes_reads_the_release(built, name):
    entry = load_entry(CORPUS / name)
    ckpt = open_checkpoint(str(built(name)))
    layout = layout_or_inferred(ckpt.config)
    table = compute_byte_table(ckpt, layout)
    assert not layout.inferred, f"{name}: no layout table for {ckpt.config.get('architectures')}"
    assert table.unknown_tensors == []
    if entry.index_names is not None:  # a verbatim index: the rebuild holds exactly its tensors
        rebuilt = json.loads((built(name) / "model.safetensors.index.json").read_text())["weight_map"]
        assert set(rebuilt) == set(entry.index_names)
    components = {c.name: c for c in table.components}
    card = entry.provenance.get("card") or {}
    # The real index's metadata is the release's own byte / parameter count.
    if "bytes_total" in card:
        assert table.total_bytes == card["bytes_total"]
    if "params_total" in card and "mtp" not in components:
        assert close(table.total_params, card["params_total"], CARD_TOLERANCE), (table.total_params, card["params_total"])
    if "params_text" in card:  # a vision-language card that counts its language model only
        assert close(table.total_params - components["vision"].params, card["params_text"], CARD_TOLERANCE)
    if "params_main" in card:  # DeepSeek states the trunk and the MTP module separately
        mtp = components["mtp"].params
        assert close(table.total_params - mtp, card["params_main"])
        if "params_mtp_unique" in card:
            shared = 2 * entry.config["vocab_size"] * entry.config["hidden_size"]  # its embedding + head copies
            assert close(mtp - shared, card["params_mtp_unique"])
    if "params_active" in card:  # the parameters one token runs through: all but the unchosen experts
        chosen, experts = card["active_experts"]
        routed = components["routed_experts"].params
        assert close(table.total_params - routed * (1 - chosen / experts), card["params_active"], CARD_TOLERANCE)
    if "shard_files_bytes" in card:  # the release's shard sizes (Git LFS pointers): tensors + headers
        headers = card["shard_files_bytes"] - table.total_bytes
        assert 0 < headers < 256 * sum(d["tensors"] for d in table.dtypes.values()), headers
    if "experts_bpp" in card:
        assert close(table.experts_bpp, card["experts_bpp"])
    if "shard_files_rounded" in card:  # the Hub's file listing: sizes to three significant digits
        low, high = rounded_bounds(card["shard_files_rounded"])
        assert low <= table.total_bytes <= high, (low, table.total_bytes, high)
    if "index_file_rounded" in card:  # the release's index, written with the rebuilt names
        names = json.loads((built(name) / "model.safetensors.index.json").read_text())["weight_map"]
        size = index_size(names, len(card["shard_files_rounded"]), table.total_bytes, card["index_writer"])
        low, high = rounded_bounds([card["index_file_rounded"]])
        assert low <= size <= high, (low, size, high)


UNITS = {"kB": 10**3, "MB": 10**6, "GB": 10**9}


def rounded_bounds(sizes: list[str]) -> tuple[float, float]:
    """The byte range a list of sizes shown as "4.98 GB" / "161 MB" admits: each value is rounded
    to three significant digits (half a unit of its last digit either way)."""
    low = high = 0.0
    for size in sizes:
        value, unit = size.split()
        half = 0.5 * 10 ** (math.floor(math.log10(float(value))) - 2) * UNITS[unit]
        low, high = low + float(value) * UNITS[unit] - half, high + float(value) * UNITS[unit] + half
    return low, high


def index_size(names, shards: int, total_size: int, writer: str) -> int:
    """Bytes of a model.safetensors.index.json holding ``names`` (every shard name of a
    release has the same length), as transformers writes it (indent 2, sorted keys, newline)
    or as AutoAWQ's save_quantized does (json.dumps(index, indent=4))."""
    index = {"metadata": {"total_size": total_size}, "weight_map": {n: f"model-00001-of-{shards:05d}.safetensors" for n in names}}
    text = json.dumps(index, indent=2, sort_keys=True) + "\n" if writer == "transformers" else json.dumps(index, indent=4)
    return len(text.encode())


def test_index_size_matches_a_verbatim_index():
    """The writer model reproduces a real index byte for byte (Mixtral's, 19 shards)."""
    raw = (CORPUS / "mixtral-8x7b-instruct" / "model.safetensors.index.json").read_bytes()
    index = json.loads(raw)
    assert index_size(index["weight_map"], 19, index["metadata"]["total_size"], "transformers") == len(raw)


def test_rounded_bounds_by_hand():
    low, high = rounded_bounds(["161 MB"])
    assert math.isclose(low, 160.5e6) and math.isclose(high, 161.5e6)
    low, high = rounded_bounds(["4.98 GB", "5 GB"])
    assert math.isclose(low, 9.97e9) and math.isclose(high, 9.99e9)  # 4.975-4.985 and 4.995-5.005


def _fp8_block_bpp(rows: int, cols: int, block: tuple[int, int]) -> float:
    """Bits/param of one FP8 block-wise Linear: 1 byte per weight + one F32 per block."""
    blocks = -(-rows // block[0]) * -(-cols // block[1])
    return 8 * (rows * cols + 4 * blocks) / (rows * cols)


@pytest.mark.parametrize(
    "name",
    [pytest.param("deepseek-v3-fp8", marks=pytest.mark.slow), pytest.param("qwen3.5-122b-a10b-fp8", marks=pytest.mark.slow)],
)
def test_fp8_block_experts_by_hand(built, name):
    config = json.loads((CORPUS / name / "config.json").read_text())
    text = config.get("text_config", config)
    hidden, inter = text["hidden_size"], text["moe_intermediate_size"]
    block = tuple(config["quantization_config"]["weight_block_size"])
    # gate and up are [inter, hidden], down is [hidden, inter]: same params, same block count.
    expected = _fp8_block_bpp(inter, hidden, block)
    table = compute_byte_table(open_checkpoint(str(built(name))), layout_or_inferred(config))
    assert table.experts_bpp == pytest.approx(expected, rel=1e-12)


@pytest.mark.slow
def test_modelopt_nvfp4_experts_by_hand(built):
    """NVFP4 as ModelOpt exports it: 4-bit codes, one F8 scale per 16 values, and two F32
    scalars (weight_scale_2, input_scale) per Linear."""
    config = json.loads((CORPUS / "deepseek-r1-nvfp4-modelopt" / "config.json").read_text())
    rows, cols = config["moe_intermediate_size"], config["hidden_size"]
    expected = 8 * (rows * cols / 2 + rows * cols / 16 + 8) / (rows * cols)
    table = compute_byte_table(open_checkpoint(str(built("deepseek-r1-nvfp4-modelopt"))), layout_or_inferred(config))
    assert table.experts_bpp == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("name", ["gpt-oss-120b", "gpt-oss-20b"])
def test_mxfp4_experts_by_hand(built, name):
    config = json.loads((CORPUS / name / "config.json").read_text())
    experts, hidden, inter = config["num_local_experts"], config["hidden_size"], config["intermediate_size"]
    params = bytes_ = 0
    for rows, cols in ((2 * inter, hidden), (hidden, inter)):  # gate_up, down: [out, in]
        params += experts * (rows * cols + rows)  # codes + bias
        bytes_ += experts * (rows * cols // 2 + rows * cols // 32 + 2 * rows)  # 4-bit codes, E8M0 per 32, BF16 bias
    layers = config["num_hidden_layers"]
    table = compute_byte_table(open_checkpoint(str(built(name))), layout_or_inferred(config))
    experts_row = next(c for c in table.components if c.name == "routed_experts")
    assert experts_row.params == layers * params
    assert experts_row.bytes == layers * bytes_


def _experts_row(built, name: str):
    config = json.loads((CORPUS / name / "config.json").read_text())
    table = compute_byte_table(open_checkpoint(str(built(name))), layout_or_inferred(config))
    return config, next(c for c in table.components if c.name == "routed_experts")


def test_awq_experts_by_hand(built):
    """AutoAWQ GEMM: 4-bit codes, and per group of 128 inputs one F16 scale and one 4-bit zero
    point per output (qzeros packs 8 per int32)."""
    config, row = _experts_row(built, "mixtral-8x7b-instruct-awq")
    qc = config["quantization_config"]
    bits, group = qc["bits"], qc["group_size"]
    assert row.bytes * 8 / row.params == pytest.approx(bits + 16 / group + bits / group, rel=1e-12)
    experts = config["num_hidden_layers"] * config["num_local_experts"]
    assert row.params == experts * 3 * config["hidden_size"] * config["intermediate_size"]


def test_fp8_per_tensor_experts_by_hand(built):
    """FP8 per-tensor with static activations: one byte per weight and two F32 scalars
    (weight_scale, input_scale) per expert Linear."""
    config, row = _experts_row(built, "mixtral-8x7b-instruct-fp8-kv")
    linear = config["hidden_size"] * config["intermediate_size"]
    linears = config["num_hidden_layers"] * config["num_local_experts"] * 3
    assert row.params == linears * linear
    assert row.bytes == linears * (linear + 2 * 4)


def test_bnb_4bit_experts_by_hand(built):
    """bitsandbytes 4-bit, no double quantization: half a byte per weight, one F32 absmax per
    64 weights, a 16-entry F32 code book, and the packed JSON quantization state per Linear."""
    config, row = _experts_row(built, "dart-v2-moe-sft-bnb-4bit")
    rows, cols = config["intermediate_size"], config["hidden_size"]  # every expert Linear has rows * cols weights
    linears = config["num_hidden_layers"] * config["num_local_experts"] * 3
    state = {"quant_type": "fp4", "blocksize": 64, "dtype": "float16"}
    packed = {shape: len(json.dumps({**state, "shape": list(shape)})) for shape in ((rows, cols), (cols, rows))}
    per_layer = config["num_local_experts"] * (2 * packed[(rows, cols)] + packed[(cols, rows)])
    n = rows * cols
    assert row.params == linears * n
    assert row.bytes == linears * (n // 2 + 4 * n // 64 + 4 * 16) + config["num_hidden_layers"] * per_layer


def test_bnb_4bit_double_quant_experts_by_hand(built):
    """bitsandbytes nf4 with double quantization: half a byte per weight, a U8 absmax per 64
    weights, one F32 nested absmax per 256 absmax values, two F32 code books (16 and 256
    entries) and the packed JSON state per Linear."""
    config, row = _experts_row(built, "mixtral-8x7b-instruct-bnb-nf4")
    rows, cols = config["intermediate_size"], config["hidden_size"]
    n, experts = rows * cols, config["num_hidden_layers"] * config["num_local_experts"]
    state = {"quant_type": "nf4", "blocksize": 64, "dtype": "bfloat16"}
    nested = {"nested_blocksize": 256, "nested_dtype": "float32", "nested_offset": 0.0}
    packed = sum(len(json.dumps({**state, "shape": list(shape), **nested})) for shape in ((rows, cols), (rows, cols), (cols, rows)))
    per_linear = n // 2 + n // 64 + 4 * math.ceil(n / 64 / 256) + 4 * 256 + 4 * 16
    assert row.params == experts * 3 * n
    assert row.bytes == experts * (3 * per_linear + packed)


def test_compressed_tensors_w4a16_by_hand(built):
    """compressed-tensors pack-quantized W4A16, symmetric, group 128: eight 4-bit codes per int32
    `weight_packed`, one BF16 `weight_scale` per 128 inputs, an I64 [2] `weight_shape` per Linear,
    no zero points. Every text-model Linear is quantized (the loader the config comes from expects
    7 per layer), the head and the vision tower are not."""
    name = "qwen3-vl-32b-w4a16-ct"
    entry = load_entry(CORPUS / name)
    text = entry.config["text_config"]
    group = entry.config["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"]
    ckpt = open_checkpoint(str(built(name)))
    rows = {c.name: c for c in compute_byte_table(ckpt, layout_or_inferred(ckpt.config)).components}
    hidden, inter, layers = text["hidden_size"], text["intermediate_size"], text["num_hidden_layers"]
    q, kv = text["num_attention_heads"] * text["head_dim"], text["num_key_value_heads"] * text["head_dim"]

    def linear_bytes(out: int, inp: int) -> int:
        return out * inp // 2 + 2 * out * (inp // group) + 8 * 2

    assert rows["dense_mlp"].params == layers * 3 * hidden * inter
    assert rows["dense_mlp"].bytes == layers * (2 * linear_bytes(inter, hidden) + linear_bytes(hidden, inter))
    projections = linear_bytes(q, hidden) + 2 * linear_bytes(kv, hidden) + linear_bytes(hidden, q)
    assert rows["attention"].bytes == layers * projections  # Qwen3's q_norm / k_norm count as norms
    packed = [n for n in json.loads((built(name) / "model.safetensors.index.json").read_text())["weight_map"] if n.endswith(".weight_packed")]
    assert len(packed) == entry.provenance["card"]["quantized_linears"] == 7 * layers
    assert not [n for n in packed if "visual" in n or n.startswith("lm_head")]


@pytest.mark.parametrize("name", ENTRIES)
def test_audit_reads_the_release(built, name):
    """Unmodified releases audit without errors and with every tensor placed: each finding that is
    not an info is one the corpus names, with its evidence, in PROVENANCE.json's known_findings."""
    entry = load_entry(CORPUS / name)
    report = audit_checkpoint(built(name))
    assert report.layout is not None
    known = {(k["rule"], k["severity"]): k["count"] for k in entry.provenance.get("known_findings", [])}
    found = {(f.rule, f.severity): f.count for f in report.findings if f.severity != "info"}
    assert found == known, [f.message for f in report.findings if f.severity != "info"]
    for rule in ("tensor-unexpected", "parameter-missing", "tensor-misnamed", "scheme-not-audited"):
        assert not [f for f in report.findings if f.rule == rule], rule
    if "mtp" in {c.name for c in compute_byte_table(open_checkpoint(str(built(name))), layout_or_inferred(entry.config)).components}:
        assert [f for f in report.findings if f.rule == "mtp-layers"]


def test_bytes_cli_marks_an_inferred_layout(tmp_path):
    """An architecture without a table gets a byte table from name patterns, flagged as inferred,
    instead of a refusal."""
    from fp4forge.cli import app

    entry = CORPUS / "wizardlm-2-8x22b"
    config = json.loads((entry / "config.json").read_text())
    config["architectures"], config["model_type"] = ["SomeNewMoeForCausalLM"], "mixtral"
    source = tmp_path / "entry"
    source.mkdir()
    (source / "config.json").write_text(json.dumps(config))
    (source / "model.safetensors.index.json").write_text((entry / "model.safetensors.index.json").read_text())
    out = build_header_only(source, tmp_path / "ckpt")
    config["model_type"] = "some_new_moe"  # unknown to every table
    (out / "config.json").write_text(json.dumps(config))
    result = CliRunner().invoke(app, ["bytes", str(out), "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["layout_inferred"] is True and doc["layout"].startswith("inferred")
    assert doc["unknown_tensors"] == []
    by_name = {c["name"]: c for c in doc["components"]}
    assert by_name["routed_experts"]["params"] == 56 * 8 * 3 * 6144 * 16384
    assert doc["total"]["bytes"] == 281241268224
    markdown = CliRunner().invoke(app, ["bytes", str(out), "--markdown"])
    assert markdown.exit_code == 0 and "Components inferred from tensor names (inferred (SomeNewMoeForCausalLM))" in markdown.stdout


def test_inferred_layout_on_a_real_release(tmp_path):
    """A real release whose architecture has no table (Granite-MoE with its name changed: fused 3-D
    experts `block_sparse_moe.input_linear`/`output_linear`, router `router.layer`) gets a complete
    byte table from the inferred patterns, flagged as inferred, not a refusal."""
    from fp4forge.cli import app

    config = json.loads((CORPUS / "granite-3.1-1b-a400m" / "config.json").read_text())
    out = build_header_only(CORPUS / "granite-3.1-1b-a400m", tmp_path / "ckpt")
    config["architectures"], config["model_type"] = ["SomeNewMoeForCausalLM"], "some_new_moe"
    (out / "config.json").write_text(json.dumps(config))
    result = CliRunner().invoke(app, ["bytes", str(out), "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["layout_inferred"] is True and doc["unknown_tensors"] == []
    by_name = {c["name"]: c for c in doc["components"]}
    experts, hidden, inter, layers = config["num_local_experts"], config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    assert by_name["routed_experts"]["params"] == layers * experts * 3 * hidden * inter  # input_linear [E, 2I, H] + output_linear [E, H, I]
    assert by_name["router"]["params"] == layers * experts * hidden
    assert doc["total"]["params"] == 1334628352  # the release's F32 index: total_size / 4


# One release per architecture family (the first in FAST, else in SLOW, for each family).
def _representatives() -> list:
    seen: dict[str, object] = {}
    for param in ENTRIES:
        name = param.values[0]
        seen.setdefault(family(load_entry(CORPUS / name)), param)
    return list(seen.values())


REPRESENTATIVES = _representatives()
MIN_FAMILIES = 16  # issue #34 asks for 15 real families


def test_corpus_spans_the_families():
    families = {family(load_entry(CORPUS / p.values[0])) for p in ENTRIES}
    assert len(families) >= MIN_FAMILIES, sorted(families)
    table = (CORPUS / "CORPUS.md").read_text(encoding="utf-8")
    assert f"{len(families)} architecture families" in table


def _misstored_target(entry, kind: str) -> str:
    """A projection the NVFP4 export quantizes: an attention projection outside every fused group
    (o_proj and its spellings), or a routed-expert projection."""
    config = unquantized_config(entry.config)
    layout = layout_or_inferred(config)
    fused = {leaf for members in layout.fused.values() for leaf in members}
    modules = nvfp4_modules(config, bf16_specs(entry))
    if kind == "attention":
        return next(m for m in modules if layout.component_of(m) == "attention" and m.rpartition(".")[2] not in fused)
    return next(m for m in modules if layout.component_of(m) == "routed_experts")


def _has_target(name: str, kind: str) -> bool:
    try:
        _misstored_target(load_entry(CORPUS / name), kind)
    except StopIteration:
        return False
    return True


# The attention variant runs on every family by default; the expert variant adds a second
# projection kind and runs with the slow tests, on the families whose experts are 2-D Linears
# (GPT-OSS's and Granite's are fused 3-D parameters, which no NVFP4 export quantizes per Linear).
PLANTED_CASES = [pytest.param(p.values[0], "attention", marks=p.marks) for p in REPRESENTATIVES] + [
    pytest.param(p.values[0], "routed_experts", marks=[*p.marks, pytest.mark.slow])
    for p in REPRESENTATIVES if _has_target(p.values[0], "routed_experts")]


def test_every_family_has_a_plantable_attention_projection():
    assert all(_has_target(p.values[0], "attention") for p in REPRESENTATIVES)


@pytest.mark.parametrize(("name", "kind"), PLANTED_CASES)
def test_planted_misstored_projection_is_an_error(tmp_path, name, kind):
    """Each family's release as a ModelOpt NVFP4 export with one projection stored BF16 under the
    NVFP4 declaration: an audit error naming that tensor, with the architecture's layout and with
    the architecture renamed (no table: the layout inferred from names); without the defect, none."""
    entry = load_entry(CORPUS / name)
    target = _misstored_target(entry, kind)
    clean = audit_checkpoint(build_nvfp4_export(entry, tmp_path / "clean"))
    assert [f.message for f in clean.findings if f.severity == "error"] == []
    out = build_nvfp4_export(entry, tmp_path / "planted", keep_bf16=target)
    for renamed in (False, True):
        if renamed:
            config = json.loads((out / "config.json").read_text())
            config.update(model_type="some_remote_moe", architectures=["SomeRemoteMoeForCausalLM"])
            if isinstance(config.get("text_config"), dict):  # a wrapper's text type names a table too
                config["text_config"]["model_type"] = "some_remote_moe_text"
            (out / "config.json").write_text(json.dumps(config))
        report = audit_checkpoint(out)
        assert (report.layout or "").startswith("inferred") == renamed, report.layout
        errors = [f for f in report.findings if f.severity == "error" and f.rule == "module-not-quantized"]
        assert any(f"{target}.weight" in f.tensors for f in errors), (renamed, [f.message for f in report.findings])


def test_inferred_layout_places_a_hybrid_mixers_attention():
    """Nemotron-H names every layer's block `mixer`: Mamba-2 on most layers, attention on some. The
    inferred layout keeps the attention projections attention Linears (so a BF16 one under an NVFP4
    declaration is found without a table) and the Mamba block linear attention."""
    from fp4forge.checkpoint.layout import infer_layout

    layout = infer_layout({"model_type": "some_remote_moe"})
    for leaf in ("q_proj", "k_proj", "v_proj", "o_proj"):
        assert layout.component_of(f"backbone.layers.5.mixer.{leaf}") == "attention"
    for leaf in ("in_proj", "out_proj", "conv1d", "dt_bias"):
        assert layout.component_of(f"backbone.layers.0.mixer.{leaf}") == "linear_attention"
    assert layout.component_of("backbone.layers.1.mixer.experts.0.up_proj") == "routed_experts"


def _stored_tensors(checkpoint: Path) -> dict[str, dict]:
    """Every tensor's header entry, read from the safetensors files themselves (8-byte length +
    JSON), not through fp4forge's reader."""
    entries: dict[str, dict] = {}
    for shard in checkpoint.glob("*.safetensors"):
        with shard.open("rb") as handle:
            length = int.from_bytes(handle.read(8), "little")
            header = json.loads(handle.read(length))
        entries.update({k: v for k, v in header.items() if k != "__metadata__"})
    return entries


@pytest.mark.parametrize("name", GPTQ)
def test_gptq_release_matches_its_files(tmp_path, name):
    """A GPTQ release rebuilt in AutoGPTQ's layout: its tensors fill the release's shard file but
    for its safetensors header (Git LFS pointer size), its declaration in config.json is its
    quantize_config.json, and a Linear's parameters have the shapes vLLM's GPTQ method creates
    (pack factor 32 // bits; written out here from vLLM's `create_weights`)."""
    entry = load_entry(CORPUS / name)
    assert entry.config["quantization_config"]["quant_method"] == "gptq"
    sidecar = json.loads((CORPUS / name / "quantize_config.json").read_text(encoding="utf-8"))
    assert {k: v for k, v in entry.config["quantization_config"].items() if k != "quant_method"} == sidecar
    stored = _stored_tensors(build_header_only(entry, tmp_path / "ckpt"))
    tensor_bytes = sum(t["data_offsets"][1] - t["data_offsets"][0] for t in stored.values())
    headers = entry.provenance["card"]["shard_files_bytes"] - tensor_bytes
    assert 0 < headers < 256 * len(stored), headers
    bits, group, hidden = sidecar["bits"], sidecar["group_size"], entry.config["hidden_size"]
    down = "model.layers.0.mlp.down_proj"
    inter = stored[f"{down}.g_idx"]["shape"][0]
    assert inter == entry.config["intermediate_size"]
    if bits in (4, 8):  # the widths vLLM's GPTQ methods accept
        pack, groups = 32 // bits, 1 if group == -1 else inter // group
        assert stored[f"{down}.qweight"]["shape"] == [inter // pack, hidden]
        assert stored[f"{down}.qzeros"]["shape"] == [groups, hidden // pack]
        assert stored[f"{down}.scales"]["shape"] == [groups, hidden]
    assert "lm_head.weight" in stored and "lm_head.qweight" not in stored


def _gptq_linear(rows: int, cols: int, bits: int, group: int) -> tuple[int, int]:
    """(parameters, bytes) of one AutoGPTQ Linear [out = rows, in = cols], from the format's
    definition: `bits` per weight packed in int32 along the input, per group of the input one F16
    scale and one `bits`-wide zero point per output, an I32 `g_idx` per input, and the F16 zero
    `bias` [out] AutoGPTQ stores (counted as its parameters, as every stored bias is)."""
    groups = 1 if group == -1 else cols // group
    bits_total = rows * cols * bits + groups * rows * (16 + bits) + cols * 32 + rows * 16
    return rows * cols + rows, bits_total // 8


@pytest.mark.parametrize("name", GPTQ)
def test_gptq_linears_by_hand(built, name):
    """The decoder's Linears of each GPTQ release: parameters and bytes equal the hand count from
    the config and the declaration (3 bits too, whose values straddle int32s)."""
    config = json.loads((CORPUS / name / "config.json").read_text())
    qc, hidden, inter = config["quantization_config"], config["hidden_size"], config["intermediate_size"]
    attention = [_gptq_linear(hidden, hidden, qc["bits"], qc["group_size"])] * 4  # LLaMA: q, k, v, o of hidden x hidden
    mlp = [_gptq_linear(inter, hidden, qc["bits"], qc["group_size"])] * 2 + [_gptq_linear(hidden, inter, qc["bits"], qc["group_size"])]
    table = compute_byte_table(open_checkpoint(str(built(name))), layout_or_inferred(config))
    by_name = {c.name: c for c in table.components}
    layers = config["num_hidden_layers"]
    for component, linears in (("attention", attention), ("dense_mlp", mlp)):
        assert by_name[component].params == layers * sum(p for p, _ in linears), component
        assert by_name[component].bytes == layers * sum(b for _, b in linears), component


def test_gptq_awq_hand_entries_are_what_vllms_data_lacks():
    """Why the GPTQ / AWQ builder keeps hand entries beside vLLM's parameter data: vLLM creates no
    `g_idx` or `bias` parameter (its loader drops `g_idx` and skips an unexpected bias), so their
    shapes are AutoGPTQ's; and a declaration vLLM refuses (act order with groups, 3 bits) is built
    from an accepted one, which the data bears out: within a method, bit width and group size, act
    order and symmetry change no shape, and rescaling the int32-packed dimensions takes one
    accepted width to the other (4 -> 8 bits)."""
    from fractions import Fraction

    from fp4forge.checkpoint.vllm_params import gptq_key, quant_params_data, scheme_args, scheme_params, tensors_of
    from fp4forge.testbed.corpus import _rescaled_packing

    def shapes(params):
        return {t.suffix: t.shape for t in tensors_of(params, 4096, 1024)}

    variants: dict[tuple, list] = {}
    for key, entry in quant_params_data()["schemes"].items():
        args = scheme_args(key)
        if args.get("method") in ("gptq", "awq") and "params" in entry:
            assert not {p["name"] for p in entry["params"]} & {"g_idx", "bias"} and "g_idx" in entry["discarded"], key
            variants.setdefault((args["method"], args["bits"], args["group_size"]), []).append(entry["params"])
    assert all(shapes(p) == shapes(same[0]) for same in variants.values() for p in same)
    for group in (32, 64, 128, -1):
        assert shapes(_rescaled_packing(variants[("gptq", 4, group)][0], Fraction(8, 4))) == shapes(variants[("gptq", 8, group)][0])
    refused = [load_entry(CORPUS / n).config["quantization_config"] for n in ("wizard-vicuna-30b-gptq-3bit-128g", "wizard-vicuna-30b-gptq-4bit-128g")]
    assert [scheme_params(gptq_key(qc)) for qc in refused] == [None, None]  # the fallback is what builds them


def test_bnb_state_names_are_transformers(monkeypatch):
    """bitsandbytes state tensors are named by transformers' serialized_names (the data), those of
    one save chosen by its quant type and double quantization; their sizes (not in the data) are
    bitsandbytes' QuantState's, and a name transformers adds that the builder cannot size is
    refused by name rather than left out."""
    import copy

    from fp4forge.checkpoint.writer import TensorSpec
    from fp4forge.errors import ConfigError
    from fp4forge.testbed import corpus

    assert corpus._bnb4_state_names("nf4", True) == ["weight.absmax", "weight.nested_absmax", "weight.nested_quant_map",
                                                     "weight.quant_map", "weight.quant_state.bitsandbytes__nf4"]
    assert corpus._bnb4_state_names("fp4", False) == ["weight.absmax", "weight.quant_map", "weight.quant_state.bitsandbytes__fp4"]
    names = copy.deepcopy(corpus.bnb_serialized_names())
    names["4bit"]["weight"].append("weight.code_offsets")
    monkeypatch.setattr(corpus, "bnb_serialized_names", lambda: names)
    with pytest.raises(ConfigError, match="weight.code_offsets"):
        corpus._bnb4_specs([TensorSpec("model.layers.0.mlp.down_proj.weight", "BF16", (64, 128))], {"bnb_4bit_quant_type": "nf4"})
