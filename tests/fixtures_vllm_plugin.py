"""Shared, lazily started vLLM servers for the fp4forge-vllm plugin and reasoning-parser tests.

Both test modules import this one module, so they share one registry and therefore one start of
each server (starts cost 1-3 min on a loaded 2-core machine). On first use the registry launches
every server that the collected tests ask for, so their start-ups overlap; it stops them all at
interpreter exit. Servers (all fp32, --enforce-eager, on tiny testbed models built here):

* ``plugin_bf16_moe``: BF16 tiny Laguna MoE (non-zero router bias) + plugin, with the fixed
  ``poolside_v1_fixed`` reasoning parser loaded through ``--reasoning-parser-plugin``;
* ``plugin_bf16_moe_bf16``: the same model served in bfloat16 instead of float32;
* ``plugin_ct_w4a4``: fp4forge's NVFP4-experts + FP8-attention + FP8-KV checkpoint of it, with
  activation and KV scales from fp4forge's own calibration of it (8 samples x 128 tokens, once
  per session), compressed-tensors layout, plugin numerics ``w4a4``;
* ``plugin_modelopt_w4a16``: the same recipe and statistics in the ModelOpt layout, numerics
  ``w4a16``, with vLLM's stock ``poolside_v1`` reasoning parser (the parser tests' "before"
  picture). Both layouts were measured to match their reference in both numerics
  (tests/test_vllm_plugin.py); this pairing keeps one ``w4a16`` server and four servers in all;
* ``plugin_ct_nokv_compiled``: the compressed-tensors checkpoint of the same recipe without its FP8
  KV cache (vLLM's CPU attention keeps an FP8 cache only on AVX-512/AMX machines), numerics
  ``w4a4``, without ``--enforce-eager``: vLLM compiles the model with torch.compile, through the
  plugin's expert op (fp4forge-vllm 0.1.0 failed here);
* ``noplugin_ct``: the compressed-tensors checkpoint with the plugin switched off, which must fail.

The parser servers use a chat template that thinks unless told not to (as Laguna-S-2.1's does) and
``enable_in_reasoning`` structured outputs, so a regex can force the random model's whole answer.
"""

from __future__ import annotations

import atexit
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from fp4forge.serve import VllmServer, launch_vllm
from fp4forge.serve.recommend import cpu_has_fp8_kv

# Whether vLLM's CPU attention can keep an FP8 KV cache here (AVX-512 or AMX; the one home of that
# rule is fp4forge.serve.recommend). Where it cannot, the servers of checkpoints that declare FP8 KV
# run with their KV declaration overridden (`kv_declaration_removed`): an unquantized cache in the
# model dtype, and the tests compare against the reference without KV quantization.
CPU_FP8_KV = cpu_has_fp8_kv()
NO_FP8_KV_REASON = "this CPU has no AVX-512/AMX: vLLM's CPU attention cannot keep an FP8 KV cache here"

VLLM_COMMON_ARGS = ("--enforce-eager", "--max-model-len", "2048", "--dtype", "float32", "--max-logprobs", "20")
ENV = {"HF_HUB_OFFLINE": "1"}
READY_TIMEOUT_S = 900.0
# The quantized checkpoints' activation amax and FP8 KV scales come from fp4forge's own
# calibration of the BF16 testbed (as `fp4forge calibrate` then `quantize --stats` would do),
# small enough to cost seconds: 8 samples x 128 tokens of the built-in corpus (128 > Laguna's
# 64-token sliding window), run once per session.
CALIBRATION_SAMPLES = 8
CALIBRATION_SEQ_LEN = 128
RECIPE = "nvfp4-experts-fp8-attn"
# The same recipe without its [kv_cache] table: a BF16 KV cache.
RECIPE_WITHOUT_KV = """name = "nvfp4-experts-fp8-attn-bf16-kv"
description = "nvfp4-experts-fp8-attn with a BF16 KV cache"
[[rules]]
components = ["routed_experts"]
scheme = "nvfp4"
[[rules]]
components = ["attention", "shared_expert"]
scheme = "fp8"
ignore = ['re:.*\\.self_attn\\.g_proj$']
"""

