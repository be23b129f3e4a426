"""Integrity: the files themselves. Shard headers and sizes, git-LFS pointers, the index in both
directions, stray and duplicate shards, and (``--deep``) the values: NaN/Inf weights, all-zero
matrices, invalid FP8 block scales, and the distribution of the per-tensor scales.

The engine opens the checkpoint with ``checkpoint.reader.open_checkpoint_lenient``, where a
finding says more than a refusal: each weight_map entry with a `..` or absolute path it drops
becomes an ``index-unsafe-path`` finding here and the rest of the index is audited. An index that
is not JSON at all, or a path that is neither a checkpoint nor a repo, cannot be audited: the
reader's error propagates (exit code 2).
"""

from __future__ import annotations

import stat
from dataclasses import replace
from itertools import repeat
from operator import eq
from pathlib import Path

import statistics

from fp4forge.audit.context import AuditContext, issue, modules_noun
from fp4forge.audit.deep_scan import VALUE_KINDS, deep_values, is_block_scale_checked
from fp4forge.audit.findings import Issue
from fp4forge.checkpoint.layout import UNKNOWN
from fp4forge.checkpoint.names import CONFIG_JSON, INDEX_JSON, SINGLE_SAFETENSORS
from fp4forge.checkpoint.reader import Checkpoint, RejectedIndexEntry
from fp4forge.checkpoint.safetensors_format import LENGTH_PREFIX_BYTES, TensorInfo, header_length, parse_header, parse_lfs_pointer
from fp4forge.errors import CheckpointError, DtypeError, Fp4forgeError, HeaderError, LfsPointerError, OffsetError

# Reader exception type -> rule (checked in order; the first isinstance wins).
SHARD_ERROR_RULES: tuple[tuple[type[CheckpointError], str], ...] = (
    (LfsPointerError, "shard-lfs-pointer"),
    (HeaderError, "shard-header-invalid"),
    (OffsetError, "shard-header-invalid"),
    (DtypeError, "shard-header-invalid"),
)
SHARD_GROUPS = {
    "shard-lfs-pointer": "shards that are git-LFS pointers",
    "shard-header-invalid": "shards whose header is invalid",
    "shard-missing": "shards the index references that do not exist",
    "shard-unreadable": "shards that cannot be read safely",
    "shard-size-mismatch": "shards whose size differs from what their header declares",
}
# Rules that report tensors as absent. Behind a shard that cannot be read they only report that
# shard's tensors again, with a fix (re-calibrate, re-export) that points away from the cause.
ABSENCE_RULES = frozenset({"parameter-missing", "kv-scale-absent", "scheme-tensor-missing", "moe-input-scale-invalid",
                           "w4a4-without-activation-scales", "index-tensor-not-in-shard", "fused-input-scale-mismatch"})
LFS_POINTER_MAX_BYTES = 1024
STATISTICS_KINDS = ("weight_global_scale", "input_scale", "input_global_scale")


# -- opening --------------------------------------------------------------------------------------
def unsafe_index_issues(rejected: list[RejectedIndexEntry]) -> list[Issue]:
    """A finding for each index entry the lenient open dropped."""
    issues = []
    for entry in rejected:
        if entry.reason == "total-size":
            issues.append(issue("index-total-size", "metadata.total_size", f"{entry.tensor} is {entry.shard!r}, not a non-negative integer", file=INDEX_JSON))
        else:
            issues.append(issue("index-unsafe-path", "weight_map entries whose shard path leaves the checkpoint", entry.tensor, tensors=[entry.tensor], file=INDEX_JSON, detail=repr(entry.shard)))
    return issues


# -- files and index ------------------------------------------------------------------------------
def run(ctx: AuditContext) -> list[Issue]:
    issues = shard_issues(ctx.ckpt) + index_issues(ctx.ckpt) + stray_shard_issues(ctx.ckpt) + permission_issues(ctx.ckpt)
    issues += config_issues(ctx)
    if ctx.deep:
        issues += value_issues(ctx)
    return issues


def shard_issues(ckpt: Checkpoint) -> list[Issue]:
    issues = []
    for shard, exc in ckpt.shard_errors.items():
        rule_id = _shard_error_rule(ckpt, shard, exc)
        detail = _lfs_detail(ckpt, shard) if rule_id == "shard-lfs-pointer" else exc.message
        issues.append(issue(rule_id, SHARD_GROUPS[rule_id], shard, file=shard, detail=detail))
    return issues


def without_knock_on(issues: list[Issue], ckpt: Checkpoint) -> list[Issue]:
    """One root cause reported once: absence findings about tensors an unreadable shard holds (per
    the index; every tensor when there is no index) are dropped, and the shard's finding says how
    many and of which rules."""
    unreadable = {i.subject for i in issues if i.rule in SHARD_GROUPS}
    if not unreadable:
        return issues
    held = None if ckpt.index is None else {n for n, shard in ckpt.index.weight_map.items() if shard in unreadable}
    prefixes = None if held is None else {n[:i] for n in held for i, c in enumerate(n) if c == "."} | held

    def follows(i: Issue) -> bool:
        if i.rule not in ABSENCE_RULES or prefixes is None:
            return i.rule in ABSENCE_RULES
        # every tensor it names is the shard's (a finding that also names others stays whole)
        return all(t in held for t in i.tensors) if i.tensors else i.subject in prefixes

    dropped = [i for i in issues if follows(i)]
    if not dropped:
        return issues
    rules = ", ".join(dict.fromkeys(i.rule for i in dropped))
    note = f"{len(dropped):,} findings that follow from it ({rules}: tensors this shard holds) are not reported; audit again once it is whole"
    return [replace(i, note=note) if i.rule in SHARD_GROUPS else i for i in issues if not follows(i)]


