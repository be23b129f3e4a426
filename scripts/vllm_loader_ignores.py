"""Write (or check) fp4forge's table of the checkpoint tensors vLLM's weight loaders skip instead of
refusing, from vLLM itself: src/fp4forge/checkpoint/layouts/_vllm_loader_ignores.json.

    python scripts/vllm_loader_ignores.py            # print the table the installed vLLM gives
    python scripts/vllm_loader_ignores.py --write    # and write it to the data file

Run it with the vLLM environment's interpreter (e.g. `.venv-vllm/bin/python`). Two facts:

* ``auto_weights_loader``: what vLLM's generic loader (``AutoWeightsLoader``) skips, read off the
  loader itself: the suffixes it ignores where no parameter takes them (it adds `.bias` for the
  unused zero biases GPTQ exports carry; measured by running its ``load_weights`` on an empty
  module).
* ``skips_unexpected_bias``: per architecture of vLLM's model registry, whether every
  ``load_weights`` its model class runs either hands the tensors to ``AutoWeightsLoader`` (when
  that loader ignores `.bias`, above), skips an unexpected `.bias` itself (the ``if
  name.endswith(".bias") and name not in params_dict: continue`` of the hand-written loaders) or
  passes them on to its parent class's loader (``super().load_weights``, judged in turn): then
  an unexpected `.bias` is skipped (``true``); a hand-written loader without that skip raises on
  it (``false``). The functions read are the ``load_weights`` of the vLLM classes in the model
  class's MRO and of every class their modules define (the model's inner blocks). An
  architecture whose module cannot be imported here is read from its source file alone. The
  verdict is checked against real loads in tests/test_vllm_loader_ignores.py.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
from fp4forge.checkpoint.vllm_params import UNEXPECTED_BIAS as BIAS, VLLM_LOADER_IGNORES  # noqa: E402 - the product's names

DATA = ROOT / "src/fp4forge/checkpoint/layouts" / VLLM_LOADER_IGNORES
# a hand-written loader's skip of an unexpected bias: `name.endswith(".bias")` in a condition
BIAS_SKIP = re.compile(r"""endswith\(\s*\(?\s*["']\.bias["']""")
AUTO_LOADER = "AutoWeightsLoader("
# a loader that hands its tensors on to its parent class's (the Transformers backend's causal LM
# after taking out `lm_head.bias`): the parent's loader, also among those read, is judged instead
PARENT_LOADER = re.compile(r"super\(\)\.load_weights\(")


def auto_loader_facts() -> dict:
    """What AutoWeightsLoader skips, from the loader object: its ignore list after a load of
    nothing (no quantization config)."""
    from torch import nn
    from vllm.model_executor.models.utils import AutoWeightsLoader

    loader = AutoWeightsLoader(nn.Module())
    loader.load_weights([])
    return {"ignored_unexpected_suffixes": sorted(s.lstrip(".") for s in loader.ignore_unexpected_suffixes)}


def _loader_sources_of(cls: type) -> list[str]:
    """The source of every load_weights the class's vLLM modules define."""
    modules = {klass.__module__ for klass in cls.__mro__ if klass.__module__.startswith("vllm.")}
    out = []
    for name in sorted(modules):
        for klass in vars(sys.modules[name]).values():
            if inspect.isclass(klass) and klass.__module__ == name and "load_weights" in vars(klass):
                try:
                    out.append(inspect.getsource(vars(klass)["load_weights"]))
                except (OSError, TypeError):
                    continue
    return out


def _loader_sources_in_file(module_name: str) -> list[str] | None:
    spec = importlib.util.find_spec(module_name)
    if spec is None or spec.origin is None:
        return None
    source = Path(spec.origin).read_text(encoding="utf-8")
    return [ast.get_source_segment(source, node) or "" for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.FunctionDef) and node.name == "load_weights"]


def skips_unexpected_bias(sources: list[str], auto_loader_skips_bias: bool) -> bool:
    """Every loader hands its tensors to AutoWeightsLoader (which skips an unexpected bias where
    ``auto_loader_skips_bias``) or to its parent class's loader, or skips one itself."""
    return bool(sources) and all((auto_loader_skips_bias and AUTO_LOADER in s) or BIAS_SKIP.search(s) or PARENT_LOADER.search(s)
                                 for s in sources)


def table() -> dict:
    import vllm
    from vllm.model_executor.models.registry import _VLLM_MODELS

    auto_loader = auto_loader_facts()
    auto_loader_skips_bias = BIAS in auto_loader["ignored_unexpected_suffixes"]
    architectures: dict[str, bool] = {}
    unavailable: dict[str, str] = {}
    for arch, (short_name, class_name) in sorted(_VLLM_MODELS.items()):
        module_name = short_name if short_name.startswith("vllm.") else f"vllm.model_executor.models.{short_name}"
        try:
            sources = _loader_sources_of(getattr(importlib.import_module(module_name), class_name))
        except Exception as exc:  # noqa: BLE001 - an optional dependency missing in this environment
            sources = _loader_sources_in_file(module_name)
            if sources is None:
                unavailable[arch] = f"{type(exc).__name__}"
                continue
        architectures[arch] = skips_unexpected_bias(sources, auto_loader_skips_bias)
    return {"vllm": vllm.__version__, "auto_weights_loader": auto_loader, "skips_unexpected_bias": architectures,
            "unavailable": unavailable}


def main(argv: list[str]) -> int:
    from vllm_packed_modules import emit  # the sibling script (its directory is on sys.path)

    return emit(table(), DATA, argv)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