TESTBED_THINKING_LINE = (
    "{%- set thinking_on = (enable_thinking is defined and enable_thinking) "
    "or (thinking is defined and thinking) -%}"
)
TESTBED_THINKING_DEFAULT_ON = "{%- set thinking_on = not thinking_off -%}"
THINKING_BY_DEFAULT_LINE = (
    "{%- set thinking_on = not ((enable_thinking is defined and not enable_thinking) "
    "or (thinking is defined and not thinking)) -%}"
)
PARSER_COMMON = (
    "--enable-auto-tool-choice",
    "--tool-call-parser",
    "poolside_v1",
    "--structured-outputs-config",
    '{"enable_in_reasoning": true}',
)
FIXED_PARSER = ("--reasoning-parser-plugin", "fp4forge_vllm.reasoning", "--reasoning-parser", "poolside_v1_fixed")
STOCK_PARSER = ("--reasoning-parser", "poolside_v1")


# -- models -------------------------------------------------------------------------------------
def build_bf16_moe(root: Path) -> Path:
    from fp4forge.testbed import build_tiny_laguna

    return build_tiny_laguna(root / "tiny-laguna-moe", seed=0)


def calibrate(src: Path, out: Path) -> Path:
    """Activation and KV statistics of ``src`` (fp4forge calibrate --samples 8 --seq-len 128)."""
    from fp4forge.calibrate import CalibrationOptions, calibrate_checkpoint
    from fp4forge.checkpoint.stats import write_stats

    options = CalibrationOptions(samples=CALIBRATION_SAMPLES, seq_len=CALIBRATION_SEQ_LEN, batch_size=4)
    result = calibrate_checkpoint(src, options)
    return write_stats(out, result.tensors, result.metadata)


def quantize(src: Path, stats: Path, out: Path, layout: str, recipe: str = RECIPE) -> Path:
    """fp4forge quantize --stats: calibrated input scales and calibrated FP8 KV scales."""
    from fp4forge.quantize.act_scales import parse_act_scales
    from fp4forge.quantize.export import QuantizeOptions, quantize_checkpoint
    from fp4forge.quantize.recipe import load_recipe

    options = QuantizeOptions(recipe=load_recipe(recipe), layout_format=layout, act_amax=parse_act_scales(None, stats))
    quantize_checkpoint(src, out, options)
    return out


def thinking_template(model_dir: Path, out: Path) -> Path:
    """The testbed's chat template with thinking on unless a request turns it off."""
    text = (model_dir / "chat_template.jinja").read_text()
    if TESTBED_THINKING_DEFAULT_ON in text:  # the testbed's template already thinks by default (as Laguna's)
        out.write_text(text)
        return out
    assert TESTBED_THINKING_LINE in text, "testbed chat template changed: update THINKING lines"
    out.write_text(text.replace(TESTBED_THINKING_LINE, THINKING_BY_DEFAULT_LINE))
    return out


