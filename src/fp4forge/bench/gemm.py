"""GEMM precision microbench: every projection shape of a model, M from 1 to 8192, per kernel.

For each Linear shape ``[N, K]`` a config implies and each token count ``M`` it times ``y = x Wᵀ``
under the kernels a quantized checkpoint would run, and measures how far each output lies from
an FP32 reference:

* ``bf16``            the unquantized baseline (``torch.matmul`` in bfloat16);
* ``fp8``             ``torch._scaled_mm`` on inputs that are already FP8 E4M3 (GEMM alone);
* ``fp8-static-act``  the same plus what a W8A8 layer with a calibrated input scale does first:
                      divide, clamp, cast the bf16 activation;
* ``fp8-dynamic-act`` FP8_DYNAMIC: per-channel weight scales, and per-token activation scales
                      taken from the activation's amax on every call;
* ``nvfp4-emulated``  NVFP4 weights dequantized to bf16, then a bf16 GEMM: what a GPU without FP4
                      tensor cores (Hopper, CPU) runs. Labelled emulated; no native FP4 path is
                      timed, because a native kernel must be measured where one exists.

Timing is honest about caches: the weight operand rotates through enough copies that the set is
larger than ``cache_bytes`` (default 256 MiB, over the H200's 50 MB L2 by 5×), so M = 1 reads its
weight from memory as decode does. Each sample times ``inner`` back-to-back calls (CUDA events on a
GPU, replaying a CUDA graph of those calls so that kernel-launch overhead is not what is timed;
``perf_counter`` on a CPU); the result keeps every sample, and the median with the 10th/90th
percentiles is what tables show.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Literal, Sequence

import torch
from torch import Tensor

from fp4forge.errors import ConfigError
from fp4forge.numerics.fp8 import fp8_dynamic_scale, fp8_quantize_activation, fp8_quantize_weight
from fp4forge.numerics.nvfp4 import nvfp4_dequantize, nvfp4_quantize

Kernel = Literal["bf16", "fp8", "fp8-static-act", "fp8-dynamic-act", "nvfp4-emulated"]
KERNELS: tuple[Kernel, ...] = ("bf16", "fp8", "fp8-static-act", "fp8-dynamic-act", "nvfp4-emulated")
DEFAULT_M: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


@dataclass(frozen=True)
class GemmShape:
    """One projection: ``y[M, n] = x[M, k] @ W[n, k]ᵀ``; ``per_layer`` how many a decoder layer has
    (routed experts count once: a token meets top-k of them, each the same shape)."""

    name: str
    n: int
    k: int


def _distinct(values: Iterable[int]) -> list[int]:
    seen: list[int] = []
    for v in values:
        if v not in seen:
            seen.append(v)
    return seen


def projection_shapes(config: dict[str, Any]) -> list[GemmShape]:
    """Every distinct Linear shape of a transformers MoE config: attention q/k/v/o (per distinct
    head count, for per-layer head patterns such as Laguna's), the fused gate/up and down of routed
    experts, of the shared expert and of a dense MLP, and the LM head."""
    try:
        hidden = int(config["hidden_size"])
        heads_default = int(config["num_attention_heads"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"config lacks a usable hidden_size / num_attention_heads: {exc}") from None
    head_dim = int(config.get("head_dim") or hidden // heads_default)
    kv_heads = int(config.get("num_key_value_heads") or heads_default)
    heads = _distinct(int(h) for h in (config.get("num_attention_heads_per_layer") or [heads_default]))
    shapes: list[GemmShape] = []
    for h in heads:
        tag = f"[{h} heads]" if len(heads) > 1 else ""
        shapes.append(GemmShape(f"q_proj{tag}", h * head_dim, hidden))
        shapes.append(GemmShape(f"o_proj{tag}", hidden, h * head_dim))
    shapes.append(GemmShape("k_proj / v_proj", kv_heads * head_dim, hidden))
    moe = config.get("moe_intermediate_size")
    if moe:
        shapes.append(GemmShape("experts.gate_up", 2 * int(moe), hidden))
        shapes.append(GemmShape("experts.down", hidden, int(moe)))
    shared = config.get("shared_expert_intermediate_size")
    if shared:
        shapes.append(GemmShape("shared_expert.gate_up", 2 * int(shared), hidden))
        shapes.append(GemmShape("shared_expert.down", hidden, int(shared)))
    dense = config.get("intermediate_size")
    has_dense = not moe or "dense" in (config.get("mlp_layer_types") or []) or config.get("first_k_dense_replace")
    if dense and has_dense:
        shapes.append(GemmShape("mlp.gate_up", 2 * int(dense), hidden))
        shapes.append(GemmShape("mlp.down", hidden, int(dense)))
    if config.get("vocab_size"):
        shapes.append(GemmShape("lm_head", int(config["vocab_size"]), hidden))
    return shapes


@dataclass
class GemmResult:
    shape: str
    n: int
    k: int
    m: int
    kernel: str
    samples_us: list[float]  # time per call, one entry per sample
    rel_error: float | None  # ‖y - y_fp32‖ / ‖y_fp32‖ over the output
    note: str | None = None
    mode: str = "eager"  # how the calls were issued: "cuda-graph" replay or an "eager" loop

    @property
    def median_us(self) -> float:
        return statistics.median(self.samples_us)

    def quantile_us(self, q: float) -> float:
        ordered = sorted(self.samples_us)
        pos = q * (len(ordered) - 1)
        lo, hi = math.floor(pos), math.ceil(pos)
        return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)

    def tflops(self) -> float:
        return 2 * self.m * self.n * self.k / (self.median_us * 1e-6) / 1e12

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(
            median_us=self.median_us,
            p10_us=self.quantile_us(0.10),
            p90_us=self.quantile_us(0.90),
            tflops=self.tflops(),
        )
        return out


@dataclass
class GemmReport:
    device: str
    device_name: str
    torch_version: str
    fp4_tensor_cores: bool
    results: list[GemmResult] = field(default_factory=list)
    not_run: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "device_name": self.device_name,
            "torch": self.torch_version,
            "fp4_tensor_cores": self.fp4_tensor_cores,
            "kernels": list(dict.fromkeys(r.kernel for r in self.results)),
            "results": [r.to_json() for r in self.results],
            "not_run": self.not_run,
        }


class _Timer:
    """Time per call of ``fn`` over ``inner`` back-to-back calls.

    On a GPU the calls are captured once into a CUDA graph and the graph's replay is timed with
    CUDA events: an eager loop would time the CPU's kernel launches (10–20 µs each in eager torch),
    not the GPU, for every small GEMM — and decode runs under CUDA graphs in vLLM too. Where a
    capture fails the eager loop is timed and the result says so (``mode``)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def prepare(self, fn: Callable[[int], Any], inner: int) -> tuple[Callable[[], None], str]:
        if not self.cuda:
            return (lambda: [fn(i) for i in range(inner)] and None), "eager"
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):  # warm the kernels and allocator outside the capture
                for i in range(inner):
                    fn(i)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for i in range(inner):
                    fn(i)
            return graph.replay, "cuda-graph"
        except RuntimeError:
            torch.cuda.synchronize()
            return (lambda: [fn(i) for i in range(inner)] and None), "eager"

    def __call__(self, run: Callable[[], None], inner: int) -> float:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) * 1e3 / inner
        t0 = time.perf_counter()
        run()
        return (time.perf_counter() - t0) * 1e6 / inner


