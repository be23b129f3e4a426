"""`fp4forge audit`: open a checkpoint (local, HF repo id or https `/resolve/` base), run every
check against its headers (plus the few small scale tensors, which are bytes, not gigabytes; all
values with ``deep=True``) and return one ``AuditReport``.

    report = audit_checkpoint("path/or/org/repo", deep=False, fmt="auto", vllm_version="0.32")
    report.exit_code   # 0 no errors, 1 errors; unreadable input raises an Fp4forgeError (exit 2)

The checks live in ``checks_integrity`` (files, index, values), ``checks_declarations``
(quantization_config vs tensors) and ``checks_names`` (tensors vs the architecture, and the
serving engine's known blind spots). Each is ``run(ctx) -> list[Issue]``; the rules they report
are the table in ``rules.toml``. The JSON document is described in ``findings.py``.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any

from fp4forge.audit.findings import AuditReport, Issue, group_issues
from fp4forge.audit.quant_config import FORMATS, QuantDeclaration, read_declaration
from fp4forge.checkpoint.layout import UNKNOWN, Layout, layout_for_config, split_suffix
from fp4forge.checkpoint.reader import Checkpoint
from fp4forge.checkpoint.safetensors_format import TensorInfo
from fp4forge.errors import ConfigError, LayoutError

CHECKS = ("fp4forge.audit.checks_integrity", "fp4forge.audit.checks_declarations", "fp4forge.audit.checks_names")
AUDIT_FORMATS = ("auto",) + FORMATS
DEFAULT_VLLM_VERSION = "0.32"

# Components whose 2-D weights are Linear layers (vLLM builds routers and lm_head as Linears too,
# so a "Linear" target reaches them unless they are ignored). Embeddings and norms are not.
LINEAR_COMPONENTS = ("attention", "routed_experts", "shared_expert", "dense_mlp", "router", "lm_head")
# How messages name each component's modules.
COMPONENT_NOUNS = {
    "routed_experts": "routed-expert Linears",
    "shared_expert": "shared-expert Linears",
    "attention": "attention Linears",
    "dense_mlp": "dense-MLP Linears",
    "router": "routers",
    "lm_head": "lm_head",
    "embeddings": "embeddings",
    "norms": "norms",
}
WEIGHT_SUFFIXES = ("weight", "weight_packed")
SCALE_KINDS = ("weight_scale", "weight_global_scale", "input_scale", "input_global_scale")
SMALL_SCALE_MAX_ELEMENTS = 1 << 16
# A run of small tensors read in one request when the gap between them is below this.
COALESCE_GAP_BYTES = 1 << 16
MAX_COALESCED_BYTES = 1 << 26
RAW_CHUNK_BYTES = 1 << 26


def modules_noun(component: str) -> str:
    return COMPONENT_NOUNS.get(component, f"{component} modules")


def parse_version(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.strip().lstrip("v").split("."))
    except ValueError:
        raise ConfigError(f"not a version number: {text!r} (expected e.g. 0.32)") from None


def tensor_index(ckpt: Checkpoint) -> dict[str, tuple[str, TensorInfo]]:
    """name -> (shard, header entry); for a name stored in two shards, the one weight_map names."""
    weight_map = ckpt.index.weight_map if ckpt.index else {}
    out: dict[str, tuple[str, TensorInfo]] = {}
    for shard, info in ckpt.tensors():
        if info.name not in out or weight_map.get(info.name) == shard:
            out[info.name] = (shard, info)
    return out


@dataclass
class AuditContext:
    """Everything a check may look at, computed once."""

    ckpt: Checkpoint
    layout: Layout | None
    declaration: QuantDeclaration | None
    deep: bool
    fmt: str
    vllm_version: tuple[int, ...]
    trust_remote_code: bool = False
    _values: dict[str, Any] = field(default_factory=dict, repr=False)

    @cached_property
    def tensors(self) -> dict[str, tuple[str, TensorInfo]]:
        return tensor_index(self.ckpt)

    @cached_property
    def roles(self) -> dict[str, tuple[str, str, str]]:
        """name -> (module, suffix, kind), split once (10^5 names)."""
        return {name: split_suffix(name) for name in self.tensors}

    def kind(self, name: str) -> str:
        return self.roles[name][2]

    @cached_property
    def modules(self) -> dict[str, dict[str, TensorInfo]]:
        """module -> {parameter suffix: header entry}, for names with a known suffix."""
        out: dict[str, dict[str, TensorInfo]] = {}
        for name, (_, info) in self.tensors.items():
            module, suffix, kind = self.roles[name]
            if kind != UNKNOWN:
                out.setdefault(module, {})[suffix] = info
        return out

    @property
    def tensor_format(self) -> str | None:
        """compressed-tensors or modelopt: whose tensor names the declaration implies."""
        return self.declaration.format if self.declaration and self.declaration.format in FORMATS else None

    def file_of(self, name: str) -> str | None:
        entry = self.tensors.get(name)
        return entry[0] if entry else None

    def component(self, module: str) -> str:
        return self.layout.component_of(module) if self.layout else UNKNOWN

    @cached_property
    def expected_specs(self) -> list[Any] | None:
        """On-disk tensor specs save_pretrained writes for config.json (None: not buildable)."""
        from fp4forge.audit.checks_names import build_expected_specs

        return build_expected_specs(self)

    @cached_property
    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        return {spec.name: tuple(spec.shape) for spec in self.expected_specs or []}

    @cached_property
    def linear_modules(self) -> dict[str, str]:
        """Linear module -> component: present with a 2-D weight, or expected by the architecture."""
        out: dict[str, str] = {}
        for module, params in self.modules.items():
            weight = next((params[s] for s in WEIGHT_SUFFIXES if s in params), None)
            if weight is not None and len(weight.shape) == 2:
                component = self.component(module)
                if component in LINEAR_COMPONENTS:
                    out[module] = component
        for name, shape in self.expected_shapes.items():
            module, suffix, _ = split_suffix(name)
            if suffix == "weight" and len(shape) == 2 and module not in out:
                component = self.component(module)
                if component in LINEAR_COMPONENTS:
                    out[module] = component
        return dict(sorted(out.items()))

    def linear_shape(self, module: str) -> tuple[int, int] | None:
        """[out, in] of a Linear: from the architecture, else from the stored weight."""
        expected = self.expected_shapes.get(f"{module}.weight")
        if expected is not None and len(expected) == 2:
            return expected[0], expected[1]
        params = self.modules.get(module, {})
        if "weight_packed" in params and len(params["weight_packed"].shape) == 2:
            out_features, half = params["weight_packed"].shape
            return out_features, half * 2
        weight = params.get("weight")
        if weight is None or len(weight.shape) != 2:
            return None
        if weight.dtype == "U8":  # ModelOpt's packed FP4: two values per byte
            return weight.shape[0], weight.shape[1] * 2
        return weight.shape[0], weight.shape[1]

    # -- values -------------------------------------------------------------------------------
    @cached_property
    def small_scales(self) -> list[str]:
        """Per-tensor and per-channel scales: read even without --deep (FP8 block scales are not)."""
        names = []
        for name, (_, info) in self.tensors.items():
            kind = self.roles[name][2]
            if kind in SCALE_KINDS and info.numel <= SMALL_SCALE_MAX_ELEMENTS and not (kind == "weight_scale" and info.dtype == "F8_E4M3"):
                names.append(name)
        return names

    def values(self, names: list[str]) -> dict[str, Any]:
        """Flat float32 numpy arrays for small tensors, read in coalesced byte ranges."""
        wanted = [n for n in names if n not in self._values and n in self.tensors]
        if wanted:
            self._values.update(decode_all(read_coalesced(self.ckpt, [self.tensors[n] for n in wanted])))
        return {n: self._values[n] for n in names if n in self._values}


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


def _fp8_e4m3_table():
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

    fp8 = _fp8_e4m3_table()
    return {
        "F32": lambda raw: np.frombuffer(raw, "<f4"),
        "F16": lambda raw: np.frombuffer(raw, "<f2").astype(np.float32),
        "F64": lambda raw: np.frombuffer(raw, "<f8").astype(np.float32),
        "BF16": lambda raw: (np.frombuffer(raw, "<u2").astype(np.uint32) << 16).view(np.float32),
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
    return {name: decode(dtype, data) for name, (dtype, data) in raw.items()}


def iter_raw_chunks(ckpt: Checkpoint, shard: str, info: TensorInfo, chunk: int | None = None) -> Iterator[bytes]:
    """A tensor's bytes in chunks (a whole number of elements each), never all at once."""
    chunk = chunk or RAW_CHUNK_BYTES
    base = ckpt.headers[shard].data_start + info.begin
    for start in range(0, info.nbytes, chunk):
        yield ckpt.source.read(shard, base + start, min(chunk, info.nbytes - start))


