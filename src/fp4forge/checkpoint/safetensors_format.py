"""The safetensors container: dtype table and strict header parsing (no I/O here).

Layout (see docs/formats.md#safetensors-file-layout): 8-byte little-endian u64 header length N, N bytes of
UTF-8 JSON, then the byte buffer, which the tensors must cover exactly, back to back.
The checks mirror the Rust reference loader so that what we accept, safetensors accepts.
"""

from __future__ import annotations

import gc
import json
import math
import re
import struct
from dataclasses import dataclass, field
from functools import cached_property, partial
from itertools import accumulate, chain, repeat
from operator import itemgetter, sub
from typing import NamedTuple

from fp4forge.checkpoint.json_text import JsonTextError, load_json
from fp4forge.errors import DtypeError, HeaderError, LfsPointerError, OffsetError

# The reference loader's cap (safetensors `MAX_HEADER_SIZE`).
MAX_HEADER_BYTES = 100_000_000
LENGTH_PREFIX_BYTES = 8
LFS_POINTER_PREFIX = b"version https://git-lfs"

# Header dtype string -> bits per element (safetensors `Dtype::bitsize`).
DTYPE_BITS: dict[str, int] = {
    "BOOL": 8,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E8M0": 8,
    "F8_E4M3FNUZ": 8,
    "F8_E5M2FNUZ": 8,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "C64": 64,
    "F64": 64,
    "I64": 64,
    "U64": 64,
}
# The integer dtypes (signed and unsigned): GPTQ / AWQ packed weights and zero points, int8 weights.
INTEGER_DTYPES = frozenset(dtype for dtype in DTYPE_BITS if dtype[0] in "IU")


class TensorInfo(NamedTuple):
    """One header entry. Offsets count from the start of the byte buffer, END exclusive.
    (A NamedTuple: headers of real checkpoints hold 10^5 entries, and tuples build fast.)"""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class HeaderColumns(NamedTuple):
    """A header's entries as parallel lists, in stored order (what whole-checkpoint passes such as
    the byte table read: no per-tensor object is built for them)."""

    names: list[str]
    dtypes: list[str]
    shapes: list[tuple[int, ...]]
    begins: list[int]
    ends: list[int]


@dataclass(frozen=True)
class ShardHeader:
    """A parsed, validated safetensors header: its entries as columns, and as a name ->
    TensorInfo dict (``tensors``) built from them on first use."""

    source: str
    header_len: int
    metadata: dict[str, str]
    columns: HeaderColumns = field(repr=False)

    @cached_property
    def tensors(self) -> dict[str, TensorInfo]:
        names, dtypes, shapes, begins, ends = self.columns
        enabled = gc.isenabled()
        gc.disable()  # 10^5 acyclic tuples: collections their allocation triggers are wasted work
        try:
            return dict(zip(names, map(_new_info, zip(names, dtypes, shapes, begins, ends))))
        finally:
            if enabled:
                gc.enable()

    @property
    def data_start(self) -> int:
        """File offset of the byte buffer."""
        return LENGTH_PREFIX_BYTES + self.header_len

    @property
    def data_len(self) -> int:
        return max(self.columns.ends, default=0)

    @property
    def declared_file_size(self) -> int:
        """The file size the header implies: prefix + header + every tensor's bytes."""
        return self.data_start + self.data_len


@dataclass(frozen=True)
class LfsPointer:
    oid: str
    size: int


def parse_lfs_pointer(raw: bytes) -> LfsPointer | None:
    """Recognise a git-LFS pointer (what a `/raw/` URL returns for an LFS file)."""
    if not raw.startswith(LFS_POINTER_PREFIX) or len(raw) > 1024:
        return None
    fields: dict[str, str] = {}
    for line in raw.decode("utf-8", errors="replace").splitlines():
        key, _, value = line.partition(" ")
        fields[key] = value.strip()
    try:
        return LfsPointer(oid=fields.get("oid", ""), size=int(fields.get("size", "-1")))
    except ValueError:
        return LfsPointer(oid=fields.get("oid", ""), size=-1)