MAX_COPIES = 64


def _copies(bytes_each: int, cache_bytes: int) -> int:
    """How many copies of a weight make a set larger than the cache (at most MAX_COPIES: a weight
    that small is launch-bound whatever the cache does)."""
    return min(MAX_COPIES, max(1, math.ceil(cache_bytes / max(bytes_each, 1))))


def _rel_error(y: Tensor, ref: Tensor) -> float:
    return float(torch.linalg.vector_norm(y.float() - ref) / torch.linalg.vector_norm(ref).clamp_min(1e-30))


def fp4_tensor_cores(device: torch.device) -> bool:
    """Whether the GPU has FP4 tensor cores (Blackwell, compute capability 10.x and up)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 10


def _kernel_fns(kernel: Kernel, x: Tensor, weights: list[Tensor]) -> tuple[Callable[[int], Tensor], str | None]:
    """A call ``fn(i)`` computing ``x Wᵢᵀ`` with the kernel, weights prepared (quantized) up front."""
    if kernel == "bf16":
        ws = [w.to(torch.bfloat16) for w in weights]
        xb = x.to(torch.bfloat16)
        return (lambda i: xb @ ws[i % len(ws)].t()), None
    if kernel.startswith("fp8"):
        xb = x.to(torch.bfloat16)
        note = "activation quantized by unfused eager torch ops (vLLM fuses this step into one kernel)"
        if kernel == "fp8-dynamic-act":
            # FP8_DYNAMIC: per-channel weight scales, per-token activation scales found on every call
            wq = [fp8_quantize_weight(w, "channel") for w in weights]
            ws = [(q.weight.t(), q.scale.to(torch.float32).reshape(1, -1)) for q in wq]

            def dynamic(i: int) -> Tensor:
                s = fp8_dynamic_scale(xb)
                w, w_scale = ws[i % len(ws)]
                return torch._scaled_mm(fp8_quantize_activation(xb, s), w, s, w_scale, out_dtype=torch.bfloat16)

            return dynamic, note
        # static W8A8: per-tensor weight scale, a calibrated per-tensor input scale
        wq = [fp8_quantize_weight(w, "tensor") for w in weights]
        ws = [(q.weight.t(), q.scale.to(torch.float32).reshape(())) for q in wq]  # [K, N] column-major
        x_scale = fp8_dynamic_scale(xb, per_token=False)  # stands for the calibrated scale
        xq = fp8_quantize_activation(xb, x_scale)

        def gemm(a: Tensor, i: int) -> Tensor:
            w, w_scale = ws[i % len(ws)]
            return torch._scaled_mm(a, w, x_scale, w_scale, out_dtype=torch.bfloat16)

        if kernel == "fp8":
            return (lambda i: gemm(xq, i)), None
        return (lambda i: gemm(fp8_quantize_activation(xb, x_scale), i)), note
    if kernel == "nvfp4-emulated":
        qs = [nvfp4_quantize(w.to(torch.bfloat16), convention="modelopt") for w in weights]
        xb = x.to(torch.bfloat16)
        return (lambda i: xb @ nvfp4_dequantize(qs[i % len(qs)], torch.bfloat16).t()), "emulated: dequantize to bf16 + bf16 GEMM"
    raise ConfigError(f"unknown GEMM kernel {kernel!r}; known: {', '.join(KERNELS)}", option="kernels")


def run_gemm_bench(
    shapes: Sequence[GemmShape],
    *,
    m_values: Sequence[int] = DEFAULT_M,
    kernels: Sequence[Kernel] = KERNELS,
    device: str | torch.device = "cuda",
    samples: int = 20,
    inner: int = 10,
    warmup: int = 3,
    cache_bytes: int = 256 << 20,
    seed: int = 0,
    progress: Callable[[int, int, str], None] | None = None,
) -> GemmReport:
    """Time and check every (shape, M, kernel); see the module docstring for what is measured."""
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("GEMM bench asked for CUDA but torch sees no GPU", option="device")
    for k in kernels:
        if k not in KERNELS:
            raise ConfigError(f"unknown GEMM kernel {k!r}; known: {', '.join(KERNELS)}", option="kernels")
    if not m_values or min(m_values) < 1:
        raise ConfigError("M values must be positive integers", option="m_values")
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    report = GemmReport(str(dev), name, torch.__version__, fp4_tensor_cores(dev))
    if report.fp4_tensor_cores:
        report.not_run.append("native NVFP4 GEMM: this GPU has FP4 tensor cores, but fp4forge does not time a native kernel yet")
    else:
        report.not_run.append(f"native NVFP4 GEMM: {name} has no FP4 tensor cores (emulated path timed instead)")
    gen = torch.Generator(device="cpu").manual_seed(seed)
    timer = _Timer(dev)
    total, done = len(shapes) * len(m_values) * len(kernels), 0
    for shape in shapes:
        w_cpu = torch.randn(shape.n, shape.k, generator=gen) * 0.02
        copies = _copies(shape.n * shape.k * 2, cache_bytes)
        weights = [w_cpu.to(dev, torch.bfloat16)] + [
            (w_cpu + 1e-3 * torch.randn(shape.n, shape.k, generator=gen)).to(dev, torch.bfloat16) for _ in range(copies - 1)
        ]
        for m in m_values:
            x = torch.randn(m, shape.k, generator=gen).to(dev, torch.bfloat16)
            ref = x.float() @ weights[0].float().t()
            for kernel in kernels:
                if progress:
                    progress(done, total, f"{shape.name} [{shape.n}x{shape.k}] M={m} {kernel}")
                done += 1
                fn, note = _kernel_fns(kernel, x, weights)
                err = _rel_error(fn(0), ref)
                calls = max(inner, len(weights))  # one sample touches every weight copy
                run, mode = timer.prepare(fn, calls)
                for _ in range(warmup):
                    timer(run, calls)
                times = [timer(run, calls) for _ in range(samples)]
                report.results.append(GemmResult(shape.name, shape.n, shape.k, m, kernel, times, err, note, mode))
                del fn, run
        del weights
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    if progress:
        progress(done, total, "done")
    return report


def load_model_config(source: str) -> dict[str, Any]:
    """A model config from a testbed preset name, a ``config.json`` file or a checkpoint directory."""
    path = Path(source)
    if path.is_dir():
        path = path / "config.json"
    if not path.exists():
        preset = Path(__file__).resolve().parents[1] / "testbed" / "presets" / f"{source}.json"
        if not preset.exists():
            raise ConfigError(f"{source!r} is neither a config.json, a checkpoint directory nor a testbed preset", option="config")
        path = preset
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cannot read {path} as a JSON model config: {exc}", option="config") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{path} is not a JSON object", option="config")
    return config.get("text_config") or config if "hidden_size" not in config else config
