"""The fused CPU kernel for NVFP4 min-max quantization of bf16 weights (docs/quantization.md#export-speed).

The eager torch path makes ~25 passes over every element (block maxima, scale rounding, division,
E2M1 rounding, packing, error sums); ``nvfp4_minmax.c`` does one loop per 16-element block with
exactly the same float operations, so the bytes are identical (tests/test_nvfp4_kernel.py checks
them against the eager path, both conventions). It is plain C compiled on first use with the
machine's C compiler (``$CC``, else ``cc``) into ``$FP4FORGE_CACHE_DIR/kernels`` (default
``~/.cache/fp4forge/kernels``), keyed by the source, the compiler, the flags and the CPU, and
loaded through ctypes, which releases the GIL during a call: the exporter's compute threads run
it in parallel.

No compiler, a failed build or ``FP4FORGE_KERNEL=eager``: :func:`kernel_status` says why and
every caller uses the eager path (same bytes, slower).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from fp4forge.numerics.conventions import convention_rule

__all__ = ["KernelStatus", "kernel_status", "minmax_bf16", "absmax_bf16", "usable_for"]

_SOURCE = Path(__file__).with_name("nvfp4_minmax.c")
# -ffp-contract=off: no fused multiply-add (the eager path rounds every product); no -ffast-math.
# -fno-tree-vectorize: the AVX2 intrinsics carry the vector work. GCC 12's auto-vectoriser with
# -march=native on an AVX-512 AMD EPYC turned the error-sum lanes wrong (ref_sq an eighth of the
# true sum; the bytes right); the export is as fast without it (benchmarks/RESULTS.md).
_FLAGS = ["-O3", "-march=native", "-fno-tree-vectorize", "-ffp-contract=off", "-fno-math-errno", "-fPIC", "-shared", "-std=c11"]
# The error sums are F64 sums of the eager path's F32 squares, in another order: they differ by
# ~1e-15 relative (tests/test_nvfp4_kernel.py); more is a wrong build.
SELF_CHECK_RTOL = 1e-12
ENV_SWITCH = "FP4FORGE_KERNEL"  # "eager" disables the kernel


@dataclass(frozen=True)
class KernelStatus:
    """``name``: "c" (the compiled kernel) or "eager"; ``detail``: the library path, or why not."""

    name: str
    detail: str

    @property
    def available(self) -> bool:
        return self.name == "c"


_LOCK = threading.Lock()
_LIB: ctypes.CDLL | None = None
_STATUS: KernelStatus | None = None


def _cache_dir() -> Path:
    root = os.environ.get("FP4FORGE_CACHE_DIR") or Path.home() / ".cache" / "fp4forge"
    return Path(root) / "kernels"


def _cpu_identity() -> str:
    """What -march=native depends on: the CPU's model and flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    keep = [line for line in text.splitlines() if line.startswith(("model name", "flags"))][:2]
    return "\n".join(keep) or platform.machine()


def _build() -> tuple[ctypes.CDLL | None, KernelStatus]:
    if os.environ.get(ENV_SWITCH, "").lower() == "eager":
        return None, KernelStatus("eager", f"{ENV_SWITCH}=eager")
    if sys.byteorder != "little":
        return None, KernelStatus("eager", "big-endian host")
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        return None, KernelStatus("eager", "no C compiler (set CC or install gcc)")
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60).stdout
        source = _SOURCE.read_bytes()
    except (OSError, subprocess.SubprocessError) as exc:
        return None, KernelStatus("eager", f"C compiler {compiler} not usable: {exc}")
    key = hashlib.blake2b(b"\0".join([source, version.encode(), " ".join(_FLAGS).encode(), _cpu_identity().encode()]), digest_size=12).hexdigest()
    target = _cache_dir() / f"nvfp4_minmax-{key}.so"
    if not target.exists():
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
                built = Path(tmp) / target.name
                proc = subprocess.run([compiler, *_FLAGS, "-o", str(built), str(_SOURCE)], capture_output=True, text=True, timeout=300)
                if proc.returncode != 0:
                    return None, KernelStatus("eager", f"kernel build failed: {proc.stderr.strip()[-300:]}")
                os.replace(built, target)  # atomic: a concurrent process sees the whole library or none
        except (OSError, subprocess.SubprocessError) as exc:
            return None, KernelStatus("eager", f"kernel build failed: {exc}")
    try:
        lib = ctypes.CDLL(str(target))
    except OSError as exc:
        return None, KernelStatus("eager", f"kernel load failed: {exc}")
    lib.fp4forge_absmax_bf16.restype = ctypes.c_uint16
    lib.fp4forge_absmax_bf16.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    lib.fp4forge_nvfp4_minmax_bf16.restype = ctypes.c_int
    lib.fp4forge_nvfp4_minmax_bf16.argtypes = [
        ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_float, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
    ]
    problem = self_check(lib)
    if problem is not None:
        return None, KernelStatus("eager", f"the compiled kernel disagreed with the eager path on its self-check ({problem}); {compiler} {' '.join(_FLAGS)}")
    return lib, KernelStatus("c", str(target))