def header_length(prefix: bytes, *, source: str, file_size: int | None) -> int:
    """Decode and sanity-check the 8-byte header-length prefix."""
    pointer = parse_lfs_pointer(prefix if len(prefix) > LENGTH_PREFIX_BYTES else b"")
    if prefix.startswith(LFS_POINTER_PREFIX):
        pointer = pointer or LfsPointer(oid="", size=-1)
        raise LfsPointerError(
            f"git-LFS pointer instead of safetensors data (oid {pointer.oid or '?'}, "
            f"real size {pointer.size} bytes); fetch it through /resolve/, not /raw/",
            file=source,
        )
    if file_size is not None and file_size < LENGTH_PREFIX_BYTES or len(prefix) < LENGTH_PREFIX_BYTES:
        raise HeaderError("file is shorter than the 8-byte header-length prefix", file=source)
    (length,) = struct.unpack("<Q", prefix[:LENGTH_PREFIX_BYTES])
    if length > MAX_HEADER_BYTES:
        raise HeaderError(
            f"header length {length:,} exceeds the {MAX_HEADER_BYTES:,}-byte limit "
            "(truncated, corrupt or not a safetensors file)",
            file=source,
        )
    if file_size is not None and LENGTH_PREFIX_BYTES + length > file_size:
        raise HeaderError(
            f"header length {length:,} runs past the end of the {file_size:,}-byte file",
            file=source,
        )
    return length


def _reject_duplicate_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    out: dict[str, object] = {}
    for key, value in pairs:
        if key in out:
            raise HeaderError(f"duplicate key {key!r} in header JSON")
        out[key] = value
    return out


def parse_header(raw: bytes, *, source: str, header_len: int | None = None) -> ShardHeader:
    """Validate header JSON bytes (without the length prefix) into a ShardHeader.

    Checks: UTF-8, JSON object, no duplicate keys, schema of every entry, known dtypes,
    non-negative integer shapes, whole bytes per tensor, and offsets that tile the
    buffer from 0 with no overlap or hole.
    """
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise HeaderError(f"header is not valid UTF-8 ({exc.reason} at byte {exc.start})", file=source) from None
    compact = parse_compact_header(text, raw)
    if compact is not None:
        columns, metadata = compact
        return ShardHeader(source=source, header_len=len(raw) if header_len is None else header_len, metadata=metadata, columns=columns)
    return _parse_header_json(text, source=source, header_len=len(raw) if header_len is None else header_len)


def _parse_header_json(text: str, *, source: str, header_len: int) -> ShardHeader:
    """The general path (any valid JSON layout), and the one that names every error."""
    try:
        doc = load_json(text)
    except JsonTextError as exc:
        raise HeaderError(f"header is {exc.reason}", file=source) from None
    if not isinstance(doc, dict):
        raise HeaderError("header JSON is not an object", file=source)

    has_metadata = "__metadata__" in doc
    metadata_raw = doc.pop("__metadata__", None)
    if metadata_raw is None:  # absent, or null: the reference loader reads both as no metadata
        metadata_raw = {}
    metadata_ok = isinstance(metadata_raw, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in metadata_raw.items())
    columns = _columns_fast(doc, text)  # checks the tiling too; None when anything is off
    # Duplicate keys first, then the metadata, then the entries: the order the errors are named in.
    if columns is None or not metadata_ok or _string_count(text) != 2 * (len(doc) + has_metadata + 4 * len(doc) + 2 * len(metadata_raw)):
        if _may_hold_duplicates(text, len(doc)):
            try:  # slow path, only to name the duplicate precisely
                json.loads(text, object_pairs_hook=_reject_duplicate_keys)
            except HeaderError as exc:
                raise HeaderError(exc.message, file=source) from None
    if not metadata_ok:
        raise HeaderError("__metadata__ must map strings to strings", file=source)
    if columns is None:  # something is off: the careful per-entry pass names it
        tensors = {name: _parse_entry(name, entry, source) for name, entry in doc.items()}
        _check_tiling(tensors, source)
        infos = list(tensors.values())
        columns = HeaderColumns(list(tensors), [i.dtype for i in infos], [i.shape for i in infos], [i.begin for i in infos], [i.end for i in infos])
    return ShardHeader(source=source, header_len=header_len, metadata=dict(metadata_raw), columns=columns)


def _string_count(text: str) -> int:
    """Quotes in JSON text that holds no backslash: each one opens or closes a string, so this is
    twice the number of strings written (-1 when a backslash may hide an escaped quote).

    A validated header whose parsed dict holds as many strings (each entry: three keys and its
    dtype; each top-level key; the metadata's keys and values) has no duplicate key: a duplicate
    collapses in the dict, so its text holds more strings than the dict."""
    return -1 if "\\" in text else text.count('"')


