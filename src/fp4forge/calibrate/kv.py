"""FP8 KV-cache scales: calibrate them into a checkpoint, transplant them from a donor, show them.

Scale = amax / 448 per layer (per tensor; per KV head where the layout has a form for it:
compressed-tensors ``strategy: attn_head``, shape [num_kv_heads, 1, 1]). Names and dtypes follow
``layouts/_schemes.toml`` (compressed-tensors ``<layer>.self_attn.k_scale`` BF16 [1]; ModelOpt
``<layer>.self_attn.k_proj.k_scale`` F32 []).

The scales travel as one extra shard, ``model-kvscales.safetensors``, beside the checkpoint's own
shards, which are never rewritten. Installing into a checkpoint writes every new file under a
temporary name and renames them in an order where each intermediate state is a valid checkpoint
(shard, then the re-resolved index, then the declaration): at no point does a declaration exist
without its tensors, which is the defect docs/laguna-card.md#kv-cache-declared-without-scales describes (an FP8 cache at
scale 1.0).

Declarations written: compressed-tensors ``quantization_config.kv_cache_scheme`` (a KV-only
config when the checkpoint had none); ModelOpt ``kv_cache_quant_algo: FP8`` in
``hf_quant_config.json`` and ``kv_cache_scheme {dynamic: false, num_bits: 8, type: float}`` in
config.json. vLLM's ModelOpt loader requires a ``quant_algo``, so a KV-only ModelOpt declaration
names ``FP8`` and lists every Linear in ``exclude_modules`` (no weight is quantized).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fp4forge.calibrate.options import CalibrationOptions
from fp4forge.checkpoint.atomic import StagedFiles, atomic_output_dir, staged_files
from fp4forge.checkpoint.declarations import CT, MODELOPT, read_declaration
from fp4forge.checkpoint.names import CONFIG_JSON, HF_QUANT_CONFIG_JSON, INDEX_JSON, KV_SCALES_SAFETENSORS, PROVENANCE_JSON, natural_key
from fp4forge.checkpoint.quantized import attention_layers, find_kv_scale_names, kv_layout
from fp4forge.checkpoint.reader import TORCH_DTYPES, Checkpoint, open_checkpoint
from fp4forge.checkpoint.schemes import kv_role_names, scheme_table
from fp4forge.checkpoint.tensor_file import write_tensors
from fp4forge.checkpoint.stats import KV_ROLES, kv_amax_name, read_stats
from fp4forge.errors import ConfigError, WriteError, require_choice
from fp4forge.model.distributed import current as current_ranks
from fp4forge.numerics.fp8 import FP8_E4M3_MAX
from fp4forge.quantize.qconfig import declare_kv

KV_SHARD = KV_SCALES_SAFETENSORS
LAYOUTS = (CT, MODELOPT)
ROLES = ("k_scale", "v_scale")


@dataclass
class KvScales:
    """F32 scales per layer prefix (``model.layers.N``): {"k_scale": t, "v_scale": t}, each
    t of shape [] (per tensor) or [num_kv_heads] (per head)."""

    layers: dict[str, dict[str, torch.Tensor]]
    provenance: dict[str, Any] = field(default_factory=dict)
    source_dtypes: dict[str, str] = field(default_factory=dict)  # role -> dtype the values came in
    lossless: bool = False  # True: store the values bit-exactly (transplants); False: round to the layout's dtype

    @property
    def per_head(self) -> bool:
        return any(t.dim() > 0 for roles in self.layers.values() for t in roles.values())


# -- where scales come from --------------------------------------------------------------------
def scales_from_stats(path: str | Path, layers: list[str], *, per_head: bool = False) -> KvScales:
    """k/v scale = amax / 448 from an fp4forge statistics file."""
    stats = read_stats(path)
    out: dict[str, dict[str, torch.Tensor]] = {}
    for layer in layers:
        entry = {}
        for role, kv in zip(ROLES, KV_ROLES):
            amax = stats.tensor(kv_amax_name(layer, kv, per_head=per_head))
            entry[role] = (amax if per_head else amax.reshape(())) / FP8_E4M3_MAX
        out[layer] = entry
    return KvScales(out, {"source": "calibration", "statistics": Path(path).name, "formula": "amax / 448", "per_head": per_head})


def find_scale_tensors(ckpt: Checkpoint, layers: list[str]) -> tuple[str | None, dict[str, dict[str, str]]]:
    """(layout whose names the KV scales use, {layer: {role: tensor name}}): the checkpoint's side
    of :func:`fp4forge.checkpoint.quantized.find_kv_scale_names`."""
    return find_kv_scale_names({info.name for _, info in ckpt.tensors()}, layers)


def scales_from_checkpoint(ckpt: Checkpoint) -> tuple[str, KvScales]:
    """A donor's KV scales as F32 values, and the layout they were stored in."""
    layers = attention_layers(ckpt)
    layout, found = find_scale_tensors(ckpt, layers)
    if layout is None:
        raise ConfigError("the checkpoint carries no k_scale/v_scale tensors", file=ckpt.display)
    missing = [f"{layer} {role}" for layer in layers for role in ROLES if role not in found.get(layer, {})]
    if missing:
        raise ConfigError(f"the checkpoint lacks KV scales for {len(missing)} layer roles, e.g. {missing[:3]}", file=ckpt.display)
    dtypes: dict[str, str] = {}
    out: dict[str, dict[str, torch.Tensor]] = {}
    for layer, names in found.items():
        entry = {}
        for role, name in names.items():
            dtypes[role] = ckpt.locate(name)[1].dtype
            value = ckpt.read_tensor(name).to(torch.float32)
            entry[role] = value.reshape(()) if value.numel() == 1 else value.reshape(-1)
        out[layer] = entry
    return layout, KvScales(out, {"source": "checkpoint", "checkpoint": ckpt.display, "layout": layout}, dtypes, lossless=True)