# -- the audit ------------------------------------------------------------------------------------
def audit_checkpoint(
    location: str | Path,
    *,
    deep: bool = False,
    fmt: str = "auto",
    vllm_version: str = DEFAULT_VLLM_VERSION,
    trust_remote_code: bool = False,
) -> AuditReport:
    """Audit one checkpoint. Raises an Fp4forgeError (exit code 2) when it cannot be read at all."""
    from fp4forge.audit.checks_integrity import open_for_audit

    if fmt not in AUDIT_FORMATS:
        raise ConfigError(f"unknown format {fmt!r}: choose one of {', '.join(AUDIT_FORMATS)}", option="fmt")
    version = parse_version(vllm_version)
    ckpt, issues = open_for_audit(location)
    try:
        layout = layout_for_config(ckpt.config) if ckpt.config else None
    except LayoutError:
        layout = None
    ctx = AuditContext(
        ckpt=ckpt,
        layout=layout,
        declaration=read_declaration(ckpt.config, ckpt.extra_json),
        deep=deep,
        fmt=fmt,
        vllm_version=version,
        trust_remote_code=trust_remote_code,
    )
    try:
        for module_name in CHECKS:
            issues += importlib.import_module(module_name).run(ctx)
    finally:
        close = getattr(ckpt.source, "close", None)
        if close is not None:
            close()
    return AuditReport(
        checkpoint=str(location),
        findings=group_issues(issues),
        format=fmt,
        vllm_version=vllm_version,
        deep=deep,
        layout=layout.name if layout else None,
    )


def is_finite_positive(values) -> bool:
    """Every value finite and > 0 (NaN compares false, so `> 0` alone misses only +Inf)."""
    return values.size > 0 and bool((values > 0).all()) and bool((values < math.inf).all())


def describe_value(values) -> str:
    """A short text for a scale's value(s): `0`, `nan`, `-1.5`, or `3 of 128 non-finite or ≤ 0`."""
    import numpy as np

    if values.size == 1:
        value = float(values[0])
        return "nan" if math.isnan(value) else f"{value:g}"
    bad = int((~(np.isfinite(values) & (values > 0))).sum())
    return f"{bad:,} of {values.size:,} values non-finite or ≤ 0"


def issue(rule: str, group: str, subject: str, **kwargs: Any) -> Issue:
    """Shorthand used by the checks."""
    tensors = kwargs.pop("tensors", ())
    return Issue(rule=rule, group=group, subject=subject, tensors=tuple(tensors), **kwargs)