def _may_hold_duplicates(text: str, entries: int) -> bool:
    """A duplicate key collapses in the parsed dict: compare against occurrences in the text.

    (Quotes inside JSON strings are escaped, so `"data_offsets"` only occurs as a key.)"""
    return text.count('"__metadata__"') > 1 or any(text.count(key) != entries for key in ('"data_offsets"', '"dtype"', '"shape"'))


class _SpanBytes(dict):
    """(dtype, shape) -> the bytes a tensor of it spans, worked out once per distinct pair (None
    when not a whole number of bytes); an unknown dtype raises KeyError."""

    def __missing__(self, key: tuple) -> int | None:
        dtype, shape = key
        bits = math.prod(shape) * DTYPE_BITS[dtype]
        span = self[key] = None if bits % 8 else bits >> 3
        return span


def _columns_fast(doc: dict, text: str | None = None) -> HeaderColumns | None:
    """Validate all entries and build the columns with whole-list operations that run in C (map,
    set, list equality; a real header has 10^5 entries), tiling included; None when anything is
    off, so the caller runs the per-entry pass and ``_check_tiling``, which name the problem.

    ``text``, the header's JSON text, spares the search for a negative dimension or offset when
    it holds no ``-`` (JSON writes a negative number with one)."""
    names = list(doc)
    if not names:
        return HeaderColumns([], [], [], [], [])
    entries = list(doc.values())
    try:
        if set(map(len, entries)) != {3}:
            return None
        # A non-dict entry fails these look-ups (TypeError); so does a data_offsets without len.
        # One shared string per dtype (KeyError: unknown; TypeError: unhashable): 10^5 fewer
        # objects, and later equality tests on them are identity tests.
        dtypes = list(map(_DTYPE_NAMES.__getitem__, map(itemgetter("dtype"), entries)))
        shapes = list(map(itemgetter("shape"), entries))
        offsets = list(map(itemgetter("data_offsets"), entries))
        if set(map(type, shapes)) != {list} or set(map(len, offsets)) != {2}:
            return None
        begins = list(map(itemgetter(0), offsets))  # a 2-long string or dict: caught by the type test
        ends = list(map(itemgetter(1), offsets))
    except (KeyError, TypeError):
        return None
    dims = list(chain.from_iterable(shapes))
    # `type is int` excludes bool (and 1.0, which would also share a _SpanBytes key with 1)
    if dims and set(map(type, dims)) != {int} or set(map(type, begins)) != {int} or set(map(type, ends)) != {int}:
        return None
    if (text is None or "-" in text) and (min(dims, default=0) < 0 or min(begins) < 0):
        return None
    shapes = list(map(tuple, shapes))
    span_bytes = _SpanBytes()
    try:  # (dtypes are DTYPE_BITS keys by now; TypeError: a shape with an unhashable dimension)
        spans = list(map(span_bytes.__getitem__, zip(dtypes, shapes)))
    except (KeyError, TypeError):
        return None
    if None in span_bytes.values() or list(map(sub, ends, begins)) != spans:
        return None  # not whole bytes, or a span that is not its dtype x shape (or ends before it begins)
    if not (begins[0] == 0 and begins[1:] == ends[:-1]):  # not stored in offset order: sort first
        ordered = sorted(zip(begins, ends))
        if ordered[0][0] != 0 or [b for b, _ in ordered[1:]] != [e for _, e in ordered[:-1]]:
            return None
    return HeaderColumns(names, dtypes, shapes, begins, ends)


# -- the compact layout every safetensors writer emits, parsed in C-level passes ------------------
# `{"__metadata__":{"k":"v",...},"name":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]},...}`
# (no whitespace, keys in this order, strings without escapes, tensors stored in offset order),
# then spaces up to a multiple of 8. The text is split at its quotes (with no backslash, every
# quote opens or closes a string), each entry's fixed pieces are counted in place, the offsets
# are worked out from the dtypes and shapes (back to back from 0), and their text, rebuilt, must
# equal the stored text: only then is the header taken, and it is exactly what the JSON path
# would make of it. Anything else returns None and the JSON path decides (and names the error).
_COUNT_TEXT = r"(?:0|[1-9][0-9]*)"  # a non-negative JSON integer (no sign, no leading zero)
_SHAPE_TEXT = re.compile(rf":\[((?:{_COUNT_TEXT}(?:,{_COUNT_TEXT})*)?)\],")
_STRING_CHARS = r'[^"\\\x00-\x1f]*'  # a JSON string's characters without escapes
_COMPACT_METADATA = re.compile(rf'\{{"__metadata__":\{{((?:"{_STRING_CHARS}":"{_STRING_CHARS}",)*"{_STRING_CHARS}":"{_STRING_CHARS}")?\}},')
_METADATA_PAIR = re.compile(rf'"({_STRING_CHARS})":"({_STRING_CHARS})"')
_CONTROL_BYTES = bytes(range(0x20))  # not allowed raw in a JSON string; the compact layout has none outside