def is_stats_file(path: str | Path) -> bool:
    """Whether ``path`` is a statistics file (else: a checkpoint to calibrate)."""
    return Path(path).is_file() and Path(path).suffix == ".safetensors"


@dataclass(frozen=True)
class KvOptions:
    """The kv calibrate job's options: ``layout_format`` is needed only when the checkpoint
    declares no quantization yet; ``calibration`` runs when the source is a BF16 checkpoint."""

    layout_format: str | None = None
    per_head: bool = False  # one scale per KV head (compressed-tensors attn_head)
    calibration: CalibrationOptions = field(default_factory=CalibrationOptions)

    def __post_init__(self) -> None:
        if self.layout_format is not None:
            require_choice(self.layout_format, LAYOUTS, "layout_format")


def calibrate_kv(source: str | Path, into: str | Path, options: KvOptions = KvOptions(), *, progress: Any = None) -> dict[str, Any]:
    """Compute k/v scales (amax / 448) and install them into the checkpoint ``into``.

    ``source``: a statistics file, or the BF16 checkpoint to calibrate now (with
    ``options.calibration``; its statistics go to a temporary file beside ``into`` and are
    removed). Returns the provenance entry written to ``fp4forge.json``."""
    source, into = Path(source), Path(into)
    # Everything that would refuse the install is checked before a calibration is spent on it.
    _, _, layers = install_target(into, options.layout_format)
    stats_path = source
    if not is_stats_file(source):
        from fp4forge.calibrate.run import calibrate_to_file

        stats_path = into.parent / f".{into.name}.kv-stats.safetensors"
        calibrate_to_file(source, stats_path, options.calibration, progress=progress)

    def install() -> dict[str, Any]:
        try:
            scales = scales_from_stats(stats_path, layers, per_head=options.per_head)
        finally:
            if stats_path != source:
                stats_path.unlink(missing_ok=True)
        return install_kv_scales(into, scales, options.layout_format)

    # Under a launcher every rank calibrated its share; rank 0 alone writes into the checkpoint.
    return current_ranks().on_main(install, "installing the KV scales")


# -- scales -> tensors in a layout ---------------------------------------------------------------
def _storage_dtype(layout: str, role: str, values: torch.Tensor, scales: KvScales) -> torch.dtype:
    """The layout's dtype for ``role``. A transplant (``lossless``) keeps values bit-exact: when the
    default dtype would round them it keeps the donor's dtype if the layout accepts it
    (compressed-tensors takes F32 scales), so CT -> ModelOpt -> CT returns the same bytes."""
    entry = scheme_table()[layout]["kv"][role]
    default = getattr(torch, TORCH_DTYPES[entry["dtype"]])
    if not scales.lossless or torch.equal(values.to(default).to(torch.float32), values):
        return default
    source = scales.source_dtypes.get(role, "F32")
    if source in (entry["dtype"], *entry.get("accept", [])):
        return getattr(torch, TORCH_DTYPES[source])
    raise ConfigError(f"{layout} cannot store the donor's {source} {role} values exactly")


