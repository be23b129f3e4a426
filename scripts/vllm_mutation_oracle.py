"""Ask vLLM itself what it does with each generated defect, and write the verdicts as data:
tests/mutation_corpus/<scheme>.json (docs/audit.md#agreement-with-vllm).

    python -m tests.mutation_support build /tmp/bases            # the project's venv: the bases
    .venv-vllm/bin/python scripts/vllm_mutation_oracle.py --bases /tmp/bases --write
    .venv-vllm/bin/python scripts/vllm_mutation_oracle.py --bases /tmp/bases --ids ids.json --json out.json

Run it with the vLLM environment's interpreter, from the repository root. Each mutated checkpoint
(tests/mutation_support.py) goes through what `vllm serve` does to a checkpoint, in process, on
the CPU platform with the fp4forge-vllm plugin loaded (it gives NVFP4 kernels to the CPU build):

1. config: `EngineArgs(...).create_engine_config()` (the quantization config class's
   `from_config`, its checks against the model config, the KV cache dtype);
2. create: `initialize_model` (`get_quant_method` per layer, `create_weights`);
3. load: the model's `load_weights` over the shard;
4. process: each quantized module's `process_weights_after_loading`, then the attention layers'.

The verdict: **refuses** (an exception at a stage the unmutated base passes), **degrades** (it
loads, but a parameter the base fills stays uninitialised, or a parameter the base also has comes
out with another shape or other values after loading or processing: a scale in another
convention, other numerics than the base's) or **fine**. A stage the base itself cannot pass on
CPU (vLLM 0.32 CPU has no FP8 MoE kernel: "Unsupported FP8 MoE backend") is skipped for that
module, for base and mutant alike: the corpus records which. The GPTQ and AWQ bases pass every
stage on the CPU build (its WNA16 kernels run them), so their verdicts are the config class's,
the parameter creation's, the loader's and the processing's own; a kernel the CPU build lacks
would show as a base limit, and a mutant refused only for a kernel says so in its message
("Failed to find a kernel ...").
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tests.mutation_support import SCHEMES, apply_mutation, mutations  # noqa: E402

CORPUS = ROOT / "tests" / "mutation_corpus"
RTOL = 1e-2  # a value-preserving cast (F32 -> BF16 scale) moves values by < 0.4 %
MESSAGE_CHARS = 300


def start_vllm() -> None:
    """The plugins and a one-process distributed group, once per run."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, distributed_init_method=f"tcp://127.0.0.1:{_free_port()}", backend="gloo")
        initialize_model_parallel(1, 1)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _failure(stage: str, exc: BaseException, where: Path) -> dict:
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    message = re.sub(r"0x[0-9a-f]+", "0x…", message.replace(str(where), "<checkpoint>"))
    return {"stage": stage, "exception": type(exc).__name__, "message": message[:MESSAGE_CHARS]}


def _state(model, *, copy: bool = True, buffers: bool = False) -> dict:
    """The model's parameters (and buffers: the attention layers' KV scales live there), copied
    or live."""
    items = list(model.named_parameters()) + (list(model.named_buffers()) if buffers else [])
    return {name: t.detach().clone() if copy else t for name, t in items}


# the attention layer's buffers vLLM fills from the KV scales; unused by a cache that is not FP8
KV_BUFFERS = ("._k_scale", "._v_scale", "._q_scale", "._prob_scale")
AUTO_CACHE = "auto"


def declares_kv(path: Path) -> bool:
    """Whether the checkpoint's declaration (either ModelOpt file) still names a KV cache scheme."""
    docs = [json.loads((path / "config.json").read_text()).get("quantization_config") or {}]
    if (path / "hf_quant_config.json").is_file():
        docs.append(json.loads((path / "hf_quant_config.json").read_text()).get("quantization") or {})
    return any(isinstance(d, dict) and (d.get("kv_cache_scheme") or d.get("kv_cache_quant_algo")) for d in docs)


def in_context(path: Path, work, poisoned: set[str] = frozenset()):
    """``work`` given what vLLM built and loaded from ``path`` (or the stage that raised), run
    with the checkpoint's vLLM config current."""
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(model=str(path), dtype="bfloat16", enforce_eager=True, max_model_len=256, skip_tokenizer_init=True, load_format="safetensors")
    try:
        config = args.create_engine_config()
    except Exception as exc:  # noqa: BLE001 - any exception is vLLM refusing the checkpoint
        return work({"failure": _failure("config", exc, path)})
    with set_current_vllm_config(config):
        return work(create_and_load(path, config, poisoned))


def poison(model, names: set[str]) -> None:
    """Fill the parameters ``names`` with values no loader writes (NaN, all-ones bits): vLLM
    creates parameters uninitialised, and memory a previous, identical model freed would hide a
    slice the checkpoint did not fill."""
    import torch

    for name, param in model.named_parameters():
        if name in names:
            param.data.fill_(float("nan") if param.dtype.is_floating_point else -1 if param.dtype.is_signed else torch.iinfo(param.dtype).max)