class _Kinds(dict):
    """(dtype text, shape text ``:[2,3],``) -> (dtype, shape, bytes spanned); worked out once per
    distinct pair and kept for the process (a checkpoint's 10^5 entries have ~10^2 of them),
    KeyError when either is not valid or the span is not a whole number of bytes."""

    def __missing__(self, key: tuple[str, str]) -> tuple[str, tuple[int, ...], int]:
        dtype_text, shape_text = key
        found = _SHAPE_TEXT.fullmatch(shape_text)
        if found is None:
            raise KeyError(key)
        dtype = _DTYPE_NAMES[dtype_text]
        shape = tuple(map(int, found[1].split(","))) if found[1] else ()  # ValueError past int()'s digit limit
        bits = math.prod(shape) * DTYPE_BITS[dtype]
        if bits % 8:
            raise KeyError(key)
        if len(self) >= _KINDS_KEPT:
            self.clear()
        kind = self[key] = (dtype, shape, bits >> 3)
        return kind


_KINDS_KEPT = 1 << 14
_KINDS = _Kinds()


def parse_compact_header(text: str, raw: bytes | None = None) -> tuple[HeaderColumns, dict[str, str]] | None:
    """A header in the compact layout -> (columns, metadata), exactly as the JSON path parses it;
    None for anything else. ``raw``: the same text as UTF-8 bytes, when the caller has them."""
    if "\\" in text:
        return None
    if raw is None:
        raw = text.encode("utf-8")
    if len(raw.translate(None, _CONTROL_BYTES)) != len(raw):
        return None
    body = text.rstrip(" ")
    metadata: dict[str, str] = {}
    if not body.endswith("]}}"):
        return None
    if body.startswith('{"__metadata__":'):
        found = _COMPACT_METADATA.match(body)
        if found is None:
            return None
        pairs = _METADATA_PAIR.findall(found[1]) if found[1] else []
        metadata = dict(pairs)
        if len(metadata) != len(pairs):
            return None  # a duplicate key
        body = body[found.end() : -1]
    elif body.startswith('{"'):
        body = body[1:-1]
    else:
        return None
    # body: "name":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]},"name2":{...}...]}
    tokens = body.split('"')
    count, rest = divmod(len(tokens) - 1, 10)
    if rest or not count or tokens[0]:
        return None
    if (
        tokens[2::10].count(":{") != count
        or tokens[3::10].count("dtype") != count
        or tokens[4::10].count(":") != count
        or tokens[6::10].count(",") != count
        or tokens[7::10].count("shape") != count
        or tokens[9::10].count("data_offsets") != count
    ):
        return None
    names = tokens[1::10]
    try:
        kinds = list(map(_KINDS.__getitem__, zip(tokens[5::10], tokens[8::10])))
    except (KeyError, ValueError):
        return None
    ends = list(accumulate(map(itemgetter(2), kinds)))
    begins = [0, *ends[:-1]]
    try:
        end_texts = list(map(str, ends))
    except ValueError:  # an end past int -> str's digit limit (shapes whose product is that large)
        return None
    # The stored offsets' text, entry by entry (no entry's text holds a newline), must be these.
    expected = "".join(chain.from_iterable(zip(chain(("0",), end_texts), repeat(","), end_texts, repeat("]},\n:["))))
    if "\n".join(tokens[10::10]) != ":[" + expected[: -len(",\n:[")]:
        return None
    distinct = set(names)
    if len(distinct) != count or "__metadata__" in distinct:
        return None
    return HeaderColumns(names, list(map(itemgetter(0), kinds)), list(map(itemgetter(1), kinds)), begins, ends), metadata


_DTYPE_NAMES = {dtype: dtype for dtype in DTYPE_BITS}  # JSON makes nothing but a string equal to one
_new_info = partial(tuple.__new__, TensorInfo)  # TensorInfo from one 5-tuple, without a Python-level call