def layout_tensors(scales: KvScales, layout: str) -> dict[str, torch.Tensor]:
    """The tensors ``scales`` become under ``layout``'s names, dtypes and shapes."""
    out: dict[str, torch.Tensor] = {}
    for layer, roles in scales.layers.items():
        specs = kv_role_names(layout, layer)
        for role, value in roles.items():
            spec = specs[role]
            dtype = _storage_dtype(layout, role, value, scales)
            if value.dim() > 0 and layout == CT:  # attn_head: [num_kv_heads, 1, 1]
                out[spec.name] = value.to(dtype).reshape(-1, 1, 1)
            else:
                out[spec.name] = value.amax().to(dtype).reshape(spec.shape)  # per head -> the max
    return out


# -- writing into a checkpoint directory ---------------------------------------------------------
def _weight_map(ckpt: Checkpoint) -> dict[str, str]:
    if ckpt.index is not None:
        return dict(ckpt.index.weight_map)
    return {info.name: shard for shard, info in ckpt.tensors()}


def _total_size(ckpt: Checkpoint, extra: int) -> int:
    return sum(info.nbytes for _, info in ckpt.tensors()) + extra


def _json_text(doc: Any) -> str:
    return json.dumps(doc, indent=2, sort_keys=True) + "\n"


def install_target(directory: str | Path, layout: str | None) -> tuple[Checkpoint, str, list[str]]:
    """(checkpoint, layout, attention layers) of a checkpoint that can receive KV scales, or the
    ``ConfigError`` that refuses it: a declared layout other than ``layout``, no layout at all, or
    KV scales it already carries outside fp4forge's own ``model-kvscales.safetensors`` (which a
    new install replaces). Checked first by ``calibrate_kv``, before any calibration is spent."""
    ckpt = open_checkpoint(Path(directory))
    declared = kv_layout(ckpt)
    if declared is not None and layout is not None and layout != declared:
        raise ConfigError(f"the checkpoint declares {declared}; cannot add {layout} KV scales to it", file=ckpt.display)
    layout = declared or layout
    if layout is None:
        raise ConfigError(f"the checkpoint declares no quantization: choose the layout ({' or '.join(LAYOUTS)})", file=ckpt.display, option="layout_format")
    layers = attention_layers(ckpt)
    _, existing = find_scale_tensors(ckpt, layers)
    elsewhere = sorted({ckpt.locate(n)[0] for names in existing.values() for n in names.values()} - {KV_SHARD})
    if elsewhere:
        raise ConfigError(f"the checkpoint already carries KV scales in {elsewhere}; write a new checkpoint with `kv transplant` instead", file=ckpt.display)
    return ckpt, layout, layers


def install_kv_scales(directory: str | Path, scales: KvScales, layout: str | None = None) -> dict[str, Any]:
    """Add ``scales`` to the checkpoint at ``directory`` as ``model-kvscales.safetensors`` plus the
    re-resolved index and the KV declaration. ``layout``: needed only when the checkpoint declares
    no quantization yet. Returns the provenance entry written to ``fp4forge.json``."""
    directory = Path(directory)
    ckpt, layout, layers = install_target(directory, layout)
    missing = sorted(set(layers) - set(scales.layers), key=natural_key)
    if missing:
        raise ConfigError(f"no KV scales for {len(missing)} attention layers, e.g. {missing[:3]}", file=ckpt.display)
    foreign = sorted(set(scales.layers) - set(layers), key=natural_key)
    if foreign:
        raise ConfigError(f"KV scales for layers this checkpoint does not have: {foreign[:3]}", file=ckpt.display)
    tensors = layout_tensors(scales, layout)
    config, hf_quant = declare_kv(ckpt, layout, per_head=scales.per_head)
    provenance = {**scales.provenance, "layout": layout, "layers": len(layers), "shard": KV_SHARD, "tensors": len(tensors)}
    doc = json.loads(json.dumps(ckpt.extra_json.get(PROVENANCE_JSON) or {}))
    doc["kv_cache"] = {**doc.get("kv_cache", {}), "scales": provenance} if isinstance(doc.get("kv_cache"), dict) else {"scales": provenance}

    weight_map = {n: s for n, s in _weight_map(ckpt).items() if s != KV_SHARD}
    weight_map.update({name: KV_SHARD for name in tensors})
    kv_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    old_kv_bytes = sum(info.nbytes for shard, info in ckpt.tensors() if shard == KV_SHARD)
    index = {"metadata": {"total_size": _total_size(ckpt, kv_bytes - old_kv_bytes)}, "weight_map": dict(sorted(weight_map.items()))}

    # Renamed in the order that keeps each step loadable: tensors, index, then the declaration.
    with _updating(directory) as stage:
        write_tensors(stage.path(KV_SHARD), tensors, metadata={"format": "pt"})  # one key: safetensors orders a metadata map by hash
        _stage_json(stage, [(INDEX_JSON, index), (HF_QUANT_CONFIG_JSON, hf_quant), (CONFIG_JSON, config), (PROVENANCE_JSON, doc)])
    return provenance


