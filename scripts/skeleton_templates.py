"""Write and check fp4forge's skeleton tables (src/fp4forge/checkpoint/skeletons/*.json) from
transformers.

    python scripts/skeleton_templates.py fields MODEL_TYPE
        # the config class's fields, their defaults and those that may be null (JSON)
    python scripts/skeleton_templates.py templates CONFIG.json [JSON-OVERRIDES]
        # transformers' skeleton for that config collapsed to templates: `{layer}`/`{expert}` for
        # the indices, each template with its shape and the layers that hold it, in save order
    python scripts/skeleton_templates.py check CONFIG.json [JSON-OVERRIDES]
        # the table's expansion against transformers' skeleton: the first difference, or "same"

`fields` gives a table's "fields" and "nullable"; `templates` the names, order and layer kinds of its "tensors"
(the shapes there are written as expressions over the fields, so that they hold for any config);
`check` is what tests/test_skeleton_data.py asserts for the corpus configs and their variations.
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))


def _config(path: str, overrides: str | None) -> dict:
    config = json.loads(Path(path).read_text())
    config.pop("quantization_config", None)
    config.update(json.loads(overrides) if overrides else {})
    return config


def nullable(model_type: str) -> list[str]:
    """The fields whose annotation admits None (transformers' strict validation refuses None elsewhere)."""
    from transformers import PreTrainedConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    generic = {f.name for f in dataclasses.fields(PreTrainedConfig)}
    return [f.name for f in dataclasses.fields(CONFIG_MAPPING[model_type]) if f.name not in generic and "None" in str(f.type)]


def fields(model_type: str) -> dict:
    from transformers import PreTrainedConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    generic = {f.name for f in dataclasses.fields(PreTrainedConfig)}
    out = {}
    for field in dataclasses.fields(cls):
        if field.name in generic:
            continue
        default = field.default if field.default is not dataclasses.MISSING else None
        out[field.name] = default if isinstance(default, (int, float, str, bool, type(None), list)) else None
    return out


def templates(config: dict) -> list[str]:
    from fp4forge.checkpoint.skeleton import checkpoint_specs

    seen: dict[tuple, list[int]] = {}
    for spec in checkpoint_specs(config):
        layer = re.search(r"\.layers\.(\d+)\.", spec.name)
        template = re.sub(r"\.layers\.\d+\.", ".layers.{layer}.", spec.name)
        template = re.sub(r"\.experts\.\d+\.", ".experts.{expert}.", template)
        seen.setdefault((template, spec.dtype, spec.shape), []).append(int(layer.group(1)) if layer else -1)
    return [f"{t} {d} {list(s)} layers {sorted(set(ls)) if ls[0] >= 0 else '-'}" for (t, d, s), ls in seen.items()]


def check(config: dict) -> str:
    from fp4forge.checkpoint.skeleton import checkpoint_specs
    from fp4forge.checkpoint.skeleton_data import expected_rows

    rows = expected_rows(config)
    if rows is None:
        return "not covered by the tables (transformers decides)"
    truth = [(s.name, s.dtype, tuple(s.shape)) for s in checkpoint_specs(config)]
    for i, (mine, theirs) in enumerate(zip(rows, truth)):
        if mine != theirs:
            return f"row {i}: tables {mine}, transformers {theirs}"
    return "same" if len(rows) == len(truth) else f"tables {len(rows)} rows, transformers {len(truth)}"


def main() -> None:
    command, arg, *rest = sys.argv[1:]
    if command == "fields":
        print(json.dumps({"fields": fields(arg), "nullable": nullable(arg)}, indent=1))
    elif command == "templates":
        print("\n".join(templates(_config(arg, rest[0] if rest else None))))
    elif command == "check":
        print(check(_config(arg, rest[0] if rest else None)))
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main()