def _lfs_detail(ckpt: Checkpoint, shard: str) -> str:
    """The pointer names the real file: say which one (the reader saw only its first bytes)."""
    try:
        pointer = parse_lfs_pointer(ckpt.source.read(shard, 0, LFS_POINTER_MAX_BYTES))
    except Fp4forgeError:
        pointer = None
    if pointer is None:
        return "git-LFS pointer"
    return f"pointer to {pointer.oid or 'an unnamed object'}, {pointer.size:,} bytes"


def _shard_error_rule(ckpt: Checkpoint, shard: str, exc: CheckpointError) -> str:
    for error_type, rule_id in SHARD_ERROR_RULES:
        if isinstance(exc, error_type):
            return rule_id
    try:
        if not ckpt.source.exists(shard):
            return "shard-missing"
    except Fp4forgeError:
        return "shard-unreadable"  # e.g. a symlink out of the checkpoint: refused, not followed
    return "shard-size-mismatch" if _size_differs(ckpt, shard) else "shard-unreadable"


def _size_differs(ckpt: Checkpoint, shard: str) -> bool:
    """Re-read the header (already known to be valid) to compare its declared end with the file."""
    try:
        size = ckpt.source.size(shard)
        prefix = ckpt.source.read(shard, 0, LENGTH_PREFIX_BYTES)
        length = header_length(prefix, source=shard, file_size=size)
        header = parse_header(ckpt.source.read(shard, LENGTH_PREFIX_BYTES, length), source=shard, header_len=length)
    except Fp4forgeError:
        return False
    return header.declared_file_size != size


def index_issues(ckpt: Checkpoint) -> list[Issue]:
    if _index_agrees(ckpt):  # the usual case, settled with C-level passes over 10^5 names
        # the sum of (end - begin) over every entry, from the columns (each name once, as in
        # ``tensors``: both header parsers build them from distinct names), with no list of entries
        return _total_size_issues(ckpt, sum(sum(header.columns.ends) - sum(header.columns.begins) for header in ckpt.headers.values()))
    return _index_issues_one_by_one(ckpt)


def _index_agrees(ckpt: Checkpoint) -> bool:
    """No name stored twice, and weight_map maps exactly every stored name to the shard holding it."""
    count = sum(len(header.tensors) for header in ckpt.headers.values())
    if ckpt.index is not None:
        # as many entries as stored tensors, each stored name mapped to its own shard: then no name
        # is stored twice (weight_map names one shard per name) and weight_map lists nothing else
        weight_map = ckpt.index.weight_map
        # operator.eq, not shard.__eq__: str.__eq__(None) is NotImplemented, which is truthy, so a
        # name missing from weight_map would pass
        return len(weight_map) == count and all(
            all(map(eq, repeat(shard), map(weight_map.get, header.tensors))) for shard, header in ckpt.headers.items()
        )
    stored: set[str] = set()
    for header in ckpt.headers.values():
        stored.update(header.tensors)
    return len(stored) == count


def _total_size_issues(ckpt: Checkpoint, stored: int) -> list[Issue]:
    if ckpt.index is None or ckpt.index.total_size is None or ckpt.shard_errors or stored == ckpt.index.total_size:
        return []
    return [issue("index-total-size", "metadata.total_size", f"{ckpt.index.total_size:,} bytes declared, {stored:,} stored", file=INDEX_JSON)]


def _index_issues_one_by_one(ckpt: Checkpoint) -> list[Issue]:
    issues: list[Issue] = []
    holders: dict[str, list[str]] = {}
    for shard, header in ckpt.headers.items():
        for name in header.tensors:
            holders.setdefault(name, []).append(shard)
    for name, shards in holders.items():
        if len(shards) > 1:
            issues.append(issue("tensor-duplicate", "tensors stored in more than one shard", name, tensors=[name], detail=" and ".join(shards), file=shards[0]))
    if ckpt.index is None:
        return issues
    weight_map = ckpt.index.weight_map
    for name, shard in weight_map.items():
        header = ckpt.headers.get(shard)
        if header is not None and name not in header.tensors:
            elsewhere = holders.get(name)
            detail = f"listed in {shard}" + (f", stored in {', '.join(elsewhere)}" if elsewhere else ", stored nowhere")
            issues.append(issue("index-tensor-not-in-shard", "weight_map entries their shard does not hold", name, tensors=[name], detail=detail, file=INDEX_JSON))
    for name, shards in holders.items():
        if name not in weight_map:
            issues.append(issue("index-tensor-unlisted", "tensors missing from weight_map", name, tensors=[name], file=shards[0]))
    if ckpt.index.total_size is not None and not ckpt.shard_errors:
        sizes = {name: info.nbytes for header in ckpt.headers.values() for name, info in header.tensors.items()}
        stored = sum(sizes.values())  # each name once, as save_pretrained counts it
        if stored != ckpt.index.total_size:
            issues.append(issue("index-total-size", "metadata.total_size", f"{ckpt.index.total_size:,} bytes declared, {stored:,} stored", file=INDEX_JSON))
    return issues