class Models:
    """Testbed checkpoints, each built once per session on first use."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._built: dict[str, Path] = {}
        self._builders: dict[str, Callable[[], Path]] = {
            "bf16_moe": lambda: build_bf16_moe(root),
            "stats": lambda: calibrate(self.get("bf16_moe"), root / "tiny-laguna-stats.safetensors"),
            "ct": lambda: quantize(self.get("bf16_moe"), self.get("stats"), root / "tiny-laguna-ct", "compressed-tensors"),
            "modelopt": lambda: quantize(self.get("bf16_moe"), self.get("stats"), root / "tiny-laguna-modelopt", "modelopt"),
            "ct_nokv": lambda: quantize(self.get("bf16_moe"), self.get("stats"), root / "tiny-laguna-ct-nokv",
                                        "compressed-tensors", str(self._recipe_without_kv())),
            "thinking_template": lambda: thinking_template(self.get("bf16_moe"), root / "thinking-on.jinja"),
        }

    def _recipe_without_kv(self) -> Path:
        path = self.root / "recipe-without-kv.toml"
        path.write_text(RECIPE_WITHOUT_KV)
        return path

    def get(self, name: str) -> Path:
        if name not in self._built:
            self._built[name] = self._builders[name]()
        return self._built[name]


# -- servers ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ServerSpec:
    model: str
    args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    chat_template: bool = False
    eager: bool = True  # False: no --enforce-eager, vLLM's default torch.compile start-up


SERVER_SPECS: dict[str, ServerSpec] = {
    "plugin_bf16_moe": ServerSpec("bf16_moe", (*PARSER_COMMON, *FIXED_PARSER), chat_template=True),
    # The same model computed in bfloat16 (the later --dtype wins over VLLM_COMMON_ARGS').
    "plugin_bf16_moe_bf16": ServerSpec("bf16_moe", ("--dtype", "bfloat16")),
    "plugin_ct_w4a4": ServerSpec("ct", env={"FP4FORGE_VLLM_NUMERICS": "w4a4"}),
    "plugin_ct_nokv_compiled": ServerSpec("ct_nokv", env={"FP4FORGE_VLLM_NUMERICS": "w4a4"}, eager=False),
    "plugin_modelopt_w4a16": ServerSpec(
        "modelopt", (*PARSER_COMMON, *STOCK_PARSER), env={"FP4FORGE_VLLM_NUMERICS": "w4a16"}, chat_template=True
    ),
    "noplugin_ct": ServerSpec("ct", env={"FP4FORGE_VLLM_PLUGIN": "0"}),
}


def kv_declaration_removed(model_dir: Path) -> tuple[str, ...]:
    """``--hf-overrides`` that serve ``model_dir`` as if its config declared no KV quantization
    (compressed-tensors' kv_cache_scheme, ModelOpt's kv_cache_quant_algo): vLLM then keeps the
    cache in the model dtype. Not the serve line's `--dtype bfloat16 --kv-cache-dtype bfloat16`
    (vLLM has no float32 cache dtype, and on CPU the cache dtype must equal the model's): these
    servers compute in float32 so that they can be held to an fp32 reference."""
    quant = json.loads((model_dir / "config.json").read_text())["quantization_config"]
    quant.pop("kv_cache_scheme", None)
    if "kv_cache_quant_algo" in quant:
        quant["kv_cache_quant_algo"] = None
    return ("--hf-overrides", json.dumps({"quantization_config": quant}))


def declares_kv(model_dir: Path) -> bool:
    quant = json.loads((model_dir / "config.json").read_text()).get("quantization_config") or {}
    return bool(quant.get("kv_cache_scheme") or quant.get("kv_cache_quant_algo"))


class Registry:
    def __init__(self, venv: Path, root: Path) -> None:
        self.venv = venv
        self.models = Models(root / "models")
        self.log_dir = root / "logs"
        self.servers: dict[str, VllmServer] = {}

    def launch(self, name: str) -> VllmServer:
        if name not in self.servers:
            spec = SERVER_SPECS[name]
            args = [a for a in VLLM_COMMON_ARGS if spec.eager or a != "--enforce-eager"] + list(spec.args)
            if spec.chat_template:
                args += ["--chat-template", str(self.models.get("thinking_template"))]
            model_dir = self.models.get(spec.model)
            if not CPU_FP8_KV and declares_kv(model_dir):
                args += kv_declaration_removed(model_dir)
            self.servers[name] = launch_vllm(
                model_dir,
                venv=self.venv,
                served_model_name=name,
                log_path=self.log_dir / f"{name}.log",
                extra_args=args,
                env={**ENV, **spec.env},
            )
        return self.servers[name]

    def ready(self, name: str) -> VllmServer:
        server = self.launch(name)
        server.wait_ready(READY_TIMEOUT_S)
        return server

    def stop_all(self) -> None:
        for server in self.servers.values():
            server.stop()


_registry: Registry | None = None


def registry(request: pytest.FixtureRequest) -> Registry:
    """The session's registry; the first call launches every server the collected tests use."""
    global _registry
    if _registry is None:
        venv = request.getfixturevalue("vllm_venv")
        root = request.getfixturevalue("tmp_path_factory").mktemp("vllm-plugin")
        _registry = Registry(venv, root)
        atexit.register(_registry.stop_all)
        used = {name for item in request.session.items for name in getattr(item, "fixturenames", ())}
        for name in SERVER_SPECS:
            if name in used:
                _registry.launch(name)
    return _registry


def server_log(server: VllmServer) -> str:
    return server.log_path.read_text(encoding="utf-8", errors="replace").replace("\x00", "")


# -- fixtures both test modules import -----------------------------------------------------------
@pytest.fixture(scope="module")
def servers(request: pytest.FixtureRequest) -> Registry:
    return registry(request)


@pytest.fixture(scope="module")
def plugin_bf16_moe(servers: Registry) -> VllmServer:
    """BF16 MoE + plugin, fixed parser (loaded with --reasoning-parser-plugin fp4forge_vllm.reasoning)."""
    return servers.ready("plugin_bf16_moe")


@pytest.fixture(scope="module")
def plugin_modelopt_w4a16(servers: Registry) -> VllmServer:
    """ModelOpt checkpoint, numerics w4a16, stock poolside_v1 with the same template and settings."""
    return servers.ready("plugin_modelopt_w4a16")