def _is_count(value: object) -> bool:
    return type(value) is int and value >= 0  # bool is a subclass of int: excluded by `type is`


def _parse_entry(name: str, entry: object, source: str) -> TensorInfo:
    if type(entry) is not dict or len(entry) != 3 or "dtype" not in entry or "shape" not in entry or "data_offsets" not in entry:
        raise HeaderError("entry must have exactly dtype, shape and data_offsets", file=source, tensor=name)
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    bits_per_element = DTYPE_BITS.get(dtype) if type(dtype) is str else None
    if bits_per_element is None:
        raise DtypeError(f"unknown dtype {dtype!r}", file=source, tensor=name)
    if type(shape) is not list or not all(map(_is_count, shape)):
        raise HeaderError(f"shape must be a list of non-negative integers, got {shape!r}", file=source, tensor=name)
    if type(offsets) is not list or len(offsets) != 2 or not all(map(_is_count, offsets)):
        raise HeaderError(f"data_offsets must be two non-negative integers, got {offsets!r}", file=source, tensor=name)
    begin, end = offsets
    if end < begin:
        raise OffsetError(f"data_offsets end {end} < begin {begin}", file=source, tensor=name)
    bits = math.prod(shape) * bits_per_element
    if bits % 8:
        raise HeaderError(f"{dtype}{shape} is not a whole number of bytes", file=source, tensor=name)
    if end - begin != bits // 8:
        raise OffsetError(
            f"byte range {begin}..{end} holds {end - begin} bytes but {dtype}{shape} needs {_decimal(bits // 8)}",
            file=source,
            tensor=name,
        )
    return TensorInfo(name=name, dtype=dtype, shape=tuple(shape), begin=begin, end=end)


def _decimal(count: int) -> str:
    """A count in decimal, or a bound for one past int -> str's digit limit (a hostile shape's
    product can be; its dimensions each were within it)."""
    try:
        return str(count)
    except ValueError:
        return f"more than 10^{int(count.bit_length() * 0.30103)}"


def _by_offsets(info: TensorInfo) -> tuple[int, int]:
    return info.begin, info.end


def _check_tiling(tensors: dict[str, TensorInfo], source: str) -> None:
    """Offsets, sorted, must run back to back from 0 (no overlap, no hole)."""
    expected = 0
    for info in sorted(tensors.values(), key=_by_offsets):
        if info.begin < expected:
            raise OffsetError(f"byte range {info.begin}..{info.end} overlaps the previous tensor", file=source, tensor=info.name)
        if info.begin > expected:
            raise OffsetError(f"hole of {info.begin - expected} bytes before this tensor", file=source, tensor=info.name)
        expected = info.end


def encode_header(entries: list[tuple[str, str, tuple[int, ...]]], metadata: dict[str, str] | None) -> tuple[bytes, dict[str, tuple[int, int]]]:
    """Build header bytes for tensors laid out in the given order.

    Returns the full prefix (length + JSON padded with spaces to a multiple of 8, as the
    reference writer does) and each tensor's (begin, end).
    """
    doc: dict[str, object] = {}
    if metadata:
        doc["__metadata__"] = dict(metadata)
    offsets: dict[str, tuple[int, int]] = {}
    cursor = 0
    for name, dtype, shape in entries:
        if dtype not in DTYPE_BITS:
            raise DtypeError(f"unknown dtype {dtype!r}", tensor=name)
        bits = math.prod(shape) * DTYPE_BITS[dtype]
        if bits % 8:
            raise HeaderError(f"{dtype}{list(shape)} is not a whole number of bytes", tensor=name)
        offsets[name] = (cursor, cursor + bits // 8)
        doc[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [cursor, cursor + bits // 8]}
        cursor += bits // 8
    body = json.dumps(doc, separators=(",", ":")).encode("utf-8")
    body += b" " * (-len(body) % 8)
    return struct.pack("<Q", len(body)) + body, offsets


# The reference writer sorts by its dtype enum, declared "in increasing alignment order".
_ALIGNMENT_RANK = {dtype: rank for rank, dtype in enumerate(DTYPE_BITS)}


def reference_order(entries: list[tuple[str, str, tuple[int, ...]]]) -> list[tuple[str, str, tuple[int, ...]]]:
    """Order tensors the way safetensors' writer does: larger dtype alignment first, then by name."""
    return sorted(entries, key=lambda e: (-_ALIGNMENT_RANK[e[1]], e[0]))