def stray_shard_issues(ckpt: Checkpoint) -> list[Issue]:
    """Top-level .safetensors files the loaders will not read (only local directories can be listed)."""
    listed = ckpt.source.list_files()
    if listed is None or (ckpt.index is None and SINGLE_SAFETENSORS not in ckpt.shard_names):
        return []
    loaded = set(ckpt.shard_names)
    why = "vLLM only loads the shards the index references" if ckpt.index else f"with {SINGLE_SAFETENSORS} and no index, transformers reads only {SINGLE_SAFETENSORS} (vLLM reads every file)"
    return [
        issue("shard-unreferenced", ".safetensors files no loader is told about", name, file=name, note=why)
        for name in listed
        if name.endswith(".safetensors") and "/" not in name and name not in loaded
    ]


def permission_issues(ckpt: Checkpoint) -> list[Issue]:
    """Files of a local checkpoint that only their owner may read (modes travel with many copies)."""
    root = getattr(ckpt.source, "root", None)
    listed = ckpt.source.list_files()
    if root is None or listed is None:
        return []
    issues = []
    for name in sorted(listed):
        try:
            mode = (Path(root) / name).stat().st_mode
        except OSError:
            continue
        if not mode & stat.S_IROTH:
            issues.append(issue("file-not-world-readable", "files only their owner can read", name, file=name, detail=f"mode {stat.S_IMODE(mode):04o}"))
    return issues


def config_issues(ctx: AuditContext) -> list[Issue]:
    if ctx.ckpt.config is None:
        return [issue("config-missing", CONFIG_JSON, "not found next to the shards")]
    if ctx.layout is None or ctx.layout.inferred:
        config = ctx.ckpt.config
        architectures = config.get("architectures") or []
        named = ", ".join(map(str, architectures)) if isinstance(architectures, list) else repr(architectures)
        arch = named or str(config.get("model_type"))
        return [issue("architecture-unknown", "architecture transformers does not know: components inferred from tensor names", arch, file=CONFIG_JSON)]
    return []


# -- values (--deep) ------------------------------------------------------------------------------
def value_issues(ctx: AuditContext) -> list[Issue]:
    """NaN/Inf and all-zero weights, NaN or negative FP8 block scales: from the one scan of the
    values (``deep_scan``), reported tensor by tensor in the checkpoint's order."""
    values = deep_values(ctx)
    issues: list[Issue] = []
    for name, (shard, info) in ctx.tensors.items():
        kind = ctx.kind(name)
        if kind in VALUE_KINDS:
            issues += _weight_value_issues(shard, info, *values.weight(name))
        elif is_block_scale_checked(kind, info):
            issues += _block_scale_issues(shard, info, *values.block_scale(name))
    return issues + scale_statistics(ctx)


def _weight_value_issues(shard: str, info: TensorInfo, nonfinite: int, nonzero: bool) -> list[Issue]:
    issues = []
    if nonfinite:
        issues.append(issue("weight-not-finite", "weights with NaN or Inf", info.name, tensors=[info.name], file=shard, detail=f"{nonfinite:,} of {info.numel:,} values"))
    if not nonzero and len(info.shape) == 2 and info.numel:
        issues.append(issue("weight-all-zero", "weight matrices that are entirely zero", info.name, tensors=[info.name], file=shard))
    return issues


def _block_scale_issues(shard: str, info: TensorInfo, nan: int, negative: int) -> list[Issue]:
    if not (nan or negative):
        return []
    return [issue("block-scale-invalid", "FP8 block scales that are NaN or negative", info.name, tensors=[info.name], file=shard, detail=f"{nan:,} NaN, {negative:,} negative")]


def scale_statistics(ctx: AuditContext) -> list[Issue]:
    """min / median / max of each per-tensor scale kind, per component."""
    names: dict[tuple[str, str], list[str]] = {}
    for name, (_, info) in ctx.tensors.items():
        module, suffix, kind = ctx.roles[name]
        if kind in STATISTICS_KINDS and info.numel == 1:
            names.setdefault((ctx.component(module), suffix), []).append(name)
    issues = []
    for (component, suffix), members in sorted(names.items()):
        values = [float(v[0]) for v in ctx.values(members).values()]
        if values:
            label = modules_noun(component) if component != UNKNOWN else "unclassified modules"
            detail = f"min {min(values):.4g}, median {statistics.median(values):.4g}, max {max(values):.4g} over {len(values):,}"
            issues.append(issue("scale-statistics", f"{suffix} over {label}", detail))
    return issues
