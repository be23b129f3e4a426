"""Malformed checkpoints made from valid ones, for the reliability suite.

Shared by tests/test_reliability_fuzz.py (hypothesis drives ``rng``, a few hundred inputs) and
benchmarks/bench_reliability.py (a seeded ``random.Random``, thousands). Every mutation starts
from a valid file written by the ``safetensors`` library itself and returns the damaged bytes and
a label naming what was done. Whether a damaged shard is still valid is not decided here: the
``safetensors`` library is the oracle (:func:`reference_accepts`), because some mutations (a
flipped data byte, header padding) leave a file that is perfectly loadable.
"""

from __future__ import annotations

import json
import os
import random
import struct
from collections.abc import Callable
from pathlib import Path

import numpy as np

INDEX = "model.safetensors.index.json"
SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
# Mixed dtypes, a zero-size tensor, and names as real checkpoints spell them.
BASE_TENSORS: tuple[dict[str, np.ndarray], ...] = (
    {
        "model.embed_tokens.weight": np.arange(32, dtype=np.float16).reshape(8, 4),
        "model.layers.0.mlp.gate_proj.weight_packed": np.arange(8, dtype=np.uint8).reshape(4, 2),
        "model.layers.0.mlp.gate_proj.weight_global_scale": np.array([448.0], dtype=np.float32),
    },
    {
        "model.layers.0.self_attn.q_proj.weight": np.ones((4, 4), dtype=np.float32),
        "model.layers.0.self_attn.k_scale": np.array([3], dtype=np.int64),
        "model.norm.weight": np.zeros((0,), dtype=np.float32),
    },
)
BASE_CONFIG = {"architectures": ["LagunaForCausalLM"], "model_type": "laguna", "num_hidden_layers": 1, "hidden_size": 4}

# Strings that are not safetensors dtypes (some are spelled like ones that are).
UNKNOWN_DTYPES = ["F8", "BF8", "f32", "", "Q4_K", "F4_E2M1", "INT4", "float32", "F32 ", "bf16", "U4", "F128"]
NOT_STRINGS = [None, 32, 1.5, True, ["F32"], {"dtype": "F32"}]
HUGE_INTS = [2**31, 2**32 + 1, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 2**64 + 7, 10**30]
NOT_COUNTS = [-1, -(2**63), 1.0, 4.5, "4", None, True, False, [4], {}]
NOT_OBJECTS = [[], [1, 2], "header", 7, 1.5, None, True]
BAD_METADATA = [[], "", 0, False, {"a": 1}, {"a": None}, {"a": {"b": "c"}}, {"a": ["b"]}, {"a": True}]
BAD_UTF8 = [b"\xff", b"\xfe\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xc0\xaf", b"\xf8\x88\x80\x80\x80", b"\x80", b"\xe2\x82"]
TRAVERSALS = [
    "../model-00001-of-00002.safetensors", "/etc/passwd", "sub/../../model.safetensors", "..", "", "/",
    "C:\\model.safetensors", "c:/model.safetensors", "\\\\server\\share\\m.safetensors", "a//b.safetensors",
    "../../../../../../etc/shadow", "sub/..", "model-00001-of-00002.safetensors/..",
]


