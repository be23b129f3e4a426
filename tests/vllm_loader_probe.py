"""What vLLM's weight loader does with an unexpected `.bias`, asked of vLLM itself: run with the
vLLM environment's interpreter (tests/test_vllm_loader_ignores.py does).

    .venv-vllm/bin/python tests/vllm_loader_probe.py CASES.json

CASES.json maps an architecture to ``{"config": <config.json>, "module": <a Linear without a
bias>}`` (and its weight's ``"shape"`` where the checkpoint's name is not vLLM's parameter's: a
routed expert's Linear). Each model is built on the CPU as a server builds it (``EngineArgs`` ->
``initialize_model``, a one-process group) and its ``load_weights`` run twice: with the module's
`weight` alone (the control: it must load) and with a `bias` beside it that no parameter takes.
Printed, as JSON per architecture: ``{"control": "loaded" | <exception>, "bias": "skipped" |
<exception>}``.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")


def _start() -> None:
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"file://{tempfile.mktemp()}")
        initialize_model_parallel(1, 1)


def _outcome(load) -> str:
    try:
        load()
    except Exception as exc:  # noqa: BLE001 - any exception is the loader refusing the tensor
        return f"{type(exc).__name__}: {str(exc)[:200]}"
    return "loaded"


def probe(config: dict, module: str, shape: list[int] | None, work: Path) -> dict[str, str]:
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.utils import initialize_model

    (work / "config.json").write_text(json.dumps(config))
    args = EngineArgs(model=str(work), dtype="float32", enforce_eager=True, max_model_len=128, skip_tokenizer_init=True, load_format="dummy")
    engine_config = args.create_engine_config()
    with set_current_vllm_config(engine_config):
        model = initialize_model(vllm_config=engine_config)
        weight = torch.zeros(shape) if shape else torch.zeros_like(dict(model.named_parameters())[module + ".weight"])
        control = [(module + ".weight", weight)]
        with_bias = control + [(module + ".bias", torch.zeros(weight.shape[0]))]
        outcome = {"control": _outcome(lambda: model.load_weights(iter(control)))}
        bias = _outcome(lambda: model.load_weights(iter(with_bias)))
        outcome["bias"] = "skipped" if bias == "loaded" else bias
    return outcome


def main(argv: list[str]) -> int:
    cases = json.loads(Path(argv[0]).read_text())
    _start()
    out = {}
    for architecture, case in cases.items():
        with tempfile.TemporaryDirectory() as work:
            out[architecture] = probe(case["config"], case["module"], case.get("shape"), Path(work))
    print(json.dumps(out, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
