"""Raw tensor bytes from an open checkpoint, without torch: byte-range reads (coalesced for many
small tensors, chunked for one large one) and the decoding of safetensors dtypes to float32
numpy arrays. The audit reads scales and scans weights through this; diff hashes and compares
values through it."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import lru_cache
from itertools import accumulate, repeat
from typing import Any

from fp4forge.checkpoint.reader import Checkpoint
from fp4forge.checkpoint.safetensors_format import DTYPE_BITS, TensorInfo
from fp4forge.errors import ConfigError

# A run of small tensors read in one request when the gap between them is below this.
COALESCE_GAP_BYTES = 1 << 16
MAX_COALESCED_BYTES = 1 << 26
RAW_CHUNK_BYTES = 1 << 26
FLOAT_DTYPES = ("BF16", "F16", "F32", "F64")


def tensor_index(ckpt: Checkpoint) -> dict[str, tuple[str, TensorInfo]]:
    """name -> (shard, header entry); for a name stored in two shards, the one weight_map names."""
    out: dict[str, tuple[str, TensorInfo]] = {}
    stored = 0
    for shard in ckpt.shard_names:  # shard by shard in C (10^5 names); exact when no name repeats
        header = ckpt.headers.get(shard)
        if header is not None:
            out.update(zip(header.tensors, zip(repeat(shard), header.tensors.values())))
            stored += len(header.tensors)
    if stored == len(out):
        return out
    weight_map = ckpt.index.weight_map if ckpt.index else {}
    out = {}
    for shard, info in ckpt.tensors():
        if info.name not in out or weight_map.get(info.name) == shard:
            out[info.name] = (shard, info)
    return out


def read_coalesced(ckpt: Checkpoint, entries: list[tuple[str, TensorInfo]]) -> dict[str, tuple[str, bytes]]:
    """name -> (dtype, raw bytes), reading neighbouring tensors of a shard in one range request."""
    by_shard: dict[str, list[TensorInfo]] = {}
    for shard, info in entries:
        by_shard.setdefault(shard, []).append(info)
    out: dict[str, tuple[str, bytes]] = {}
    for shard, infos in by_shard.items():
        base = ckpt.headers[shard].data_start
        infos.sort(key=lambda i: i.begin)
        run: list[TensorInfo] = []
        for info in infos + [None]:  # type: ignore[list-item]
            if run and (info is None or info.begin - run[-1].end > COALESCE_GAP_BYTES or info.end - run[0].begin > MAX_COALESCED_BYTES):
                blob = ckpt.source.read(shard, base + run[0].begin, run[-1].end - run[0].begin)
                for member in run:
                    out[member.name] = (member.dtype, blob[member.begin - run[0].begin : member.end - run[0].begin])
                run = []
            if info is not None:
                run.append(info)
    return out


def iter_raw_chunks(ckpt: Checkpoint, shard: str, info: TensorInfo, chunk: int | None = None) -> Iterator[bytes]:
    """A tensor's bytes in chunks (a whole number of elements each), never all at once."""
    chunk = chunk or RAW_CHUNK_BYTES
    base = ckpt.headers[shard].data_start + info.begin
    for start in range(0, info.nbytes, chunk):
        yield ckpt.source.read(shard, base + start, min(chunk, info.nbytes - start))


def iter_values(ckpt: Checkpoint, shard: str, info: TensorInfo, elements: int) -> Iterator[Any]:
    """A tensor's values as float32 numpy arrays of up to ``elements`` each, never all at once."""
    width = DTYPE_BITS[info.dtype] // 8
    base = ckpt.headers[shard].data_start + info.begin
    for start in range(0, info.numel, elements):
        count = min(elements, info.numel - start)
        yield decode(info.dtype, ckpt.source.read(shard, base + start * width, count * width))