# -- valid starting points (written by the reference library) -------------------------------------
def write_base_checkpoint(directory: Path) -> Path:
    """Two shards, an index and a config, every byte written by ``safetensors`` and ``json``."""
    from safetensors.numpy import save_file

    directory.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for shard, tensors in zip(SHARDS, BASE_TENSORS):
        save_file(dict(tensors), str(directory / shard), metadata={"format": "pt"})
        weight_map.update({name: shard for name in tensors})
    total = sum(t.nbytes for tensors in BASE_TENSORS for t in tensors.values())
    (directory / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    (directory / "config.json").write_text(json.dumps(BASE_CONFIG, indent=2))
    return directory


def split_shard(data: bytes) -> tuple[dict, bytes, bytes]:
    """(header document, raw header bytes, byte buffer) of a valid shard."""
    (length,) = struct.unpack("<Q", data[:8])
    raw = data[8 : 8 + length]
    return json.loads(raw), raw, data[8 + length :]


def join_shard(header: bytes, buffer: bytes) -> bytes:
    return struct.pack("<Q", len(header)) + header + buffer


# -- shard mutations -------------------------------------------------------------------------------
def _tensor_names(doc: dict) -> list[str]:
    return [k for k in doc if k != "__metadata__"]


def _header_text_mutation(rng: random.Random, doc: dict) -> tuple[str, str]:
    """A header document (or its text) changed in one way a damaged or hostile file could be."""
    names = _tensor_names(doc)
    name = rng.choice(names)
    entry = doc[name]
    kind = rng.choice([
        "dtype-unknown", "dtype-not-string", "shape-mismatch", "shape-not-counts", "shape-huge", "offsets-overlap",
        "offsets-gap", "offsets-out-of-range", "offsets-reversed", "offsets-not-counts", "offsets-huge", "offsets-swapped",
        "entry-missing-key", "entry-extra-key", "entry-not-object", "metadata-bad", "top-not-object", "duplicate-key",
        "deep-nesting", "huge-int-text", "lone-surrogate", "float-special", "padding", "reordered", "renamed",
    ])
    text: str | None = None
    if kind == "dtype-unknown":
        entry["dtype"] = rng.choice(UNKNOWN_DTYPES)
    elif kind == "dtype-not-string":
        entry["dtype"] = rng.choice(NOT_STRINGS)
    elif kind == "shape-mismatch":
        shape = list(entry["shape"])
        choice = rng.randrange(3)
        if choice == 0 and shape:
            i = rng.randrange(len(shape))
            shape[i] = max(0, shape[i] + rng.choice([-2, -1, 1, 2, 3]))
        elif choice == 1:
            shape.append(rng.choice([0, 2, 3]))
        else:
            shape = shape[1:] if shape else [1]
        entry["shape"] = shape
    elif kind == "shape-not-counts":
        entry["shape"] = rng.choice([[rng.choice(NOT_COUNTS)], rng.choice(NOT_COUNTS), [[4]], "4"])
    elif kind == "shape-huge":
        entry["shape"] = [rng.choice(HUGE_INTS)] + list(entry["shape"])[1:]
    elif kind in ("offsets-overlap", "offsets-gap"):
        begin, end = entry["data_offsets"]
        delta = rng.randint(1, 16) * (-1 if kind == "offsets-overlap" else 1)
        entry["data_offsets"] = [max(0, begin + delta), max(0, end + delta)]
    elif kind == "offsets-out-of-range":
        begin, end = entry["data_offsets"]
        extra = rng.choice([1, 8, 4096, 2**40])
        entry["data_offsets"] = [begin + extra, end + extra]
    elif kind == "offsets-reversed":
        begin, end = entry["data_offsets"]
        entry["data_offsets"] = [end, begin] if end != begin else [begin + 1, begin]
    elif kind == "offsets-not-counts":
        bad = rng.choice(NOT_COUNTS)
        entry["data_offsets"] = rng.choice([[bad, entry["data_offsets"][1]], [entry["data_offsets"][0], bad], [0], [0, 1, 2], bad, {"begin": 0}])
    elif kind == "offsets-huge":
        big = rng.choice(HUGE_INTS)
        entry["data_offsets"] = rng.choice([[0, big], [big, big], [big, big + entry["data_offsets"][1] - entry["data_offsets"][0]]])
    elif kind == "offsets-swapped":
        other = doc[rng.choice(names)]
        entry["data_offsets"], other["data_offsets"] = other["data_offsets"], entry["data_offsets"]
    elif kind == "entry-missing-key":
        del entry[rng.choice(["dtype", "shape", "data_offsets"])]
    elif kind == "entry-extra-key":
        entry[rng.choice(["offsets", "dtype2", "", "__metadata__"])] = rng.choice([0, "x", None, []])
    elif kind == "entry-not-object":
        doc[name] = rng.choice(NOT_OBJECTS)
    elif kind == "metadata-bad":
        doc["__metadata__"] = rng.choice(BAD_METADATA)
    elif kind == "top-not-object":
        text = json.dumps(rng.choice(NOT_OBJECTS + [list(doc.values())]))
    elif kind == "duplicate-key":
        body = json.dumps(doc)
        key = rng.choice(names + ["__metadata__"])
        value = json.dumps(doc.get(key, {}) if rng.random() < 0.5 else doc[name])
        text = "{" + json.dumps(key) + ":" + value + "," + body[1:]
    elif kind == "deep-nesting":
        depth = rng.choice([50, 1000, 5000, 100_000])
        text = rng.choice(["[" * depth + "]" * depth, '{"a":' * depth + "1" + "}" * depth,
                           json.dumps(doc)[:-1] + ',"z":' + "[" * depth + "]" * depth + "}"])
    elif kind == "huge-int-text":
        digits = rng.choice([20, 400, 4301, 5000, 20000])
        body = json.dumps(doc)
        needle = json.dumps(entry["data_offsets"]) if rng.random() < 0.5 else json.dumps(entry["shape"])
        text = body.replace(needle, "[" + "9" * digits + "]", 1)
    elif kind == "lone-surrogate":
        body = json.dumps(doc)
        text = body.replace(json.dumps(name), json.dumps(name)[:-1] + rng.choice(["\\ud800", "\\udfff", "\\ud83d"]) + '"', 1)
    elif kind == "float-special":
        body = json.dumps(doc)
        needle = json.dumps(entry["shape"])
        special = rng.choice(["NaN", "Infinity", "-Infinity", "1e400", "4.0", "-0", "4e0", "0x4"])
        text = body.replace(needle, "[" + special + "]", 1)
        if special == "-0":
            kind = "negative-zero"
    elif kind == "padding":  # valid: whitespace around the JSON, as writers pad to 8 bytes
        text = rng.choice([" ", "\n", "\t", "\r\n", "        "]) * rng.randint(0, 3) + json.dumps(doc) + " " * rng.randint(0, 9)
    elif kind == "reordered":  # valid: key order carries no meaning
        items = list(doc.items())
        rng.shuffle(items)
        text = json.dumps(dict(items), indent=rng.choice([None, 1]))
    elif kind == "renamed":
        doc[rng.choice(["", "x" * 300, "a\u0000b", "é", "model.layers.0.mlp.gate_proj.weight_packed\n"])] = doc.pop(name)
    return kind, json.dumps(doc) if text is None else text


def mutate_shard(rng: random.Random, data: bytes) -> tuple[bytes, str]:
    """A damaged or hostile copy of the valid shard ``data``, and a label for what was done."""
    doc, raw, buffer = split_shard(data)
    kind = rng.choice([
        "truncate", "extend", "prefix-random", "prefix-delta", "prefix-huge", "header-byteflip", "header-bad-utf8",
        "header-random", "header-json", "header-json", "header-json", "header-json", "data-byteflip", "empty-file",
        "lfs-pointer", "prefix-only",
    ])
    if kind == "truncate":
        return data[: rng.randrange(len(data))], kind
    if kind == "extend":
        return data + bytes(rng.randrange(256) for _ in range(rng.randint(1, 64))), kind
    if kind == "prefix-random":
        return bytes(rng.randrange(256) for _ in range(8)) + data[8:], kind
    if kind == "prefix-delta":
        return struct.pack("<Q", len(raw) + rng.choice([-9, -8, -2, -1, 1, 2, 8, 9])) + data[8:], kind
    if kind == "prefix-huge":
        length = rng.choice([len(data) - 7, len(data), 100_000_000, 100_000_001, 2**32, 2**63, 2**64 - 1])
        return struct.pack("<Q", length) + data[8:], kind
    if kind == "header-byteflip":
        damaged = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            damaged[8 + rng.randrange(len(raw))] ^= 1 << rng.randrange(8)
        return bytes(damaged), kind
    if kind == "header-bad-utf8":
        at = rng.randrange(len(raw) + 1)
        return join_shard(raw[:at] + rng.choice(BAD_UTF8) + raw[at:], buffer), kind
    if kind == "header-random":
        return join_shard(bytes(rng.randrange(256) for _ in range(rng.randint(0, 2 * len(raw)))), buffer), kind
    if kind == "header-json":
        what, text = _header_text_mutation(rng, doc)
        return join_shard(text.encode("utf-8", errors="surrogatepass"), buffer), f"header-json/{what}"
    if kind == "data-byteflip":  # valid: the header does not checksum the data
        if not buffer:
            return data, kind
        damaged = bytearray(data)
        damaged[8 + len(raw) + rng.randrange(len(buffer))] ^= 0xFF
        return bytes(damaged), kind
    if kind == "empty-file":
        return b"", kind
    if kind == "lfs-pointer":
        return f"version https://git-lfs.github.com/spec/v1\noid sha256:{'ab' * 32}\nsize {len(data)}\n".encode(), kind
    return data[:8], kind  # prefix-only


# -- index mutations -------------------------------------------------------------------------------
def _damaged_text(rng: random.Random, text: str, kind: str) -> bytes | None:
    """The byte-level damages every JSON file gets alike (None: ``kind`` is not one of them)."""
    if kind == "garbage":
        return bytes(rng.randrange(256) for _ in range(rng.randint(0, 200)))
    if kind == "truncated":
        return text.encode()[: rng.randrange(len(text))]
    if kind == "bad-utf8":
        raw = text.encode()
        at = rng.randrange(len(raw) + 1)
        return raw[:at] + rng.choice(BAD_UTF8) + raw[at:]
    return None


def mutate_index(rng: random.Random, text: str) -> tuple[bytes, str]:
    """A damaged or hostile copy of a valid ``model.safetensors.index.json``."""
    doc = json.loads(text)
    names = sorted(doc["weight_map"])
    name = rng.choice(names)
    kind = rng.choice([
        "garbage", "truncated", "bad-utf8", "empty", "lfs-pointer", "deep-nesting", "huge-int-text", "not-object",
        "weight-map-missing", "weight-map-wrong-type", "value-not-string", "traversal", "traversal", "missing-shard",
        "metadata-wrong-type", "total-size-bad", "total-size-odd", "misrouted", "extra-keys", "lone-surrogate",
    ])
    damaged = _damaged_text(rng, text, kind)
    if damaged is not None:
        return damaged, kind
    if kind == "empty":
        return b"", kind
    if kind == "lfs-pointer":
        return f"version https://git-lfs.github.com/spec/v1\noid sha256:{'cd' * 32}\nsize 1234\n".encode(), kind
    if kind == "deep-nesting":  # 100,000 levels: past any JSON reader's recursion; 500 is merely odd
        depth = rng.choice([500, 100_000])
        return (text.rstrip()[:-1] + ',"x":' + "[" * depth + "]" * depth + "}").encode(), kind if depth > 500 else "nested-extra-key"
    if kind == "huge-int-text":
        return json.dumps({**doc, "metadata": {"total_size": 0}}).replace('"total_size": 0', '"total_size": ' + "7" * rng.choice([30, 5000])).encode(), kind
    if kind == "lone-surrogate":
        return json.dumps(doc).replace(json.dumps(name), json.dumps(name)[:-1] + '\\udc80"', 1).encode(), kind
    if kind == "not-object":
        doc = rng.choice(NOT_OBJECTS)
    elif kind == "weight-map-missing":
        del doc["weight_map"]
    elif kind == "weight-map-wrong-type":
        doc["weight_map"] = rng.choice(NOT_OBJECTS)
    elif kind == "value-not-string":
        doc["weight_map"][name] = rng.choice(NOT_STRINGS)
    elif kind == "traversal":
        doc["weight_map"][name] = rng.choice(TRAVERSALS)
    elif kind == "missing-shard":
        doc["weight_map"][name] = rng.choice(["model-00003-of-00002.safetensors", "sub/model.safetensors", "model.safetensors"])
    elif kind == "metadata-wrong-type":
        doc["metadata"] = rng.choice([[], "x", 5, True])
    elif kind == "total-size-bad":
        doc["metadata"]["total_size"] = rng.choice([-1, "12", 1.5, True, [], {}])
    elif kind == "total-size-odd":  # readable: absent or implausible sizes are the audit's to report
        doc["metadata"]["total_size"] = rng.choice([None, 0, 2**70])
    elif kind == "misrouted":  # the named shard exists but lacks the tensor: readable, an audit finding
        doc["weight_map"][name] = next(s for s in SHARDS if s != doc["weight_map"][name])
    elif kind == "extra-keys":
        doc[rng.choice(["format", "__metadata__", ""])] = rng.choice([1, "x", None, {"a": [1]}])
    return json.dumps(doc).encode(), kind


# Shard mutations the safetensors library reads and fp4forge refuses on purpose: a name stored
# twice (the reference keeps the last; other JSON readers keep the first, so two tools would load
# different tensors) and an entry with keys beyond dtype/shape/data_offsets (ignored by the
# reference; fp4forge reads the header as the strict schema it is).
STRICTER_THAN_REFERENCE = {"header-json/duplicate-key", "header-json/entry-extra-key"}
# ... and the one it reads where the reference refuses: a dimension spelled ``-0`` (valid JSON for
# the integer 0; Rust's usize parser refuses the sign). Harmless: the value is 0 either way, and
# telling it apart would need an int hook on the parse of every header.
LENIENT_THAN_REFERENCE = {"header-json/negative-zero"}

# Index mutations a reader must refuse (the others may be read; the audit then reports them).
INDEX_MUST_REFUSE = {
    "garbage", "truncated", "bad-utf8", "empty", "lfs-pointer", "deep-nesting", "not-object", "weight-map-missing",
    "weight-map-wrong-type", "value-not-string", "traversal", "missing-shard", "metadata-wrong-type", "total-size-bad",
}


# -- config mutations ------------------------------------------------------------------------------
def mutate_config(rng: random.Random, text: str) -> tuple[bytes, str]:
    """A damaged or nonsensical copy of a valid ``config.json``."""
    doc = json.loads(text)
    kind = rng.choice([
        "garbage", "truncated", "bad-utf8", "deep-nesting", "huge-int-text", "not-object", "architectures-wrong",
        "model-type-wrong", "count-wrong", "count-wrong", "quantization-config-wrong", "dtype-wrong", "lone-surrogate",
    ])
    damaged = _damaged_text(rng, text, kind)
    if damaged is not None:
        return damaged, kind
    if kind == "deep-nesting":
        depth = rng.choice([1000, 100_000])
        return (text.rstrip()[:-1] + ',"x":' + "[" * depth + "]" * depth + "}").encode(), kind
    if kind == "huge-int-text":
        return text.replace('"hidden_size": ', '"hidden_size": ' + "3" * rng.choice([30, 5000]), 1).encode(), kind
    if kind == "lone-surrogate":
        return text.replace('"laguna"', '"lag\\ud800una"', 1).encode(), kind
    if kind == "not-object":
        doc = rng.choice(NOT_OBJECTS)
    elif kind == "architectures-wrong":
        doc["architectures"] = rng.choice([5, "LagunaForCausalLM", [5], None, {}, [["LagunaForCausalLM"]], [None], []])
    elif kind == "model-type-wrong":
        doc["model_type"] = rng.choice([5, ["laguna"], None, {}, "", "laguna\u0000"])
    elif kind == "count-wrong":
        key = rng.choice(["num_hidden_layers", "hidden_size", "num_experts", "num_attention_heads", "num_key_value_heads", "head_dim"])
        doc[key] = rng.choice([-1, 0, "2", 1.5, True, None, [], 10**12, 2**63])
    elif kind == "quantization-config-wrong":
        doc["quantization_config"] = rng.choice([[], "x", 5, None, {"quant_method": 5}, {"quant_method": "compressed-tensors", "config_groups": []},
                                                 {"quant_method": "compressed-tensors", "config_groups": {"g": 5}}, {"quant_method": "modelopt", "quant_algo": ["NVFP4"]},
                                                 {"quant_method": "compressed-tensors", "kv_cache_scheme": "fp8"}, {"quant_method": "modelopt", "exclude_modules": "lm_head"}])
    elif kind == "dtype-wrong":
        doc[rng.choice(["dtype", "torch_dtype"])] = rng.choice(["float128", 5, None, ["bfloat16"], "int4"])
    return json.dumps(doc).encode(), kind


# -- oracles and observations ----------------------------------------------------------------------
def reference_accepts(path: Path) -> dict[str, tuple[str, tuple[int, ...]]] | None:
    """What the ``safetensors`` library reads from ``path``: name -> (dtype, shape), or None."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), "numpy") as handle:
            out = {}
            for key in handle.keys():
                sliced = handle.get_slice(key)
                out[key] = (sliced.get_dtype(), tuple(sliced.get_shape()))
            return out
    except Exception:  # noqa: BLE001 - the oracle's verdict, whatever its exception type
        return None


def tree_state(*roots: Path) -> dict[str, tuple[int, int]]:
    """Every file and directory under ``roots``: (size, mtime_ns); what "nothing written" compares."""
    state: dict[str, tuple[int, int]] = {}
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            for name in dirnames + filenames:
                path = Path(dirpath) / name
                stat = path.lstat()
                state[str(path)] = (stat.st_size, stat.st_mtime_ns)
    return state


MUTATORS: dict[str, Callable[[random.Random, bytes | str], tuple[bytes, str]]] = {
    "shard": mutate_shard,  # type: ignore[dict-item]
    "index": mutate_index,  # type: ignore[dict-item]
    "config": mutate_config,  # type: ignore[dict-item]
}


# -- one fuzz case, end to end (library level) -----------------------------------------------------
class Violation(AssertionError):
    """The library broke its contract on one input (the message says how and which input)."""


def _observe(call: Callable[[], object]) -> tuple[object | None, Exception | None]:
    """Run ``call``; return (result, None) or (None, the Fp4forgeError). Anything else is a
    violation, re-raised with the input's label by the caller."""
    from fp4forge.errors import Fp4forgeError

    try:
        return call(), None
    except Fp4forgeError as exc:
        return None, exc


def fuzz_library_case(target: str, rng: random.Random, template: Path, workdir: Path) -> dict:
    """Damage one file of a copy of ``template`` (``target``: shard, index or config), open it
    with ``fp4forge.checkpoint.reader.open_checkpoint`` (strict, lenient and, for a shard, as a
    single file) and check the contract: a result or a named ``Fp4forgeError``, nothing written,
    a shard accepted only when the safetensors library accepts it with the same tensors, and
    index damage that must be refused refused. Returns a record of what happened."""
    import shutil

    from fp4forge.checkpoint.reader import open_checkpoint

    shutil.copytree(template, workdir)
    if target == "shard":
        path = workdir / rng.choice(SHARDS)
        damaged, label = mutate_shard(rng, path.read_bytes())
    elif target == "index":
        path = workdir / INDEX
        damaged, label = mutate_index(rng, path.read_text())
    else:
        path = workdir / "config.json"
        damaged, label = mutate_config(rng, path.read_text())
    path.write_bytes(damaged)
    record = {"target": target, "label": label, "bytes": len(damaged)}
    before = tree_state(workdir)

    def attempt(name: str, call: Callable[[], object]) -> tuple[object | None, Exception | None]:
        try:
            return _observe(call)
        except Exception as exc:
            import traceback

            raise Violation(f"{name}: {target} mutation {label!r} raised {type(exc).__name__}: {exc}\n"
                            + "".join(traceback.format_exception(exc)[-6:])) from exc

    strict, strict_error = attempt("open_checkpoint(strict)", lambda: open_checkpoint(workdir))
    lenient, lenient_error = attempt("open_checkpoint(strict=False)", lambda: open_checkpoint(workdir, strict=False))
    record["outcome"] = "accepted" if strict_error is None else type(strict_error).__name__
    if strict_error is not None and "\n" in str(strict_error):
        raise Violation(f"{target} mutation {label!r}: the error message is not one line: {str(strict_error)!r}")

    if target == "shard":
        single, single_error = attempt("open_checkpoint(file)", lambda: open_checkpoint(path))
        reference = reference_accepts(path)
        record["reference"] = "accepted" if reference is not None else "refused"
        if single_error is None:
            ours = {name: (info.dtype, tuple(info.shape)) for name, info in single.headers[path.name].tensors.items()}
            if reference is None and label not in LENIENT_THAN_REFERENCE:
                raise Violation(f"shard mutation {label!r}: fp4forge accepts a file the safetensors library refuses")
            if reference is not None and ours != reference:
                raise Violation(f"shard mutation {label!r}: fp4forge reads {ours} where safetensors reads {reference}")
        elif reference is not None and label not in STRICTER_THAN_REFERENCE:
            raise Violation(f"shard mutation {label!r}: fp4forge refuses a file the safetensors library reads ({single_error})")
        if (strict_error is None) != (single_error is None):
            raise Violation(f"shard mutation {label!r}: the directory and the file disagree ({strict_error} / {single_error})")
        if strict_error is not None and lenient_error is None and path.name not in lenient.shard_errors:
            raise Violation(f"shard mutation {label!r}: a lenient open neither raised nor recorded the damaged shard")
    elif target == "index" and label in INDEX_MUST_REFUSE and strict_error is None:
        raise Violation(f"index mutation {label!r} was accepted: {damaged[:200]!r}")
    elif target == "config" and strict_error is None and not isinstance(strict.config, dict):
        raise Violation(f"config mutation {label!r}: accepted a config.json that is not a JSON object ({type(strict.config).__name__})")
    after = tree_state(workdir)
    if after != before:
        raise Violation(f"{target} mutation {label!r}: files changed: {sorted(set(after.items()) ^ set(before.items()))[:5]}")
    return record


# -- one fuzz case through the command line --------------------------------------------------------
def run_cli(argv: list[str], cwd: Path) -> tuple[int, str, str]:
    """``fp4forge ARGV`` in this process through ``fp4forge.cli.main`` (the console script's entry
    point), in ``cwd``: (exit code, stdout, stderr). An exception escaping ``main`` is what a user
    would see as a traceback: it is raised as a :class:`Violation`."""
    import contextlib
    import io
    import sys
    import traceback

    from fp4forge.cli import main

    out, err = io.StringIO(), io.StringIO()
    old_argv, old_cwd = sys.argv, os.getcwd()
    sys.argv = ["fp4forge", *argv]
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            main()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException as exc:
        raise Violation(f"fp4forge {' '.join(argv[:1])}: traceback: {type(exc).__name__}: {exc}\n" + "".join(traceback.format_exception(exc)[-6:])) from exc
    finally:
        sys.argv = old_argv
        os.chdir(old_cwd)
    return code, out.getvalue(), err.getvalue()


# Warnings every audit of the tiny Laguna carries (vLLM 0.32's router-bias blind spot): no evidence
# that the audit noticed the damage.
QUIET_WARNINGS = {"serving-blind-spot"}


def check_cli_outcome(command: str, label: str, code: int, stdout: str, stderr: str, library_refuses: bool) -> None:
    """The command line's side of the contract (see docs/reliability.md)."""
    where = f"fp4forge {command} on {label!r}"
    if "Traceback" in stdout + stderr:
        raise Violation(f"{where}: printed a traceback: {stderr[-800:]}")
    allowed = {"bytes": {0, 2}, "audit": {0, 1, 2}}[command]
    if code not in allowed:
        raise Violation(f"{where}: exit {code}, expected one of {sorted(allowed)}; stderr {stderr[-400:]!r}")
    if code == 2:
        lines = [line for line in stderr.splitlines() if line.strip()]
        if len(lines) != 1 or not lines[0].startswith("error:"):
            raise Violation(f"{where}: exit 2 without a one-line 'error:' message: {stderr[-600:]!r}")
    if command == "audit":
        doc = json.loads(stdout)  # --json: one document whatever the outcome
        if code == 2 and "error" not in doc:
            raise Violation(f"{where}: exit 2 without an error document")
        if code == 1 and not any(f["severity"] == "error" for f in doc.get("findings", [])):
            raise Violation(f"{where}: exit 1 without an error finding")
        noted = [f for f in doc.get("findings", []) if f["severity"] == "warning" and f["rule"] not in QUIET_WARNINGS]
        if code == 0 and library_refuses and not noted:  # exit 0 is allowed only with a warning that says why
            raise Violation(f"{where}: exit 0 (a green light, no warning) on a checkpoint the reader refuses")
    if command == "bytes" and code == 0 and library_refuses:
        raise Violation(f"{where}: exit 0 on a checkpoint the reader refuses")


def fuzz_cli_case(target: str, rng: random.Random, template: Path, workdir: Path, commands: tuple[str, ...] = ("bytes", "audit")) -> dict:
    """Damage one file of a hard-linked copy of the real checkpoint ``template``; run
    ``fp4forge bytes --json`` and ``fp4forge audit --json`` on it and check the contract:
    exit 0/2 (bytes), 0/1/2 (audit) with never 0 on what the reader refuses, a one-line
    ``error:`` on exit 2, no traceback, nothing written in the checkpoint or the working dir."""
    import shutil

    from fp4forge.checkpoint.reader import open_checkpoint
    from fp4forge.errors import Fp4forgeError

    checkpoint = workdir / "checkpoint"
    cwd = workdir / "cwd"
    shutil.copytree(template, checkpoint, copy_function=os.link)
    cwd.mkdir()
    if target == "shard":
        path = checkpoint / rng.choice(sorted(p.name for p in template.glob("*.safetensors")))
        damaged, label = mutate_shard(rng, path.read_bytes())
    elif target == "index":
        path = checkpoint / INDEX
        damaged, label = mutate_index(rng, path.read_text())
    else:
        path = checkpoint / "config.json"
        damaged, label = mutate_config(rng, path.read_text())
    path.unlink()  # a hard link to the template: replace, never write through it
    path.write_bytes(damaged)
    try:
        open_checkpoint(checkpoint)
        refuses = False
    except Fp4forgeError:
        refuses = True
    except Exception as exc:
        raise Violation(f"open_checkpoint on {target} mutation {label!r}: {type(exc).__name__}: {exc}") from exc
    before = tree_state(checkpoint, cwd)
    record = {"target": target, "label": label, "library": "refused" if refuses else "accepted"}
    for command in commands:
        code, stdout, stderr = run_cli([command, str(checkpoint), "--json"], cwd)
        check_cli_outcome(command, f"{target}/{label}", code, stdout, stderr, refuses)
        record[command] = code
    after = tree_state(checkpoint, cwd)
    if after != before:
        raise Violation(f"{target} mutation {label!r}: the CLI changed files: {sorted(set(after.items()) ^ set(before.items()))[:5]}")
    return record


# -- value mutations under audit --deep ------------------------------------------------------------
# Encoded values per stored dtype (little-endian bytes of one element); E4M3FN bytes by hand:
# 0x7F / 0xFF NaN, 0x00 / 0x80 zero, 0x01 the smallest subnormal, 0xB8 = -1.0, 0x7E = 448.
SPECIAL_FLOATS = {"zero": 0.0, "negative-zero": -0.0, "negative": -1.5, "nan": float("nan"), "inf": float("inf"),
                  "-inf": float("-inf"), "subnormal": 1e-45, "tiny": 1e-40, "huge": 3e38}
SPECIAL_E4M3 = {"nan": 0x7F, "negative-nan": 0xFF, "zero": 0x00, "negative-zero": 0x80, "subnormal": 0x01, "negative": 0xB8, "max": 0x7E}
# The values vLLM cannot serve right whatever else holds: the audit must exit 1 on them.
DEFECTS = {"nan", "negative-nan", "inf", "-inf", "zero", "negative-zero", "negative", "subnormal", "tiny"}


def _encode(dtype: str, value: float, count: int) -> bytes:
    if dtype == "F32":
        return np.full(count, value, dtype="<f4").tobytes()
    if dtype == "BF16":
        return (np.full(count, value, dtype="<f4").view("<u4") >> 16).astype("<u2").tobytes()
    if dtype == "F16":
        with np.errstate(over="ignore"):
            return np.full(count, value, dtype="<f2").tobytes()
    raise ValueError(dtype)


def mutate_values(rng: random.Random, data: bytes) -> tuple[bytes, str, bool]:
    """One tensor's values of a valid shard replaced (header untouched, so the file stays valid):
    a special float in some or all elements of a float tensor (scales and weights), a special E4M3
    byte in FP8 block scales or weights, or codes zeroed / randomised / all at the extreme.
    (damaged bytes, label, whether the change is a defect the audit must report as an error)."""
    doc, raw_header, buffer = split_shard(data)
    names = [n for n in _tensor_names(doc) if doc[n]["data_offsets"][1] > doc[n]["data_offsets"][0]]
    name = rng.choice(names)
    entry = doc[name]
    begin, end = entry["data_offsets"]
    dtype, width = entry["dtype"], {"F32": 4, "BF16": 2, "F16": 2}.get(entry["dtype"], 1)
    count = (end - begin) // width
    every = count == 1 or rng.random() < 0.4
    start = 0 if every else rng.randrange(count)
    many = count if every else rng.randint(1, count - start)
    if dtype in ("F32", "BF16", "F16"):
        kind = rng.choice(sorted(SPECIAL_FLOATS))
        new = _encode(dtype, SPECIAL_FLOATS[kind], many)
        defect = kind in DEFECTS and (name.endswith("scale") or name.endswith("scale_2") or kind in ("nan", "inf", "-inf"))
    elif dtype == "F8_E4M3":
        kind = rng.choice(sorted(SPECIAL_E4M3))
        new = bytes([SPECIAL_E4M3[kind]]) * many
        defect = kind in ("nan", "negative-nan") or (kind in ("negative",) and "scale" in name)
    else:
        kind = rng.choice(["codes-zero", "codes-random", "codes-extreme"])
        new = {"codes-zero": bytes(many), "codes-extreme": b"\xff" * many}.get(kind) or bytes(rng.randrange(256) for _ in range(many))
        defect = False
    offset = begin + start * width
    buffer = buffer[:offset] + new + buffer[offset + len(new):]
    return join_shard(raw_header, buffer), f"{name.rsplit('.', 1)[-1]}:{dtype}:{kind}:{'all' if every else many}", defect


def fuzz_value_case(rng: random.Random, template: Path, workdir: Path) -> dict:
    """``fp4forge audit --deep --json`` on a hard-linked copy of ``template`` with one tensor's
    values mutated (:func:`mutate_values`): exit 0 or 1, never 2 or a traceback (the file is
    valid), JSON always, exit 1 on every defect, nothing written."""
    import shutil

    checkpoint, cwd = workdir / "checkpoint", workdir / "cwd"
    shutil.copytree(template, checkpoint, copy_function=os.link)
    cwd.mkdir()
    path = checkpoint / rng.choice(sorted(p.name for p in template.glob("*.safetensors")))
    damaged, label, defect = mutate_values(rng, path.read_bytes())
    path.unlink()  # a hard link to the template: replace, never write through it
    path.write_bytes(damaged)
    before = tree_state(checkpoint, cwd)
    code, stdout, stderr = run_cli(["audit", str(checkpoint), "--deep", "--json"], cwd)
    check_cli_outcome("audit", f"values/{label}", code, stdout, stderr, False)
    if code == 2:
        raise Violation(f"audit --deep on values/{label}: exit 2 on a valid file: {stderr[-400:]!r}")
    if defect and code != 1:
        raise Violation(f"audit --deep on values/{label}: exit {code} (a green light) on a defect")
    if tree_state(checkpoint, cwd) != before:
        raise Violation(f"audit --deep on values/{label}: files changed")
    return {"target": "values", "label": label, "defect": defect, "audit": code}
