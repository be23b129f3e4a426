"""The export is a model repository: the card's front matter is read back by huggingface_hub's own
``ModelCard`` / ``ModelCardData`` (the oracle), and the export holds no file of the source's tooling.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from huggingface_hub import ModelCard

from fp4forge.report.card import CardOptions, write_card

FIXTURE = Path(__file__).parent / "fixtures" / "card" / "ckpt"
SOURCE_CARD = "---\nlicense: apache-2.0\ntags:\n- testbed\n---\n# the source's own card\n"


def _export_of(tmp_path: Path, location: str) -> Path:
    ckpt = tmp_path / "export"
    shutil.copytree(FIXTURE, ckpt)
    provenance = json.loads((ckpt / "fp4forge.json").read_text())
    provenance["source"]["location"] = location
    (ckpt / "fp4forge.json").write_text(json.dumps(provenance))
    return ckpt


def _source(tmp_path: Path, name_or_path: str | None = None) -> Path:
    source = tmp_path / "source"
    source.mkdir(parents=True)
    (source / "README.md").write_text(SOURCE_CARD)
    (source / "config.json").write_text(json.dumps({"_name_or_path": name_or_path} if name_or_path else {}))
    return source


def test_card_front_matter_round_trips_through_huggingface_hub(tmp_path):
    ckpt = _export_of(tmp_path, str(_source(tmp_path)))
    write_card(ckpt, CardOptions(base_model="poolside/Laguna-XS.2"))

    card = ModelCard.load(ckpt / "README.md", ignore_metadata_errors=False)
    data = card.data.to_dict()
    assert data["base_model"] == "poolside/Laguna-XS.2" and data["base_model_relation"] == "quantized"
    assert data["license"] == "apache-2.0"  # carried from the source's own card
    assert data["pipeline_tag"] == "text-generation"
    assert {"compressed-tensors", "nvfp4", "fp8", "fp8-kv-cache", "vllm"} <= set(data["tags"])
    assert card.text.lstrip().startswith("# export")
    assert "[poolside/Laguna-XS.2](https://huggingface.co/poolside/Laguna-XS.2)" in card.text


@pytest.mark.parametrize("where", ["cache-snapshot", "config-name-or-path"])
def test_base_model_comes_from_the_source_itself(tmp_path, where):
    if where == "cache-snapshot":
        source = _source(tmp_path / "hub" / "models--poolside--Laguna-XS.2" / "snapshots" / "0123abcd")
    else:
        source = _source(tmp_path, name_or_path="poolside/Laguna-XS.2")
    ckpt = _export_of(tmp_path, str(source))
    write_card(ckpt)
    assert ModelCard.load(ckpt / "README.md").data.base_model == "poolside/Laguna-XS.2"


def test_a_local_source_names_no_base_model_and_the_card_says_so(tmp_path):
    ckpt = _export_of(tmp_path, "demo/tiny-laguna")  # a relative path that looks like a repo id
    card = write_card(ckpt)
    data = ModelCard.load(ckpt / "README.md").data.to_dict()
    assert "base_model" not in data and "license" not in data
    assert "names no `base_model`" in card.markdown and "--base-model REPO_ID" in card.markdown
    assert "names no `license`" in card.markdown


def test_every_report_the_card_quotes_is_linked(tmp_path):
    ckpt = _export_of(tmp_path, "demo/tiny-laguna")
    text = write_card(ckpt).markdown
    for name in ("bytes.json", "audit.json", "shards.json", "kv.json", "serve.json", "serve-cmd.json", "bench/summary.json",
                 "quality/score.json", "fidelity.json", "calibration.json", "quantize.json"):
        assert f"[`reports/{name}`](reports/{name})" in text, name


def test_export_holds_model_repository_files_only(tmp_path):
    from fp4forge.quantize.act_scales import ConstantAmax
    from fp4forge.quantize.export import QuantizeOptions, quantize_checkpoint
    from fp4forge.quantize.recipe import load_recipe
    from fp4forge.testbed import build_tiny_laguna

    source = build_tiny_laguna(tmp_path / "src", seed=0)
    tooling = {"README.md": SOURCE_CARD, "fp4forge-training.json": "{}", "fp4forge-heldout.jsonl": "{}\n", "train.py": "print()\n"}
    for name, text in {**tooling, "LICENSE": "Apache-2.0\n"}.items():
        (source / name).write_text(text)
    out = tmp_path / "out"
    quantize_checkpoint(source, out, QuantizeOptions(load_recipe("nvfp4-experts-fp8-attn"), act_amax=ConstantAmax(8.0)))

    exported = {p.name for p in out.iterdir()}
    assert not exported & tooling.keys(), f"the export carries the source's own files: {sorted(exported & tooling.keys())}"
    # what a model repository needs besides the weights, all carried over
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "LICENSE"} <= exported