# -- decoding -------------------------------------------------------------------------------------
def float_view(dtype: str, raw: bytes):
    """Raw little-endian bytes of a float dtype (FLOAT_DTYPES) -> numpy array, widened only where
    numpy lacks the type (BF16 -> float32, exactly); F16 / F32 / F64 stay as stored."""
    import numpy as np

    if dtype == "BF16":  # numpy has no bfloat16: widen to float32 by shifting into the high half
        return (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
    return np.frombuffer(raw, dtype={"F16": "<f2", "F32": "<f4", "F64": "<f8"}[dtype])


@lru_cache(maxsize=1)
def fp8_e4m3_table():
    """float32 value of every E4M3FN byte (exponent bias 7, no Inf, S.1111.111 is NaN)."""
    import numpy as np

    codes = np.arange(256)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exponent, mantissa = (codes >> 3) & 0xF, codes & 0x7
    value = np.where(exponent == 0, mantissa / 8.0 * 2.0**-6, (1 + mantissa / 8.0) * 2.0 ** (exponent - 7.0))
    value = np.where((codes & 0x7F) == 0x7F, np.nan, value)
    return (sign * value).astype(np.float32)


@lru_cache(maxsize=1)
def _decoders() -> dict[str, Callable[[bytes], Any]]:
    """safetensors dtype -> raw little-endian bytes to a flat float32 numpy array."""
    import numpy as np

    fp8 = fp8_e4m3_table()
    return {
        "F32": lambda raw: float_view("F32", raw),
        "F16": lambda raw: float_view("F16", raw).astype(np.float32),
        "F64": lambda raw: float_view("F64", raw).astype(np.float32),
        "BF16": lambda raw: float_view("BF16", raw),
        "F8_E4M3": lambda raw: fp8[np.frombuffer(raw, np.uint8)],
        "U8": lambda raw: np.frombuffer(raw, np.uint8).astype(np.float32),
        "I8": lambda raw: np.frombuffer(raw, np.int8).astype(np.float32),
        "I16": lambda raw: np.frombuffer(raw, "<i2").astype(np.float32),
        "I32": lambda raw: np.frombuffer(raw, "<i4").astype(np.float32),
        "I64": lambda raw: np.frombuffer(raw, "<i8").astype(np.float32),
    }


def can_decode(dtype: str) -> bool:
    return dtype in _decoders()


def decode(dtype: str, raw: bytes):
    """Raw little-endian bytes -> flat float32 numpy array."""
    decoder = _decoders().get(dtype)
    if decoder is None:
        raise ConfigError(f"cannot decode {dtype} values")
    return decoder(raw)


def decode_all(raw: dict[str, tuple[str, bytes]]) -> dict[str, Any]:
    """name -> flat float32 array, for many small tensors: the tensors of one dtype are decoded in
    one call over their bytes joined, then cut apart (views), instead of one decode call each."""
    by_dtype: dict[str, list[str]] = {}
    for name, (dtype, _) in raw.items():
        by_dtype.setdefault(dtype, []).append(name)
    decoded: dict[str, Any] = {}
    for dtype, names in by_dtype.items():
        width = DTYPE_BITS.get(dtype, 0) // 8
        if len(names) < 2 or not width or not can_decode(dtype):
            decoded.update((name, decode(dtype, raw[name][1])) for name in names)
            continue
        blobs = [raw[name][1] for name in names]
        if any(len(blob) % width for blob in blobs):  # a torn tensor: decode raises for it alone
            decoded.update((name, decode(dtype, blob)) for name, blob in zip(names, blobs))
            continue
        values = decode(dtype, b"".join(blobs))
        ends = list(accumulate(len(blob) // width for blob in blobs))
        decoded.update(zip(names, [values[start:end] for start, end in zip([0] + ends[:-1], ends)]))
    return {name: decoded[name] for name in raw}


def read_many_small(ckpt: Checkpoint, entries: list[tuple[str, TensorInfo]]) -> list[bytes]:
    """The raw bytes of many small tensors (10^5 scales), in ``entries`` order: each local shard is
    mapped into memory once and sliced in C, with no read request per tensor (their neighbours are
    megabytes of weights, so ranges rarely coalesce); other sources go through read_coalesced. A
    slice past a truncated file's end comes back short: the caller checks lengths."""
    import mmap

    by_shard: dict[str, list[int]] = {}
    for position, (shard, _) in enumerate(entries):
        by_shard.setdefault(shard, []).append(position)
    out: list[bytes] = [b""] * len(entries)
    path_of = getattr(ckpt.source, "path", None) if not getattr(ckpt.source, "is_remote", True) else None
    for shard, positions in by_shard.items():
        infos = [entries[p][1] for p in positions]
        mapped = None
        if path_of is not None:
            try:
                with open(path_of(shard), "rb") as fh:
                    mapped = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
            except (OSError, ValueError):  # an empty or unmappable file: read it the plain way
                mapped = None
        if mapped is None:
            raw = read_coalesced(ckpt, [(shard, info) for info in infos])
            for p, info in zip(positions, infos):
                out[p] = raw[info.name][1]
            continue
        with mapped:
            base = ckpt.headers[shard].data_start
            starts = [base + info.begin for info in infos]
            slices = list(map(slice, starts, [start + info.end - info.begin for start, info in zip(starts, infos)]))
            for p, blob in zip(positions, [mapped[s] for s in slices]):
                out[p] = blob
    return out


# -- casts into another dtype (what vLLM's parameter copy does to a stored value) -------------------
#: float dtype -> (significand bits with the implicit one, exponent bits)
FLOAT_FORMATS = {"F64": (53, 11), "F32": (24, 8), "BF16": (8, 8), "F16": (11, 5), "F8_E4M3": (4, 4), "F8_E5M2": (3, 5)}
#: integer dtype -> (smallest, largest) value
INT_RANGES = {"U8": (0, 255), "I8": (-128, 127), "I16": (-(1 << 15), (1 << 15) - 1), "I32": (-(1 << 31), (1 << 31) - 1)}
#: significand bits a float scale keeps within the 1 % a calibration tolerates (BF16's 8: 0.4 %)
SCALE_SIGNIFICAND_BITS = 8


def cast_verdict(stored: str, expected: str) -> str:
    """What copying ``stored`` values into a parameter of dtype ``expected`` does (vLLM's weight
    loaders ``copy_`` a tensor into the parameter they created, casting it; docs/audit.md#agreement-with-vllm):
    ``bits``: integers of one width, the bytes kept (int8 -> uint8 wraps); ``exact``: every stored
    value is one of ``expected`` (a narrower float, integers in a float's range); ``values``: only
    the values a wider or other dtype happens to hold survive (read them); ``integers``: integer
    codes where a float belongs, read as numbers."""
    if stored in INT_RANGES and expected in INT_RANGES:
        return "bits" if DTYPE_BITS[stored] == DTYPE_BITS[expected] else "values"
    if stored in INT_RANGES:
        return "integers"
    if stored in FLOAT_FORMATS and expected in FLOAT_FORMATS:
        (s_sig, s_exp), (e_sig, e_exp) = FLOAT_FORMATS[stored], FLOAT_FORMATS[expected]
        return "exact" if s_sig <= e_sig and s_exp <= e_exp else "values"
    return "values"


def survives_cast(values, expected: str):
    """Which float32 ``values`` (numpy, as ``iter_values`` yields them) a cast into ``expected``
    keeps unchanged (NaN is kept where the dtype has one)."""
    import numpy as np

    if expected in INT_RANGES:
        low, high = INT_RANGES[expected]
        return (values == np.round(values)) & (values >= low) & (values <= high)
    if expected == "F8_E4M3":
        table = fp8_e4m3_table()
        return np.isin(values, table[np.isfinite(table)]) | (np.isnan(values))
    if expected == "BF16":
        return (values.astype(np.float32).view(np.uint32) & 0xFFFF) == 0
    if expected == "F16":
        return (values.astype(np.float16).astype(np.float32) == values) | np.isnan(values)
    return np.ones(values.shape, dtype=bool)  # F32 / F64 hold every float32
