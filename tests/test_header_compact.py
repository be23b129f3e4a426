"""The compact-layout header parser against the JSON path (its oracle): on valid headers of the
layout every writer emits, and on thousands of mutated ones, it either declines (None) or returns
exactly the columns and metadata the JSON path makes of the same text; ``parse_header`` gives the
same header or the same error either way."""

from __future__ import annotations

import json
import random

import pytest

from fp4forge.checkpoint.safetensors_format import DTYPE_BITS, _parse_header_json, encode_header, parse_compact_header, parse_header
from fp4forge.errors import Fp4forgeError

# Names that hold the layout's own fixed pieces, JSON punctuation and non-ASCII text.
NAMES = [
    "model.layers.0.mlp.experts.1.up_proj.weight",
    'x:{dtype:,shape:[1],data_offsets:[0,1]},',
    "a]},b",
    ":[0,4]},",
    "é.ünï.çødé",
    "dtype",
    "shape",
    "data_offsets",
    "",
    " spaced name ",
    "__metadata",
    "名前",
]


def _random_header(rng: random.Random) -> str:
    dtypes = [d for d in DTYPE_BITS if DTYPE_BITS[d] % 8 == 0] + ["F4"]
    entries = []
    for i in range(rng.randint(1, 6)):
        dtype = rng.choice(dtypes)
        shape = tuple(rng.choice([0, 1, 2, 3, 16, 7168]) for _ in range(rng.randint(0, 3)))
        if DTYPE_BITS[dtype] % 8 and shape and (shape[-1] * DTYPE_BITS[dtype]) % 8:
            shape = (*shape[:-1], 2)
        entries.append((rng.choice(NAMES) + str(i), dtype, shape))
    metadata = rng.choice([None, {"format": "pt"}, {"format": "pt", "k": "v,\"}"[:-2], "": ""}])
    try:
        prefix, _ = encode_header(entries, metadata)
    except Fp4forgeError:
        return '{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}'
    # as the reference (Rust) writer spells it: UTF-8 as is, no \\u escapes; padded with spaces
    text = json.dumps(json.loads(prefix[8:]), separators=(",", ":"), ensure_ascii=False)
    return text + " " * (-len(text.encode("utf-8")) % 8)


POOL = ['"', "\\", ",", ":", "{", "}", "[", "]", "0", "1", "7", "-", " ", "\n", "\x01", "é", "_", "A", "e", ".", "+", "__metadata__"]


def _mutate(rng: random.Random, text: str) -> str:
    op = rng.randrange(8)
    at = rng.randrange(len(text) + 1)
    if op == 0:
        return text[:at] + rng.choice(POOL) + text[at + 1 :]
    if op == 1:
        return text[:at] + text[at + 1 :]
    if op == 2:
        return text[:at] + rng.choice(POOL) + text[at:]
    if op == 3:  # repeat a slice (a duplicate entry, when it lines up)
        end = rng.randrange(at, len(text) + 1)
        return text[:end] + text[at:end] + text[end:]
    if op == 4:  # change one number
        digits = [i for i, c in enumerate(text) if c.isdigit()]
        if digits:
            i = rng.choice(digits)
            return text[:i] + rng.choice(["0", "9", "10", "00", "01", "4" * 30, "-1", "1.0", "1e3"]) + text[i + 1 :]
        return text
    if op == 5:  # the same document re-serialised another way (whitespace, key order)
        doc = json.loads(text)
        return json.dumps(doc, indent=rng.choice([None, 1]), sort_keys=rng.random() < 0.5)
    if op == 6:  # entries in another order (offsets no longer ascending)
        doc = json.loads(text)
        items = list(doc.items())
        rng.shuffle(items)
        return json.dumps(dict(items), separators=(",", ":"))
    return text.rstrip() + rng.choice(["", " ", "  \n", "\t", "x"])


def _json_path(text: str):
    try:
        header = _parse_header_json(text, source="h", header_len=len(text))
    except Fp4forgeError as exc:
        return type(exc), str(exc)
    return tuple(header.columns), header.metadata


def test_writer_headers_take_the_compact_path_and_match_the_json_path():
    rng = random.Random(1)
    for _ in range(300):
        text = _random_header(rng)
        compact = parse_compact_header(text)
        assert compact is not None, text
        assert (tuple(compact[0]), compact[1]) == _json_path(text), text


@pytest.mark.parametrize("seed", range(4))
def test_mutated_headers_compact_path_agrees_or_declines(seed: int):
    rng = random.Random(seed)
    taken = declined = 0
    for _ in range(1500):
        text = _random_header(rng)
        for _ in range(rng.randint(1, 3)):
            try:
                text = _mutate(rng, text)
            except (ValueError, AttributeError):  # a re-serialisation of text that is no longer an object
                break
        oracle = _json_path(text)
        compact = parse_compact_header(text)
        if compact is None:
            declined += 1
        else:
            taken += 1
            assert (tuple(compact[0]), compact[1]) == oracle, text
        raw = text.encode("utf-8", errors="surrogatepass")
        try:
            header = parse_header(raw, source="h", header_len=len(text))
            got = (tuple(header.columns), header.metadata)
        except Fp4forgeError as exc:
            got = (type(exc), str(exc))
        assert got == oracle or isinstance(got[0], type) and "UTF-8" in got[1], text
    assert taken > 50 and declined > 1000, (taken, declined)  # both paths exercised


EDGE_CASES = [
    '{"a":{"dtype":"U8","shape":[' + ",".join(["1" + "0" * 200] * 30) + '],"data_offsets":[0,1]}}',  # a span past str()'s digit limit
    '{"a":{"dtype":"U8","shape":[01],"data_offsets":[0,1]}}',
    '{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,01]}}',
    '{"a":{"dtype":"U8","shape":[-1],"data_offsets":[0,1]}}',
    '{"a":{"dtype":"U8","shape":[1.0],"data_offsets":[0,1]}}',
    '{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}',
    '{"a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]},"b":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}',
    '{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"__metadata__":{"k":"v"}}',
    '{"__metadata__":null,"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}',
    '{"__metadata__":{},"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}',
    '{"__metadata__":{"k":"v","k":"w"},"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}',
    '{"__metadata__":{"k":"v"},"__metadata__":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}',
    '{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}} ',
    '{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}\n',
    '{"a\\u0062":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}',
    '{"a\tb":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}',
    '{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1],"x":1}}',
    '{"a":{"dtype":"X9","shape":[1],"data_offsets":[0,1]}}',
    '{"a":{"dtype":"F4","shape":[3],"data_offsets":[0,1]}}',
    '{"a":{"dtype":"U8","shape":[2,3],"data_offsets":[0,6]},"b":{"dtype":"F4","shape":[],"data_offsets":[6,6]}}',
    '{"a":{"dtype":"U8","shape":[0],"data_offsets":[0,0]},"b":{"dtype":"U8","shape":[0],"data_offsets":[0,0]}}',
    '{}',
    '{"__metadata__":{"k":"v"}}',
]


@pytest.mark.parametrize("text", EDGE_CASES)
def test_edge_cases_same_header_or_same_error(text: str):
    compact = parse_compact_header(text)
    oracle = _json_path(text)
    if compact is not None:
        assert (tuple(compact[0]), compact[1]) == oracle
    try:
        header = parse_header(text.encode("utf-8"), source="h", header_len=len(text))
        got = (tuple(header.columns), header.metadata)
    except Fp4forgeError as exc:
        got = (type(exc), str(exc))
    assert got == oracle
