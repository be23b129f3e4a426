"""``NameSet.containing`` (ModelOpt's substring matching) scans only one layer's names once many
texts have been looked up; held here to the plain definition (the names holding the text, in
list order) on random names built to break the layer buckets: several ``layers.`` per name, a
layer-like run inside a longer word, digit runs that continue, non-ASCII digits, newlines."""

from __future__ import annotations

import random

import pytest

from fp4forge.checkpoint import declarations
from fp4forge.checkpoint.declarations import NameSet, match_modelopt

PIECES = ["model", "layers", "layers.", "mtp", "xlayers", "mlp", "experts", "gate_proj", "q_proj", "self_attn", "٣", "1", "12", "3", "0", "61", ".", ".", ".", "_", "layers.1", "layers.12.", "layers..3."]


def _name(rng: random.Random) -> str:
    return "".join(rng.choice(PIECES) for _ in range(rng.randint(1, 9)))


def _texts(rng: random.Random, names: list[str]) -> list[str]:
    texts = []
    for _ in range(400):
        source = rng.choice(names)
        start = rng.randint(0, len(source))
        text = source[start : start + rng.randint(0, 25)]  # a substring: hits somewhere
        if rng.random() < 0.3:
            text = _name(rng)  # anything
        if rng.random() < 0.05:
            text = text + "\n" + rng.choice(names)[:5]  # may match across two joined names
        texts.append(text)
    texts += ["", "layers.", "layers.1.", "layers.12.", "ers.3.", "layers.1", "s.61.mlp", "layers.٣."]
    return texts


def _plain(names: list[str], text: str) -> list[str]:
    return [n for n in names if text in n]


@pytest.mark.parametrize("seed", range(12))
def test_containing_is_plain_substring_matching(seed: int, monkeypatch) -> None:
    rng = random.Random(seed)
    names = [_name(rng) for _ in range(rng.randint(1, 300))]
    names += rng.sample(names, min(5, len(names)))  # repeated names keep their places
    texts = _texts(rng, names)
    bucketed = NameSet(names)
    for text in texts:
        got = bucketed.containing(text)
        if "\n" in text:  # the full scan's own answer (a match may cross from one name into the next)
            monkeypatch.setattr(declarations, "LAYER_BUCKETS_AFTER", 10**9)
            assert got == NameSet(names).containing(text), text
            monkeypatch.undo()
        else:
            assert got == _plain(names, text), text
    assert bucketed._buckets is not None  # the bucketed path ran (the assertions above cover it)


def test_layer_text_finds_names_with_other_layers_in_the_unbucketed_rest() -> None:
    names = ["model.layers.3.mlp.gate", "a.layers.1.b.layers.3.mlp.gate_proj", "model.layers.13.mlp.gate", "model.xlayers.3.mlp.gate"] * 20
    ns = NameSet(names)
    for _ in range(declarations.LAYER_BUCKETS_AFTER):
        ns.containing("nothing here")
    assert ns.containing("layers.3.mlp.gate") == [n for n in names if "layers.3.mlp.gate" in n]
    assert ns._buckets is not None and set(ns._buckets) == {"3", "13", None}


def test_modelopt_matching_of_many_exclude_entries_unchanged() -> None:
    # the shape of a ModelOpt exclude list: one entry per layer and Linear, most matching nothing
    linears = [f"model.layers.{layer}.{leaf}" for layer in range(40) for leaf in ("self_attn.q_a_proj", "self_attn.kv_b_proj", "mlp.gate_proj")]
    linears += [f"model.layers.{layer}.mlp.experts.{e}.up_proj" for layer in range(3, 40) for e in range(16)] + ["lm_head"]
    entries = [f"model.layers.{layer}.{leaf}" for layer in range(45) for leaf in ("self_attn.q_proj", "self_attn.kv_b_proj", "mlp.experts.1")] + ["lm_head", "model.layers.1*", "experts.3"]
    ns = NameSet(linears)
    for entry in entries:
        expected = [m for m in linears if entry in m] if "*" not in entry else [m for m in linears if match_modelopt(entry, m)]
        assert sorted(ns.matching(entry, match_modelopt)) == sorted(expected), entry


def test_empty_text_is_in_every_name_and_ends() -> None:
    # the scan used to loop forever on an empty text (an empty exclude entry)
    names = ["a", "b.layers.1.c", ""]
    assert NameSet(names).containing("") == names
    assert NameSet(names).matching("", match_modelopt) == names
