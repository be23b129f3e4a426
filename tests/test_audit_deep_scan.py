"""`audit --deep` reads every value once (``audit/deep_scan.py``): its findings are exactly those
of the per-tensor checks it replaced (``tests/deep_audit_reference.py``, numpy over whole tensors)
on fp4forge's exports and on planted defects; the CPU's thread path and the device path (run on
the CPU device here) give the same numbers for any piece size; and any scale value gives
findings, never an exception (docs/audit.md#what-is-read)."""

from __future__ import annotations

import math
import threading
from functools import partial
from pathlib import Path

import pytest
import torch

from fp4forge.audit import checks_declarations, checks_integrity, deep_scan
from fp4forge.audit.engine import audit_checkpoint
from fp4forge.audit.options import AuditOptions
from fp4forge.quantize.act_scales import ConstantAmax
from fp4forge.quantize.export import QuantizeOptions, quantize_checkpoint
from fp4forge.quantize.recipe import load_recipe
from tests.deep_audit_reference import use_reference
from tests.test_audit_integrity import rebuild

EXPERT = "model.layers.2.mlp.experts.3"
PER_TENSOR = {"compressed-tensors": "weight_global_scale", "modelopt": "weight_scale_2"}


@pytest.fixture(scope="module")
def exports(lc_source_dir: Path, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("deep-scan")
    out = {"source": lc_source_dir}
    for recipe, layout in (("nvfp4-experts", "compressed-tensors"), ("nvfp4-experts", "modelopt"), ("nvfp4-all-linear", "compressed-tensors"), ("fp8", "modelopt")):
        out[f"{recipe}-{layout}"] = _export(lc_source_dir, root / f"{recipe}-{layout}", recipe, layout)
    return out


def _export(source: Path, target: Path, recipe: str, layout: str) -> Path:
    quantize_checkpoint(source, target, QuantizeOptions(load_recipe(recipe), layout, act_amax=ConstantAmax(8.0)))
    return target


def _weights_nan_inf_zero(t: dict) -> None:
    t["model.layers.1.mlp.experts.3.up_proj.weight"][5, 7] = float("nan")
    t["model.layers.2.self_attn.o_proj.weight"][0, 0] = float("inf")
    t["model.layers.3.mlp.shared_expert.down_proj.weight"].zero_()


def _nvfp4_defects(layout: str, t: dict) -> None:
    down = f"{EXPERT}.down_proj"
    scale, per_tensor = t[f"{down}.weight_scale"].float(), t[f"{down}.{PER_TENSOR[layout]}"].float()
    # block scales written without the global scale (the exporter bug scale-magnitude exists for)
    t[f"{down}.weight_scale"] = (scale / per_tensor if layout == "compressed-tensors" else scale * per_tensor).to(torch.float8_e4m3fn)
    t[f"{EXPERT}.up_proj.weight_scale"].view(torch.uint8)[0, 0] = 0x7F  # NaN
    t[f"{EXPERT}.gate_proj.weight_scale"].view(torch.uint8)[1, 1] = 0xB8  # negative
    codes = f"{EXPERT.replace('.3', '.5')}.down_proj.weight" + ("_packed" if layout == "compressed-tensors" else "")
    t[codes].zero_()  # every code zero


def _fp8_defects(t: dict) -> None:
    t["model.layers.1.self_attn.o_proj.weight"] = (t["model.layers.1.self_attn.o_proj.weight"].float() / 16).to(torch.float8_e4m3fn)
    t["model.layers.1.self_attn.q_proj.weight"].view(torch.uint8)[0, :3] = 0x7F


PLANTED = {
    "weights": ("source", _weights_nan_inf_zero),
    "nvfp4-ct": ("nvfp4-experts-compressed-tensors", partial(_nvfp4_defects, "compressed-tensors")),
    "nvfp4-modelopt": ("nvfp4-experts-modelopt", partial(_nvfp4_defects, "modelopt")),
    "fp8": ("fp8-modelopt", _fp8_defects),
}


@pytest.fixture(scope="module")
def cases(exports, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("deep-planted")
    planted = {f"planted-{name}": rebuild(exports[base], root / name, edit) for name, (base, edit) in PLANTED.items()}
    return {**exports, **planted}


def _doc(path: Path) -> dict:
    return audit_checkpoint(str(path), AuditOptions(deep=True, device="cpu")).to_json()


def test_the_scan_reports_what_the_per_tensor_checks_reported(cases, monkeypatch) -> None:
    new = {name: _doc(path) for name, path in cases.items()}
    use_reference(monkeypatch)
    old = {name: _doc(path) for name, path in cases.items()}
    for name in cases:
        assert new[name] == old[name], name
    # the planted defects are there to be found (else equality would prove little)
    rules = {name: {f["rule"] for f in doc["findings"]} for name, doc in new.items()}
    assert {"weight-not-finite", "weight-all-zero"} <= rules["planted-weights"]
    for name in ("planted-nvfp4-ct", "planted-nvfp4-modelopt"):
        assert {"scale-magnitude", "block-scale-invalid", "weight-all-zero"} <= rules[name], name
    assert {"scale-magnitude", "weight-not-finite"} <= rules["planted-fp8"]


def _scan_with(monkeypatch, **how) -> None:
    def values(ctx):
        if "scan" not in ctx.memo:
            ctx.memo["scan"] = deep_scan.scan(ctx, "cpu", **how)
        return ctx.memo["scan"]

    monkeypatch.setattr(checks_integrity, "deep_values", values)
    monkeypatch.setattr(checks_declarations, "deep_values", values)


@pytest.mark.parametrize("how", [dict(path="device"), dict(path="device", piece_bytes=1000, threads=2), dict(path="threads", piece_bytes=1000, threads=3)])
def test_device_and_thread_paths_give_the_same_findings(how, cases, monkeypatch) -> None:
    """The device path (what a GPU runs: its ring of reused buffers, here on the CPU device) and
    odd piece sizes (tensors cut mid-row into many pieces, buffers reused across tensors) against
    the checks the scan replaced, tensor by tensor."""
    with monkeypatch.context() as old:
        use_reference(old)
        expected = {name: _doc(path) for name, path in cases.items()}
    _scan_with(monkeypatch, **how)
    for name, path in cases.items():
        assert _doc(path) == expected[name], (name, how)


@pytest.mark.parametrize("path", ["threads", "device"])
def test_pieces_reduced_together_give_each_piece_its_own_row(path, cases, monkeypatch) -> None:
    """Neighbouring experts' tensors are read and reduced as one job (rows of a strided view):
    every tensor's numbers equal those of a scan that takes each piece alone, on every export
    and planted defect; and the exports' experts do share jobs (else this proved nothing)."""
    from fp4forge.audit.context import AuditContext
    from fp4forge.checkpoint.layout import layout_or_inferred
    from fp4forge.checkpoint.reader import open_checkpoint

    def scan(ckpt):
        ctx = AuditContext(ckpt=ckpt, layout=layout_or_inferred(ckpt.config), declaration=None, deep=True, fmt="auto", vllm_version=(0, 32), device="cpu")
        units = deep_scan.plan_units(ctx)
        return deep_scan.scan_units(ckpt, units, "cpu", path=path, threads=2).rows, deep_scan.plan_jobs(units)

    together = {name: scan(open_checkpoint(p)) for name, p in cases.items()}
    monkeypatch.setattr(deep_scan, "_extends", lambda *args: False)
    for name, p in cases.items():
        alone, jobs = scan(open_checkpoint(p))
        assert together[name][0] == alone and all(job.rows == 1 for job in jobs), name
    assert max(job.rows for job in together["nvfp4-experts-compressed-tensors"][1]) > 1
    assert max(job.rows for job in together["nvfp4-experts-modelopt"][1]) > 1


def test_a_check_that_raises_stops_the_background_scan(cases, monkeypatch) -> None:
    """The scan runs beside the header checks: when one raises, the audit raises that error
    (exit 2, as before) and leaves no scan thread reading the closed checkpoint."""

    from fp4forge.audit import checks_server_files
    from fp4forge.errors import CheckpointError

    def broken(ctx):
        raise CheckpointError("planted")

    monkeypatch.setattr(checks_server_files, "run", broken)
    with pytest.raises(CheckpointError, match="planted"):
        _doc(cases["nvfp4-experts-compressed-tensors"])
    assert not [t for t in threading.enumerate() if t.name.startswith("deep-audit")]


def test_read_ahead_hints_every_byte_once_in_order() -> None:
    """The page-cache hints: each planned byte once, adjacent parts as one range, never more
    than ``ahead`` bytes beyond the pieces taken."""

    class Recording:
        def __init__(self):
            self.hints: list[tuple[str, int, int]] = []

        def will_need(self, shard, start, length):
            self.hints.append((shard, start, length))

    class Ckpt:
        source = Recording()

    part = deep_scan.Part
    pieces = [(part("a", 0, 100),), (part("a", 100, 50), part("b", 0, 10)), (part("a", 400, 100),), (part("b", 10, 30),)]
    jobs = [deep_scan.Job("float", "BF16", 1, tuple((p, 0) for p in piece), ()) for piece in pieces]
    ahead = deep_scan._ReadAhead(Ckpt(), jobs, 120)
    ahead.hint()
    assert Ckpt.source.hints == [("a", 0, 150)]  # 150 >= 120: the second part completes the range
    ahead.take(jobs[0])
    assert Ckpt.source.hints[1:] == [("b", 0, 10), ("a", 400, 100)]
    for job in jobs[1:]:
        ahead.take(job)
    assert Ckpt.source.hints[3:] == [("b", 10, 30)]


_FRESH_CONTEXT = ("import sys\nfrom fp4forge.audit import deep_scan\nfrom fp4forge.audit.context import AuditContext\n"
                  "from fp4forge.checkpoint.layout import layout_or_inferred\nfrom fp4forge.checkpoint.reader import open_checkpoint\n"
                  "ckpt = open_checkpoint(sys.argv[1])\n"
                  "ctx = AuditContext(ckpt=ckpt, layout=layout_or_inferred(ckpt.config), declaration=None, deep=True, fmt='auto', vllm_version=(0, 32))\n")


def _in_a_fresh_process(code: str, checkpoint: Path) -> None:
    """``code`` run after :data:`_FRESH_CONTEXT` (``ctx`` of ``checkpoint``) in a new interpreter: nothing imported before."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _FRESH_CONTEXT + code, str(checkpoint)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


def test_the_reductions_modules_are_imported_before_the_pool_threads_start(exports) -> None:
    """In a fresh process, every module the reductions import lazily is loaded before the scan's
    pool threads run: first imports racing on several threads fail now and then ("partially
    initialized module") and the audit exits with a traceback."""
    _in_a_fresh_process(
        "lazy = ('fp4forge.numerics.nvfp4', 'fp4forge.numerics.fp8', 'fp4forge.numerics.e2m1', 'fp4forge.numerics.conventions',"
        " 'fp4forge.checkpoint.codecs', 'fp4forge.checkpoint.raw')\n"
        "seen, inner = [], deep_scan._rows_on_threads\n"
        "def spy(*a, **k):\n"
        "    seen.append([m for m in lazy if m not in sys.modules])\n"
        "    return inner(*a, **k)\n"
        "deep_scan._rows_on_threads = spy\n"
        "assert 'fp4forge.numerics' not in sys.modules\n"
        "deep_scan.scan(ctx, 'cpu', threads=4)\n"
        "assert seen == [[]], seen\n", exports["nvfp4-experts-compressed-tensors"])


def test_the_first_hint_blocks_neither_the_import_nor_the_reads() -> None:
    """A hint that blocks (a full disk queue) holds up neither :meth:`start`'s caller (which then
    imports torch) nor :meth:`take`; once it returns, taking hints on from where it stopped."""

    class Blocking:
        def __init__(self):
            self.hints: list[tuple[str, int, int]] = []
            self.release, self.entered = threading.Event(), threading.Event()

        def will_need(self, shard, start, length):
            self.entered.set()
            assert self.release.wait(10)
            self.hints.append((shard, start, length))

    class Ckpt:
        source = Blocking()

    part = deep_scan.Part
    jobs = [deep_scan.Job("float", "BF16", 1, ((part("a", 100 * i, 100), 0),), ()) for i in range(4)]
    ahead = deep_scan._ReadAhead(Ckpt(), jobs, 150)
    ahead.start()
    assert Ckpt.source.entered.wait(10)
    assert ahead.take(jobs[0]) is jobs[0]  # returns while the first hint still blocks
    Ckpt.source.release.set()
    for thread in [t for t in threading.enumerate() if t.name == "fp4forge-read-ahead"]:
        thread.join(10)
    assert Ckpt.source.hints == [("a", 0, 200)]
    for job in jobs[1:]:
        ahead.take(job)
    assert Ckpt.source.hints[1:] == [("a", 200, 200)]


@pytest.mark.parametrize("value", [0.0, -0.0, -1.0, math.nan, math.inf, -math.inf, 1e-45])
@pytest.mark.parametrize("layout", ["compressed-tensors", "modelopt"])
def test_any_per_tensor_scale_gives_findings(layout, value, exports, tmp_path) -> None:
    """Zero (ZeroDivisionError before), negative, NaN, infinite and subnormal NVFP4 global scales:
    an error finding and exit 1, never an exception."""
    down = f"{EXPERT}.down_proj.{PER_TENSOR[layout]}"
    path = rebuild(exports[f"nvfp4-experts-{layout}"], tmp_path / "planted", lambda t: t[down].fill_(value))
    report = audit_checkpoint(str(path), AuditOptions(deep=True, device="cpu"))
    assert report.exit_code == 1
    named = [f for f in report.findings if f.severity == "error" and any(down.rsplit(".", 1)[0] in t for t in f.tensors)]
    assert named, [f.message for f in report.findings]


def test_all_zero_block_scales_and_codes_are_findings(exports, tmp_path) -> None:
    def plant(t):
        t[f"{EXPERT}.down_proj.weight_scale"].zero_()

    report = audit_checkpoint(str(rebuild(exports["nvfp4-experts-compressed-tensors"], tmp_path / "z", plant)), AuditOptions(deep=True, device="cpu"))
    assert "scale-magnitude" in {f.rule for f in report.findings if f.severity == "error"}


# -- the reductions against numpy, on bytes made to hit every branch ----------------------------------
def _bytes(values) -> torch.Tensor:
    import numpy as np

    raw = bytearray(np.ascontiguousarray(values).tobytes())
    return torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)


@pytest.mark.parametrize("dtype, np_dtype", [("BF16", None), ("F16", "<f2"), ("F32", "<f4"), ("F64", "<f8")])
@pytest.mark.parametrize("count", [0, 1, 3, 4096, 4099])
def test_float_rows_count_what_numpy_counts(dtype, np_dtype, count) -> None:
    import numpy as np

    from fp4forge.checkpoint.raw import float_view

    rng = np.random.default_rng(count)
    values = rng.standard_normal(count).astype(np.float32)
    if count > 3:
        values[rng.integers(0, count, 5)] = [np.nan, np.inf, -np.inf, -0.0, 0.0]
    raw = (values.view("<u4") >> 16).astype("<u2") if dtype == "BF16" else values.astype(np_dtype)
    decoded = float_view(dtype, raw.tobytes())
    expected = [int((~np.isfinite(decoded)).sum()), float(bool(np.any(decoded != 0)))]
    unit = deep_scan.Unit("float", ("w",), dtype, ())
    for shortcuts in (True, False):
        assert deep_scan.reduce_piece(unit, [_bytes(raw)], shortcuts=shortcuts).tolist()[:2] == expected, shortcuts
    zeros = np.zeros(count, dtype=raw.dtype)  # also -0.0 only: all zero
    assert deep_scan.reduce_piece(unit, [_bytes(zeros)]).tolist()[:2] == [0, 0]


@pytest.mark.parametrize("seed", range(8))
def test_nvfp4_products_by_search_equal_every_block(seed) -> None:
    """The search and the branch-free reduction against numpy over E4M3 / E2M1 tables by hand."""
    import numpy as np

    from fp4forge.checkpoint.codecs import Nvfp4Codec
    from fp4forge.checkpoint.raw import fp8_e4m3_table

    rng = np.random.default_rng(seed)
    blocks = int(rng.integers(1, 300))
    packed = rng.integers(0, 256, blocks * 8, dtype=np.uint8)
    scales = rng.integers(0, 256, blocks, dtype=np.uint8) if seed % 2 else rng.integers(0, 0x7E, blocks, dtype=np.uint8)
    if seed == 2:
        scales[:] = 0x7F  # every scale NaN: -inf
    if seed == 4:
        packed[:] &= 0x88  # every code zero (signs only)
    if seed == 6:
        scales[:] = rng.choice([0x00, 0x80, 0x7F, 0xFF], blocks)  # zero scales among NaN ones
        scales[0] = 0x00
    if seed == 7:
        scales[:] = 0x40
        scales[1::2] = 0x3F  # many rivals below the largest scale, whose block holds a small code
        packed[:8] = 0x11
    magnitudes = np.asarray([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    top = np.maximum(magnitudes[packed & 7], magnitudes[packed >> 4 & 7]).reshape(-1, 8).max(axis=1)
    products = top * np.abs(fp8_e4m3_table()[scales])
    expected = [float(top.any()), float(np.nanmax(products)) if not np.isnan(products).all() else -math.inf]
    for search in (True, False):
        assert Nvfp4Codec("nvfp4").peek_piece(_bytes(packed), _bytes(scales), search=search).tolist() == expected, search
        assert Nvfp4Codec("nvfp4").peek_piece(_bytes(packed[:0]), _bytes(scales[:0]), search=search).tolist() == [0.0, -math.inf]


def test_block_scale_and_fp8_rows_count_what_numpy_counts() -> None:
    import numpy as np

    from fp4forge.checkpoint.raw import fp8_e4m3_table

    rng = np.random.default_rng(0)
    for codes in (rng.integers(0, 256, 1001, dtype=np.uint8), rng.integers(0, 0x7F, 64, dtype=np.uint8), np.zeros(9, dtype=np.uint8)):
        values = fp8_e4m3_table()[codes]
        nan, negative = int(np.isnan(values).sum()), int((values < 0).sum())
        finite = np.abs(values[~np.isnan(values)])
        top = int(np.argmax(fp8_e4m3_table()[:0x7F] == finite.max())) if finite.size and finite.max() > 0 else 0
        for shortcuts in (True, False):
            block = deep_scan.reduce_piece(deep_scan.Unit("block_scale", ("s",), "F8_E4M3", ()), [_bytes(codes)], shortcuts=shortcuts).tolist()
            fp8 = deep_scan.reduce_piece(deep_scan.Unit("e4m3", ("w",), "F8_E4M3", ()), [_bytes(codes)], shortcuts=shortcuts).tolist()
            assert block[:2] == [nan, negative] and fp8[:3] == [nan, float(bool((codes & 0x7F).any())), top], shortcuts


@pytest.mark.parametrize("kernel, dtype, widths", [("float", "BF16", (64,)), ("float", "F32", (64,)), ("e4m3", "F8_E4M3", (24,)),
                                                    ("block_scale", "F8_E4M3", (24,)), ("codes", "U8", (64,)), ("fp4_pair", "U8", (64, 8))])
@pytest.mark.parametrize("offset, gap", [(0, 0), (4, 4), (3, 5), (1, 0)])
def test_rows_at_any_offset_and_row_distance_equal_each_piece_alone(kernel, dtype, widths, offset, gap) -> None:
    """A job's rows are strided views into its buffer at the file's phase: any offset and any
    distance between rows (a copy where the int64 lanes cannot view them) gives each row what
    its piece alone gives, with and without the shortcuts."""
    generator = torch.Generator().manual_seed(offset * 7 + gap)
    rows = 5
    pieces = [[torch.randint(0, 256, (width,), dtype=torch.uint8, generator=generator) for width in widths] for _ in range(rows)]
    pieces[2][0][:] = 0  # a row of zeros among the others
    data = []
    for part, width in enumerate(widths):
        stride = width + gap
        flat = torch.zeros(offset + rows * stride, dtype=torch.uint8)
        for row in range(rows):
            flat[offset + row * stride : offset + row * stride + width] = pieces[row][part]
        data.append(flat.as_strided((rows, width), (stride, 1), offset))
    unit = deep_scan.Unit(kernel, ("x",), dtype, ())
    for shortcuts in (True, False):
        together = deep_scan.reduce_rows(kernel, dtype, data, shortcuts=shortcuts)
        alone = torch.stack([deep_scan.reduce_piece(unit, [p.clone() for p in pieces[row]], shortcuts=shortcuts) for row in range(rows)])
        assert torch.equal(together, alone), shortcuts


@pytest.mark.parametrize("piece_bytes", [deep_scan.PIECE_BYTES, 999, 17])
def test_a_piece_with_its_alignment_fits_the_piece_size(piece_bytes) -> None:
    """Codes and block scales of one piece, the scales 8-aligned after the codes, take at most
    ``piece_bytes`` (pinned host buffers are allocated in powers of two: 16 MiB + 8 would take
    32 MiB); a piece too small for one block still holds one."""
    from types import SimpleNamespace

    from fp4forge.checkpoint.safetensors_format import TensorInfo

    ckpt = SimpleNamespace(headers={"s": SimpleNamespace(data_start=8)})
    rows = 3 * 7001  # blocks that no piece size divides
    codes, scales = TensorInfo("w", "U8", (rows, 8), 0, rows * 8), TensorInfo("s", "F8_E4M3", (rows, 1), rows * 8, rows * 9)
    unit = deep_scan._pair(ckpt, ("s", codes), ("s", scales), piece_bytes)
    assert sum(p[0].length for p in unit.pieces) == codes.nbytes and sum(p[1].length for p in unit.pieces) == scales.nbytes
    assert deep_scan._buffer_bytes(deep_scan.plan_jobs([unit], piece_bytes)) <= max(piece_bytes, 16)


def test_the_scan_is_planned_and_its_reads_hinted_before_torch_is_imported(exports) -> None:
    """An audit asks the disk for the values it will scan before importing torch (seconds on a
    GPU node), so a cold read overlaps the import: planning imports no torch."""
    _in_a_fresh_process("jobs = deep_scan.plan_jobs(deep_scan.plan_units(ctx))\n"
                        "assert jobs and 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))[:3]\n",
                        exports["nvfp4-experts-compressed-tensors"])