def create_and_load(path: Path, config, poisoned: set[str] = frozenset()) -> dict:
    """The model with its parameters loaded (``poisoned`` ones filled with markers first), or the
    stage that raised."""
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.utils import initialize_model

    try:
        model = initialize_model(vllm_config=config)
    except Exception as exc:  # noqa: BLE001
        return {"failure": _failure("create", exc, path)}
    poison(model, poisoned)
    try:
        loaded = model.load_weights(get_model_loader(config.load_config).get_all_weights(config.model_config, model))
    except Exception as exc:  # noqa: BLE001
        return {"failure": _failure("load", exc, path)}
    unloaded = sorted(set(dict(model.named_parameters())) - set(loaded or ()))
    return {"model": model, "config": config, "unloaded": unloaded, "methods": methods(model)}


def observe(path: Path) -> dict:
    """The base: every parameter vLLM created and loaded, then processed (copies); loaded twice,
    the second time with the parameters the first filled poisoned beforehand (``poison``)."""
    first = in_context(path, lambda built: built)
    if "failure" in first:
        return first
    filled = set(dict(first.pop("model").named_parameters())) - set(first["unloaded"])

    def work(built: dict) -> dict:
        if "failure" in built:
            return built
        model = built["model"]
        created = _state(model)
        failures = process(model, built["config"].model_config.dtype, path)
        return {"created": created, "unloaded": built["unloaded"], "methods": built["methods"], "processed": _state(model, buffers=True),
                "process_failures": failures, "cache_dtype": built["config"].cache_config.cache_dtype, "filled": filled}

    return in_context(path, work, filled)


def verdict(path: Path, base: dict) -> dict:
    """vLLM's verdict on a mutant: compared with the base after loading, and (where loading gave
    the same parameters under other methods or settings) after processing too. A mutant built
    with the base's methods and settings and loaded with its values is processed as the base.
    The parameters the base fills are poisoned before loading: what the mutant leaves unwritten
    shows."""
    def work(built: dict) -> dict:
        if "failure" in built:
            return judge(built, base)
        model, cache = built["model"], built["config"].cache_config.cache_dtype
        live = {"created": _state(model, copy=False), "unloaded": built["unloaded"], "processed": {}, "process_failures": {}, "cache_dtype": cache}
        loaded = judge(live, base, loaded_only=True)
        if loaded["outcome"] != "fine":
            return loaded
        if cache != base["cache_dtype"] and cache == AUTO_CACHE and declares_kv(path):
            return {"outcome": "degrades", "evidence": {"kind": "kv-cache-dtype", "parameters": [f"a KV cache is declared, vLLM runs it as {cache} (the base: {base['cache_dtype']})"], "count": 1}}
        if built["methods"] == base["methods"] and cache == base["cache_dtype"]:
            return {"outcome": "fine", "evidence": {"process": "as the base's: the same methods with the same settings, loaded with the same values"}}
        live["process_failures"] = process(model, built["config"].model_config.dtype, path)
        live["processed"] = _state(model, copy=False, buffers=True)
        return judge(live, base, after_load=True)

    return in_context(path, work, base["filled"])


def methods(model) -> list[tuple]:
    """Each module's quantization method and scheme with their plain settings: two models alike
    here, loaded with the same values, are processed alike."""
    out = []
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if method is None:
            continue
        scheme = getattr(module, "scheme", None)
        out.append((name, type(method).__name__, _plain(method), type(scheme).__name__, _plain(scheme)))
    return out


def _plain(obj) -> list[tuple[str, str]]:
    """An object's attributes of plain types (the settings a method or scheme was built with)."""
    plain = (bool, int, float, str, type(None), tuple)
    return sorted((k, re.sub(r"0x[0-9a-f]+", "", repr(v))) for k, v in vars(obj).items() if isinstance(v, plain)) if hasattr(obj, "__dict__") else []


def process(model, dtype, path: Path) -> dict[str, dict]:
    """vLLM's process_weights_after_loading, module by module, each failure recorded."""
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
    from vllm.model_executor.model_loader.utils import is_deferred_attention_layer

    failures = {}
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        try:
            if isinstance(method, QuantizeMethodBase):
                method.process_weights_after_loading(module)
        except Exception as exc:  # noqa: BLE001
            failures[name] = _failure("process", exc, path)
    for name, module in model.named_modules():
        if is_deferred_attention_layer(module) and name not in failures:
            try:
                module.process_weights_after_loading(dtype)
            except Exception as exc:  # noqa: BLE001
                failures[name] = _failure("process", exc, path)
    return failures


def _differs(a, b) -> str | None:
    """Why two parameter values differ (shape, values beyond a cast's rounding), or None."""
    import torch

    if tuple(a.shape) != tuple(b.shape):
        return f"shape {list(a.shape)} instead of {list(b.shape)}"
    if a.dtype != b.dtype:
        return f"dtype {str(a.dtype).removeprefix('torch.')} instead of {str(b.dtype).removeprefix('torch.')}"
    if a.dtype.is_floating_point:
        same = torch.allclose(a.float(), b.float(), rtol=RTOL, atol=0.0, equal_nan=True)
    else:
        same = torch.equal(a, b)
    return None if same else "other values"