def write_declaration(directory: str | Path, layout: str, *, per_head: bool = False) -> None:
    """Declare an FP8 KV cache without shipping scales (vLLM then runs the cache at 1.0: the defect
    of docs/laguna-card.md#kv-cache-declared-without-scales). For reproducing that state in tests
    and comparisons; never done implicitly."""
    directory = Path(directory)
    config, hf_quant = declare_kv(open_checkpoint(directory), layout, per_head=per_head)
    with _updating(directory) as stage:
        _stage_json(stage, [(HF_QUANT_CONFIG_JSON, hf_quant), (CONFIG_JSON, config)])


@contextlib.contextmanager
def _updating(directory: Path) -> Iterator[StagedFiles]:
    """Files staged beside the checkpoint's, renamed into place together (in staging order)."""
    try:
        with staged_files(directory) as stage:
            yield stage
    except OSError as exc:
        raise WriteError(f"could not update {directory}: {exc}") from exc


def _stage_json(stage: StagedFiles, docs: list[tuple[str, Any]]) -> None:
    """Stage every JSON doc (None: skip)."""
    for name, payload in docs:
        if payload is not None:
            stage.path(name).write_text(_json_text(payload), encoding="utf-8")


def _link_or_copy(src: Path, dst: Path) -> None:
    """Hard link when possible (shards are never modified in place, only replaced by rename)."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def transplant(donor: str | Path, recipient: str | Path, out: str | Path) -> dict[str, Any]:
    """Write ``out`` = ``recipient`` plus the donor's KV scales, converted to the recipient's layout.
    Refuses donors of another architecture, layer count or attention layout."""
    donor_ckpt = open_checkpoint(donor)
    recipient_ckpt = open_checkpoint(recipient)
    _check_compatible(donor_ckpt, recipient_ckpt)
    donor_layout, scales = scales_from_checkpoint(donor_ckpt)
    layout = kv_layout(recipient_ckpt) or donor_layout
    root = getattr(recipient_ckpt.source, "root", None)
    if root is None:
        raise ConfigError("the recipient must be a local checkpoint directory", file=recipient_ckpt.display)
    scales.provenance = {
        "source": "transplant",
        "donor": donor_ckpt.display,
        "donor_layout": donor_layout,
        "approximation": True,
        "note": "copied from a donor checkpoint of the same base model; the donor's own quantization noise rides along",
    }
    if scales.per_head and layout == MODELOPT:
        scales.provenance["per_head_reduced"] = "per-head donor scales reduced to their max (ModelOpt has per-tensor KV scales)"
    with atomic_output_dir(Path(out)) as staging:
        for path in sorted(Path(root).iterdir()):
            if path.is_file():
                _link_or_copy(path, staging / path.name)
        return install_kv_scales(staging, scales, layout)


ARCHITECTURE_KEYS = ("architectures", "model_type", "num_hidden_layers", "num_key_value_heads", "head_dim", "hidden_size")


def _check_compatible(donor: Checkpoint, recipient: Checkpoint) -> None:
    donor_config, recipient_config = donor.config or {}, recipient.config or {}
    differing = [k for k in ARCHITECTURE_KEYS if donor_config.get(k) != recipient_config.get(k)]
    if differing:
        detail = ", ".join(f"{k}: {donor_config.get(k)!r} vs {recipient_config.get(k)!r}" for k in differing)
        raise ConfigError(f"refusing to transplant KV scales between different architectures ({detail})", file=donor.display)
    donor_layers, recipient_layers = attention_layers(donor), attention_layers(recipient)
    if donor_layers != recipient_layers:
        only = sorted(set(donor_layers) ^ set(recipient_layers), key=natural_key)
        raise ConfigError(f"attention layers differ between donor and recipient, e.g. {only[:3]}", file=donor.display)


# -- showing -------------------------------------------------------------------------------------
@dataclass
class KvReport:
    checkpoint: str
    layout: str | None
    declared: bool
    layers: list[dict[str, Any]]
    findings: list[dict[str, Any]]

    def to_json(self) -> dict[str, Any]:
        return {"checkpoint": self.checkpoint, "layout": self.layout, "declared": self.declared, "layers": self.layers, "findings": self.findings}


def _value(tensor: torch.Tensor) -> float | list[float]:
    flat = tensor.to(torch.float32).reshape(-1)
    return float(flat[0]) if flat.numel() == 1 else [float(v) for v in flat]


# kv show's finding codes (what kv.json readers key on) -> the audit rule (audit/rules.toml) each
# is an instance of: one rule system, so `kv show` and `fp4forge audit` give one defect one
# severity, title, rationale and fix.
KV_SHOW_RULES = {
    "declared-without-scales": "kv-scale-absent",
    "missing-layers": "kv-scale-absent",
    "scales-without-declaration": "kv-scale-undeclared",
    "misnamed": "kv-scale-misnamed",
    "constant-1.0": "kv-scale-uncalibrated",
    "invalid": "kv-scale-invalid",
    "amax-over-448": "kv-amax-over-448",
}


def _finding(code: str, message: str, layers: list[str] | None = None) -> dict[str, Any]:
    from fp4forge.audit.findings import rule

    spec = rule(KV_SHOW_RULES[code])
    return {"rule": spec.id, "code": code, "severity": spec.severity, "title": spec.title, "message": message,
            "why": spec.rationale, "fix": spec.fix, "layers": layers or []}


def show(location: str | Path) -> KvReport:
    """Per-layer k/v scales (and the amax they imply), with findings."""
    ckpt = open_checkpoint(location)
    declaration = read_declaration(ckpt.config, ckpt.extra_json)
    declared_kv = declaration.kv if declaration is not None else None
    declared_layout = declaration.format if declaration is not None else None
    layers = attention_layers(ckpt)
    name_layout, found = find_scale_tensors(ckpt, layers)
    rows = []
    for layer in layers:
        row: dict[str, Any] = {"layer": layer}
        for role in ROLES:
            name = found.get(layer, {}).get(role)
            value = ckpt.read_tensor(name) if name else None
            row[role] = None if value is None else _value(value)
            row[role.replace("scale", "amax")] = None if value is None else _value(value.to(torch.float32) * FP8_E4M3_MAX)
        rows.append(row)
    findings = _kv_findings(rows, layers, declared_kv is not None, declared_layout, name_layout)
    return KvReport(ckpt.display, declared_layout or name_layout, declared_kv is not None, rows, findings)


def _flat(value: float | list[float] | None) -> list[float]:
    return [] if value is None else value if isinstance(value, list) else [value]


def _kv_findings(rows: list[dict[str, Any]], layers: list[str], declared: bool, declared_layout: str | None, name_layout: str | None) -> list[dict[str, Any]]:
    findings = []
    with_scales = [r for r in rows if r["k_scale"] is not None or r["v_scale"] is not None]
    incomplete = [r["layer"] for r in rows if r["k_scale"] is None or r["v_scale"] is None]
    if declared and not with_scales:
        findings.append(_finding("declared-without-scales", "FP8 KV cache declared but no k/v scale ships: vLLM runs the cache at scale 1.0"))
    elif declared and incomplete:
        findings.append(_finding("missing-layers", f"{len(incomplete)} attention layers lack a k or v scale: vLLM runs them at scale 1.0", incomplete))
    if with_scales and not declared:
        findings.append(_finding("scales-without-declaration", "k/v scales ship but no FP8 KV cache is declared: vLLM keeps a BF16 cache and ignores them"))
    if declared_layout and name_layout and declared_layout != name_layout:
        findings.append(_finding("misnamed", f"the scales use {name_layout} names but the checkpoint declares {declared_layout}: vLLM ignores them"))
    values = [v for r in with_scales for role in ROLES for v in _flat(r[role])]
    if values and all(v == 1.0 for v in values):
        findings.append(_finding("constant-1.0", "every k/v scale is exactly 1.0: an uncalibrated cache (vLLM's own fallback)"))
    bad = [r["layer"] for r in with_scales if any(not (math.isfinite(v) and v > 0) for role in ROLES for v in _flat(r[role]))]
    if bad:
        findings.append(_finding("invalid", "k/v scales that are zero, negative, NaN or Inf", bad))
    over = [r["layer"] for r in with_scales if any(v > 1.0 for role in ROLES for v in _flat(r[role]))]
    if over:
        findings.append(_finding("amax-over-448", "scales above 1.0 imply K/V amax > 448: at scale 1.0 these layers' caches would saturate", over))
    return findings