def self_check(lib: ctypes.CDLL) -> str | None:
    """Run the loaded kernel against the eager path on a fixed input that takes both its 8-block
    and its one-block loops, both conventions, with error sums: None if bytes and sums agree, else
    what differs. A compiler that builds the kernel wrong (it happened: see _FLAGS) then costs
    speed, not correctness."""
    from fp4forge.numerics.nvfp4 import eager_minmax  # (nvfp4 imports this module)

    generator = torch.Generator().manual_seed(0x5EED)
    w = torch.randn(3, 19 * 16, generator=generator).to(torch.bfloat16)  # 19 blocks a row: 2 x 8 + 3
    for convention in ("compressed-tensors", "modelopt"):
        expected, err_sq, ref_sq = eager_minmax(w, convention)
        got = _minmax(lib, w, convention, expected.global_scale, True)
        if got is None:
            return f"{convention}: the kernel refused a regular input"
        packed, block_scale, kernel_err, kernel_ref = got
        if not torch.equal(packed, expected.packed) or not torch.equal(block_scale.view(torch.uint8), expected.block_scale.view(torch.uint8)):
            return f"{convention}: different bytes"
        for name, a, b in (("err_sq", kernel_err, err_sq), ("ref_sq", kernel_ref, ref_sq)):
            if abs(a - b) > SELF_CHECK_RTOL * abs(b):
                return f"{convention}: {name} {a:.6g} against {b:.6g}"
    return None


def kernel_status() -> KernelStatus:
    """Build or load the kernel once per process; say which path NVFP4 min-max runs on."""
    global _LIB, _STATUS
    with _LOCK:
        if _STATUS is None:
            _LIB, _STATUS = _build()
        return _STATUS


def reset() -> None:
    """Forget the loaded kernel (tests: re-read ``FP4FORGE_KERNEL``)."""
    global _LIB, _STATUS
    with _LOCK:
        _LIB, _STATUS = None, None


def usable_for(w: Tensor) -> bool:
    """The kernel takes contiguous bf16 CPU tensors (last dim a multiple of 16, not empty)."""
    return (
        w.dtype == torch.bfloat16
        and w.device.type == "cpu"
        and w.ndim >= 1
        and w.numel() > 0
        and w.shape[-1] % 16 == 0
        and w.is_contiguous()
        and not w.requires_grad
        and kernel_status().available
    )


def absmax_bf16(w: Tensor) -> Tensor:
    """``max |w|`` of a contiguous bf16 CPU tensor, as a 0-dim bf16 tensor (NaN/Inf propagate as
    patterns above every finite one, like ``block_absmax``)."""
    assert _LIB is not None
    bits = _LIB.fp4forge_absmax_bf16(w.data_ptr(), w.numel())
    return torch.tensor(bits, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)


def minmax_bf16(w: Tensor, convention: str, scalar: Tensor, error: bool) -> tuple[Tensor, Tensor, float, float] | None:
    """Packed codes ``[..., K/2]`` uint8, block scales ``[..., K/16]`` float8_e4m3fn, and with
    ``error`` the sums (err_sq, ref_sq) of the min-max quantization of ``w`` under the
    convention's per-tensor ``scalar`` (CT ``weight_global_scale`` / ModelOpt ``weight_scale_2``).
    None when some block's step is zero or not finite: the caller takes the general path."""
    assert _LIB is not None
    return _minmax(_LIB, w, convention, scalar, error)


def _minmax(lib: ctypes.CDLL, w: Tensor, convention: str, scalar: Tensor, error: bool) -> tuple[Tensor, Tensor, float, float] | None:
    g = scalar.to(torch.float32).reshape(())
    rule = convention_rule(convention)
    g6 = rule.kernel_divisor(g)
    n_blocks = w.numel() // 16
    packed = torch.empty((*w.shape[:-1], w.shape[-1] // 2), dtype=torch.uint8)
    scales = torch.empty((*w.shape[:-1], w.shape[-1] // 16), dtype=torch.uint8)
    sums = (ctypes.c_double * 2)(0.0, 0.0)
    irregular = lib.fp4forge_nvfp4_minmax_bf16(
        w.data_ptr(), n_blocks, rule.kernel_mode, float(g), float(g6),
        packed.data_ptr(), scales.data_ptr(), sums if error else None,
    )
    if irregular:
        return None
    return packed, scales.view(torch.float8_e4m3fn), float(sums[0]), float(sums[1])