def _changed(mutant: dict, base: dict, skip: tuple[str, ...]) -> list[str]:
    """Parameters both hold (and the mutant loaded) whose shape or values differ."""
    out = []
    for name in sorted(set(mutant) & set(base)):
        if name.startswith(skip):
            continue
        why = _differs(mutant[name], base[name])
        if why:
            out.append(f"{name}: {why}")
    return out


def judge(mutant: dict, base: dict, *, loaded_only: bool = False, after_load: bool = False) -> dict:
    """vLLM's verdict on a mutant, against the base it was made from (``loaded_only``: as far as
    loading goes; ``after_load``: loading was judged already)."""
    if "failure" in mutant:
        return {"outcome": "refuses", "evidence": mutant["failure"]}
    new_failures = {m: f for m, f in mutant["process_failures"].items() if base["process_failures"].get(m) != f}
    if new_failures:
        module, failure = sorted(new_failures.items())[0]
        return {"outcome": "refuses", "evidence": {**failure, "module": module}}
    uninitialised = sorted(set(mutant["unloaded"]) - set(base["unloaded"]))
    if uninitialised:
        return _degrades("uninitialised", uninitialised)
    unloaded = tuple(mutant["unloaded"])
    changed = [] if after_load else _changed({n: t for n, t in mutant["created"].items() if n not in unloaded}, base["created"], ())
    if changed:
        return _degrades("loaded-differently", changed)
    if loaded_only:
        return {"outcome": "fine", "evidence": {}}
    skipped = tuple(m + "." for m in base["process_failures"])
    processed = mutant["processed"]
    if mutant.get("cache_dtype") == AUTO_CACHE:  # a BF16 cache reads no KV scale
        processed = {n: t for n, t in processed.items() if not n.endswith(KV_BUFFERS)}
    changed = _changed(processed, base["processed"], skipped + unloaded)
    if changed:
        return _degrades("processed-differently", changed)
    return {"outcome": "fine", "evidence": {"process": "run"}}


def _degrades(kind: str, parameters: list[str]) -> dict:
    return {"outcome": "degrades", "evidence": {"kind": kind, "parameters": parameters[:5], "count": len(parameters)}}


def base_limits(base: dict) -> list[dict]:
    """The stages the base itself cannot pass on this platform: one entry per distinct failure."""
    if "failure" in base:
        raise SystemExit(f"the base fails at {base['failure']}: it cannot judge its mutations")
    seen: dict[tuple, dict] = {}
    for module, failure in sorted(base["process_failures"].items()):
        key = (failure["exception"], failure["message"])
        entry = seen.setdefault(key, {**failure, "modules": 0, "example": module})
        entry["modules"] += 1
    return list(seen.values())


def judge_scheme(scheme: str, base_dir: Path, ids: set[str] | None, work: Path) -> dict:
    base = observe(base_dir)
    limits = base_limits(base)
    verdicts = []
    for number, mutation in enumerate(mutations(scheme, base_dir)):
        if ids is not None and mutation["id"] not in ids:
            continue
        mutant_dir = apply_mutation(base_dir, mutation, work / f"{scheme}-{number}")
        verdicts.append({**mutation, "vllm": verdict(mutant_dir, base)})
        shutil.rmtree(mutant_dir)
        print(f"{mutation['id']}: {verdicts[-1]['vllm']['outcome']}", file=sys.stderr, flush=True)
    return {"scheme": scheme, "versions": _versions(), "base_limits": limits, "mutations": verdicts}


def _versions() -> dict[str, str]:
    import compressed_tensors
    import vllm

    return {"vllm": vllm.__version__, "compressed-tensors": compressed_tensors.__version__}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bases", type=Path, required=True, help="directory of bases (python -m tests.mutation_support build DIR)")
    parser.add_argument("--scheme", action="append", choices=list(SCHEMES), help="only these schemes (repeatable)")
    parser.add_argument("--ids", type=Path, help="a JSON list of mutation ids: judge only those, print the verdicts")
    parser.add_argument("--write", action="store_true", help="write tests/mutation_corpus/<scheme>.json")
    parser.add_argument("--json", type=Path, help="write the verdicts to this file")
    args = parser.parse_args(argv)
    ids = set(json.loads(args.ids.read_text())) if args.ids else None
    start_vllm()
    results = []
    with tempfile.TemporaryDirectory(prefix="vllm-mutations-") as work:
        for scheme in args.scheme or list(SCHEMES):
            results.append(judge_scheme(scheme, args.bases / scheme, ids, Path(work)))
            if args.write:  # each scheme as soon as it is judged
                CORPUS.mkdir(exist_ok=True)
                (CORPUS / f"{scheme}.json").write_text(json.dumps(results[-1], indent=1, sort_keys=True) + "\n")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
