"""The deep audit's value checks as they were before the one-scan rewrite: per tensor, 64 MiB
chunks, numpy over an E4M3 table, and the scale magnitude read again tensor by tensor. Kept as
the oracle of tests/test_audit_deep_scan.py: the streamed, vectorised scan must report exactly
what this reports (except where this one raised, e.g. a global scale of 0)."""

from __future__ import annotations

import numpy as np

from fp4forge.audit import checks_declarations, checks_integrity
from fp4forge.audit.context import AuditContext
from fp4forge.audit.findings import Issue
from fp4forge.checkpoint.raw import FLOAT_DTYPES, float_view, fp8_e4m3_table, iter_raw_chunks
from fp4forge.checkpoint.safetensors_format import TensorInfo

E2M1_MAGNITUDES = np.asarray([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])  # by hand: docs/formats.md#nvfp4


def value_issues(ctx: AuditContext) -> list[Issue]:
    issues: list[Issue] = []
    for name, (shard, info) in ctx.tensors.items():
        kind = ctx.kind(name)
        if kind in ("weight", "packed_fp4"):
            issues += _weight_value_issues(ctx, shard, info)
        elif kind == "weight_scale" and info.dtype == "F8_E4M3" and len(info.shape) == 2 and info.shape[1] > 1:
            issues += _block_scale_issues(ctx, shard, info)
    return issues + checks_integrity.scale_statistics(ctx)


def _weight_value_issues(ctx: AuditContext, shard: str, info: TensorInfo) -> list[Issue]:
    nonfinite, nonzero = 0, False
    for chunk in iter_raw_chunks(ctx.ckpt, shard, info):
        data = np.frombuffer(chunk, dtype=np.uint8)
        if info.dtype in FLOAT_DTYPES:
            values = float_view(info.dtype, chunk)
            nonfinite += int((~np.isfinite(values)).sum())
            nonzero = nonzero or bool(np.any(values != 0))
        elif info.dtype == "F8_E4M3":
            nonfinite += int(((data & 0x7F) == 0x7F).sum())
            nonzero = nonzero or bool(np.any((data & 0x7F) != 0))
        else:
            nonzero = nonzero or bool(np.any((data & 0x77) != 0))
    return checks_integrity._weight_value_issues(shard, info, nonfinite, nonzero)  # the findings' wording is not under test


def _block_scale_issues(ctx: AuditContext, shard: str, info: TensorInfo) -> list[Issue]:
    nan = negative = 0
    for chunk in iter_raw_chunks(ctx.ckpt, shard, info):
        data = np.frombuffer(chunk, dtype=np.uint8)
        nan += int(((data & 0x7F) == 0x7F).sum())
        negative += int((((data & 0x80) != 0) & ((data & 0x7F) != 0) & ((data & 0x7F) != 0x7F)).sum())
    return checks_integrity._block_scale_issues(shard, info, nan, negative)


def magnitude_of(ctx: AuditContext, module: str, values=None) -> tuple[float, float, str] | None:
    """The old per-Linear read: whole tensors, numpy, the multiplier in float64."""
    params = ctx.modules.get(module, {})
    packed = params.get("weight_packed") or (params.get("weight") if params.get("weight") is not None and params["weight"].dtype == "U8" else None)
    block = params.get("weight_scale")
    table = fp8_e4m3_table()
    if packed is not None and block is not None and block.dtype == "F8_E4M3":
        per_tensor = params.get("weight_global_scale") or params.get("weight_scale_2")
        if per_tensor is None or per_tensor.numel != 1:
            return None
        suffix = next(s for s, i in params.items() if i is per_tensor)
        value = float(ctx.values([f"{module}.{suffix}"]).popitem()[1][0])
        codes = np.frombuffer(ctx.ckpt.read_raw(f"{module}.{next(s for s, i in params.items() if i is packed)}"), dtype=np.uint8)
        top = np.maximum(E2M1_MAGNITUDES[codes & 7], E2M1_MAGNITUDES[(codes >> 4) & 7]).reshape(-1, 8).max(axis=1)
        scales = np.abs(table[np.frombuffer(ctx.ckpt.read_raw(f"{module}.weight_scale"), dtype=np.uint8)])
        if top.size != scales.size or not top.any():
            return None
        multiplier = 1.0 / value if suffix == "weight_global_scale" else value  # CT divides the step, ModelOpt multiplies
        return float(np.nanmax(top * scales)) * multiplier, 6.0 * 448.0 * multiplier, "nvfp4"
    weight = params.get("weight")
    if weight is None or weight.dtype != "F8_E4M3":
        return None
    codes = np.abs(table[np.frombuffer(ctx.ckpt.read_raw(f"{module}.weight"), dtype=np.uint8)])
    if not codes.size or not np.nanmax(codes) > 0:
        return None
    return float(np.nanmax(codes)), 448.0, "fp8"


def use_reference(monkeypatch) -> None:
    """Make the audit run the old value checks (pytest's monkeypatch undoes it)."""
    monkeypatch.setattr(checks_integrity, "value_issues", value_issues)
    monkeypatch.setattr(checks_declarations, "_magnitude_of", magnitude_of)
    monkeypatch.setattr(checks_declarations, "deep_values", lambda ctx: None)
