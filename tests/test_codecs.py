"""The codec registry (checkpoint/codecs.py): every scheme of the table has every part, and the
codecs' values match hand-computed ones (docs/formats.md#nvfp4, #fp8-e4m3)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from fp4forge.checkpoint import codecs as codec_module
from fp4forge.checkpoint.codecs import EncodeOptions, Fp8Codec, Nvfp4Codec, codec, codecs, writable_schemes
from fp4forge.checkpoint.declarations import CT_FORMATS, MODELOPT_ALGOS
from fp4forge.checkpoint.schemes import LAYOUTS, scheme_table
from fp4forge.errors import ConfigError

DOCS = Path(__file__).resolve().parents[1] / "docs"
# the declaration table of each layout fp4forge writes (docs/architecture.md#a-number-format, step 3)
DECLARED = {"compressed-tensors": CT_FORMATS, "modelopt": MODELOPT_ALGOS}


def _headings(doc: Path) -> set[str]:
    from tests.test_docs_citations import anchors

    return set(anchors(doc))


def missing_parts(table: dict) -> list[str]:
    """Every part a scheme of ``table`` lacks: a codec, its roles, a declaration where fp4forge
    writes the layout, the recipe and config writers for a writable codec, a docs section."""
    from fp4forge.quantize.qconfig import ct_scheme_args
    from fp4forge.quantize.recipe import SCHEMES

    headings = _headings(DOCS / "formats.md")
    missing = []
    for layout, schemes in table.items():
        for scheme, entries in schemes.items():
            if scheme == "kv":  # the KV cache's scales: not a Linear's scheme
                continue
            where = f"{layout}.{scheme}"
            found = codecs().get(scheme)
            if found is None:
                missing.append(f"{where}: no codec registered")
                continue
            if not found.stored_roles <= {entry["role"] for entry in entries.values()}:
                missing.append(f"{where}: the table lacks roles {sorted(found.stored_roles)}")
            if layout in DECLARED and scheme not in DECLARED[layout]:
                missing.append(f"{where}: no declaration in checkpoint/declarations.py")
            if found.doc.partition("#")[2] not in headings:
                missing.append(f"{where}: no docs/formats.md section {found.doc!r}")
            if found.writable and layout == LAYOUTS[0]:
                if scheme not in SCHEMES:
                    missing.append(f"{where}: recipes do not accept it")
                try:
                    ct_scheme_args(scheme)
                except ConfigError:
                    missing.append(f"{where}: quantize/qconfig.py does not declare it")
    return missing


def test_every_scheme_in_the_table_has_every_part() -> None:
    assert missing_parts(scheme_table()) == []
    assert set(writable_schemes()) == {s for s in scheme_table()["compressed-tensors"] if s != "kv" and codec(s).writable}


def test_a_scheme_added_to_the_table_alone_is_reported() -> None:
    table = {layout: dict(schemes) for layout, schemes in scheme_table().items()}
    table["compressed-tensors"]["int4"] = {"weight_packed": {"dtype": "I8", "shape": ["out", "in"], "role": "packed"}}
    assert missing_parts(table) == ["compressed-tensors.int4: no codec registered"]


def test_a_codec_without_its_declaration_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(MODELOPT_ALGOS, "nvfp4a16")
    assert missing_parts(scheme_table()) == ["modelopt.nvfp4a16: no declaration in checkpoint/declarations.py"]


def test_an_unknown_scheme_is_a_named_error() -> None:
    with pytest.raises(ConfigError, match="no codec for quantization scheme 'int3'"):
        codec("int3")


def test_dispatch_follows_the_tables_roles() -> None:
    # static input scales where _schemes.toml stores input_scale, in either layout
    assert [s for s in writable_schemes() if codec(s).has_input_scale("compressed-tensors")] == ["nvfp4", "fp8"]
    assert not codec("fp8_dynamic").static_inputs and codec("fp8_dynamic").dynamic_activations
    assert codec_module.nvfp4_kinds(["fp8", "nvfp4a16"]) == (False, True)
    assert codec_module.layout_of_suffix("nvfp4", "global_scale", "weight_scale_2") == "modelopt"


@pytest.mark.parametrize(
    ("scheme", "layout", "amax", "dtype", "shape"),
    [
        # NVFP4: CT input_global_scale = 2688/amax [1]; ModelOpt input_scale = amax/2688 [] (both 1 at 2688)
        ("nvfp4", "compressed-tensors", 2688.0, torch.float32, (1,)),
        ("nvfp4", "modelopt", 2688.0, torch.float32, ()),
        # FP8: amax/448, BF16 [1] in compressed-tensors, F32 [] in ModelOpt
        ("fp8", "compressed-tensors", 448.0, torch.bfloat16, (1,)),
        ("fp8", "modelopt", 448.0, torch.float32, ()),
    ],
)
def test_input_scales_have_the_tables_dtype_and_shape(scheme: str, layout: str, amax: float, dtype: torch.dtype, shape: tuple) -> None:
    scale = codec(scheme).input_scale(amax, layout)
    assert scale.dtype == dtype and tuple(scale.shape) == shape and float(scale.reshape(-1)[0]) == 1.0
    assert codec(scheme).input_amax(2.0, layout) == {"nvfp4": {"compressed-tensors": 1344.0, "modelopt": 5376.0}, "fp8": {layout: 896.0}}[scheme][layout]


@pytest.mark.parametrize("layout", ["compressed-tensors", "modelopt"])
def test_nvfp4_encode_decode_and_peek_by_hand(layout: str) -> None:
    # one row, one block: amax 2688 gives the per-tensor scalar 1.0 in both conventions, block
    # scale 2688/6 = 448 (E4M3 0x7E), 2688 -> code 7 (6.0), 448 -> 448/448 = 1.0 -> code 2
    w = torch.zeros(1, 16, dtype=torch.bfloat16)
    w[0, 0], w[0, 1] = 2688.0, 448.0
    (encoded,) = codec("nvfp4").encode([w], layout, EncodeOptions())
    t = encoded.tensors
    assert t["packed"][0, 0] == 0x27 and t["block_scale"].view(torch.uint8)[0, 0] == 0x7E
    assert float(t["global_scale"].reshape(-1)[0]) == 1.0 and encoded.relative_error == 0.0
    assert torch.equal(codec("nvfp4").decode(t, layout, torch.float32), w.float())
    raw = {"packed": t["packed"].numpy().tobytes(), "block_scale": t["block_scale"].view(torch.uint8).numpy().tobytes()}
    peek = Nvfp4Codec("nvfp4").peek(raw, 1.0, layout)
    assert peek is not None and (peek.largest, peek.implied_amax, peek.family) == (2688.0, 2688.0, "nvfp4")
    # a per-tensor scalar of 4: CT divides the step by it, ModelOpt multiplies
    assert Nvfp4Codec("nvfp4").peek(raw, 4.0, layout).largest == {"compressed-tensors": 672.0, "modelopt": 10752.0}[layout]


def test_fp8_encode_decode_and_peek_by_hand() -> None:
    w = torch.tensor([[448.0, -224.0], [1.0, 0.0]], dtype=torch.bfloat16)
    (per_tensor,) = codec("fp8").encode([w], "modelopt", EncodeOptions())
    assert per_tensor.tensors["weight_scale"].dtype == torch.float32 and per_tensor.tensors["weight_scale"].shape == ()
    assert float(per_tensor.tensors["weight_scale"]) == 1.0 and per_tensor.tensors["weight"].view(torch.uint8)[0, 0] == 0x7E
    (per_channel,) = codec("fp8_dynamic").encode([w], "compressed-tensors", EncodeOptions())
    assert per_channel.tensors["weight_scale"].shape == (2, 1) and per_channel.tensors["weight_scale"].dtype == torch.bfloat16
    assert torch.equal(codec("fp8_dynamic").decode(per_channel.tensors, "compressed-tensors", torch.float32), w.float())
    peek = Fp8Codec("fp8", None, "tensor").peek({"weight": per_tensor.tensors["weight"].view(torch.uint8).numpy().tobytes()}, None, None)
    assert peek is not None and (peek.largest, peek.implied_amax) == (448.0, 448.0)


def test_fused_members_share_one_per_tensor_scale() -> None:
    big, small = torch.full((2, 16), 8.0, dtype=torch.bfloat16), torch.full((2, 16), 1.0, dtype=torch.bfloat16)
    for scheme in ("nvfp4", "fp8"):
        role = "global_scale" if scheme == "nvfp4" else "weight_scale"
        a, b = codec(scheme).encode([big, small], "compressed-tensors", EncodeOptions(error=False))
        assert torch.equal(a.tensors[role], b.tensors[role]) and a.relative_error is None


def test_read_only_codecs_refuse_to_write() -> None:
    with pytest.raises(ConfigError, match="does not write"):
        codec("fp8_block").encode([torch.ones(2, 2)], "compressed-tensors", EncodeOptions())


def test_the_audit_and_the_reader_share_one_e4m3_table() -> None:
    # the audit's peek reads E4M3 through checkpoint/raw.py's table: no copy of it elsewhere
    src = Path(__file__).resolve().parents[1] / "src" / "fp4forge"
    copies = [p.relative_to(src).as_posix() for p in src.rglob("*.py") if re.search(r"def _?\w*e4m3_table\(", p.read_text(encoding="utf-8"))]
    assert copies == ["checkpoint/raw.py"]
