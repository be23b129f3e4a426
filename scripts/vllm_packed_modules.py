"""Write (or check) fp4forge's table of the Linears vLLM fuses, per architecture, from vLLM itself:
src/fp4forge/checkpoint/layouts/_vllm_packed.json.

    python scripts/vllm_packed_modules.py            # print the table vLLM's installed models give
    python scripts/vllm_packed_modules.py --write    # and write it to the data file

Run it with the vLLM environment's interpreter (e.g. `.venv-vllm/bin/python`). For every
architecture in vLLM's model registry the model class's ``packed_modules_mapping`` (fused GEMM ->
the checkpoint Linears it is built from: q/k/v, gate/up, MLA's q_a/kv_a, ...) is read, together
with the entries its ``__init__`` adds for some configs (``self.packed_modules_mapping["x"] = [...]``,
found in the class's source) and the expert Linears its FusedMoE loader stacks into one w13 GEMM
(the ``ckpt_gate_proj_name`` / ``ckpt_up_proj_name`` given to ``make_expert_params_mapping``).
``kv_scales_remapped`` lists the architectures whose loader lands both layouts' KV-scale spellings
on the attention layer (``AutoWeightsLoader`` in the class's ``load_weights``, or
``maybe_remap_kv_scale_name`` in its module).
A group applies in a checkpoint only where all its shards exist, so a config-dependent entry is
kept. A class whose module cannot be imported here (a missing optional package such as
torchvision) is read from its source the same way (its class-level mapping literal and those of
its base classes); one that cannot be found either is listed under ``"unavailable"`` with the
reason: nothing is guessed for it.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import sys
from pathlib import Path

DATA = Path(__file__).resolve().parent.parent / "src/fp4forge/checkpoint/layouts/_vllm_packed.json"
EXPERTS_GROUP = "experts_w13"  # vLLM's FusedMoE: gate and up of every expert in one GEMM


def _literal_names(node: ast.AST) -> tuple | None:
    try:
        value = ast.literal_eval(node)
    except (ValueError, SyntaxError):
        return None
    return value if isinstance(value, tuple) and len(value) == 3 else None


def _literal_strings(node: ast.AST) -> list[str] | None:
    try:
        value = ast.literal_eval(node)
    except (ValueError, SyntaxError):
        return None
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return list(value)
    return None


def _default_ckpt_names() -> tuple[str, str, str | None] | None:
    """FusedMoE's default checkpoint names (gate, down, up), from the signature that declares them."""
    from vllm.model_executor.layers.fused_moe import layer

    for value in vars(layer).values():
        try:
            parameter = inspect.signature(value).parameters.get("ckpt_names")
        except (TypeError, ValueError):
            continue
        if parameter is not None and isinstance(parameter.default, tuple):
            return parameter.default
    return None


def _source_groups(source: str) -> dict[str, list[str]]:
    """``packed_modules_mapping["x"] = [...]`` assignments and FusedMoE's gate/up checkpoint names
    (``ckpt_names=(gate, down, up)`` or ``ckpt_gate_proj_name=`` / ``ckpt_up_proj_name=`` where a
    module passes them, FusedMoE's defaults where it builds one without)."""
    groups: dict[str, list[str]] = {}
    gate = up = None
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and "FusedMoE" in str(getattr(node.func, "attr", getattr(node.func, "id", ""))):
            names = next((_literal_names(k.value) for k in node.keywords if k.arg == "ckpt_names"), None) or _default_ckpt_names()
            if names and names[2]:
                gate, up = names[0], names[2]
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Subscript) and isinstance(target.value, ast.Attribute) and target.value.attr == "packed_modules_mapping":
                    key, members = target.slice, _literal_strings(node.value)
                    if isinstance(key, ast.Constant) and isinstance(key.value, str) and members:
                        groups[key.value] = members
        if isinstance(node, ast.Call) and str(getattr(node.func, "attr", getattr(node.func, "id", ""))).endswith("make_expert_params_mapping"):
            for keyword in node.keywords:
                if keyword.arg in ("ckpt_gate_proj_name", "ckpt_up_proj_name") and isinstance(keyword.value, ast.Constant):
                    gate, up = (keyword.value.value, up) if keyword.arg == "ckpt_gate_proj_name" else (gate, keyword.value.value)
    if gate and up:
        groups[EXPERTS_GROUP] = [gate, up]
    return groups


def _class_groups(cls: type) -> dict[str, list[str]]:
    """The class's mapping, plus what the ``__init__`` of it and its vLLM base classes add, plus
    the experts' w13 of its module (or a base class's module)."""
    groups = {k: list(v) for k, v in (getattr(cls, "packed_modules_mapping", None) or {}).items()}
    for klass in cls.__mro__:
        if not klass.__module__.startswith("vllm."):
            continue
        try:
            found = _source_groups(inspect.getsource(klass))
            experts = _source_groups(inspect.getsource(sys.modules[klass.__module__])).get(EXPERTS_GROUP)
        except (OSError, TypeError):
            continue
        if experts:
            found.setdefault(EXPERTS_GROUP, experts)
        for key, members in found.items():
            groups.setdefault(key, members)
    return {k: v for k, v in sorted(groups.items()) if len(v) > 1 or v != [k]}  # a group of itself fuses nothing


def _imported_names(tree: ast.Module) -> dict[str, str]:
    """Name -> module, for ``from vllm.model_executor.models.<m> import Name``."""
    out = {}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("vllm."):
            out.update({alias.asname or alias.name: node.module for alias in node.names})
    return out


def _source_class_groups(module_name: str, class_name: str, depth: int = 0) -> dict[str, list[str]] | None:
    """The groups of a class whose module cannot be imported here (an optional package missing),
    read from the source: its class-level mapping literal, what ``__init__`` adds, the module's
    FusedMoE names, and the same of its base classes (followed through vLLM imports)."""
    import importlib.util

    try:
        spec = importlib.util.find_spec(module_name)
    except ImportError:
        return None
    if spec is None or spec.origin is None or depth > 4:
        return None
    source = Path(spec.origin).read_text(encoding="utf-8")
    tree = ast.parse(source)
    node = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == class_name), None)
    if node is None:
        return None
    groups: dict[str, list[str]] = {}
    for statement in node.body:
        if isinstance(statement, (ast.Assign, ast.AnnAssign)):
            targets = statement.targets if isinstance(statement, ast.Assign) else [statement.target]
            if any(isinstance(t, ast.Name) and t.id == "packed_modules_mapping" for t in targets) and statement.value is not None:
                try:
                    groups.update({k: list(v) for k, v in ast.literal_eval(statement.value).items()})
                except (ValueError, SyntaxError, AttributeError):
                    pass
    found = _source_groups(ast.unparse(node))
    experts = _source_groups(source).get(EXPERTS_GROUP)
    if experts:
        found.setdefault(EXPERTS_GROUP, experts)
    imported = _imported_names(tree)
    for base in node.bases:
        name = base.id if isinstance(base, ast.Name) else None
        inherited = _source_class_groups(imported.get(name, module_name), name, depth + 1) if name else None
        for key, members in (inherited or {}).items():
            found.setdefault(key, members)
    for key, members in found.items():
        groups.setdefault(key, members)
    return {k: v for k, v in sorted(groups.items()) if len(v) > 1 or v != [k]}


KV_REMAP_MARKERS = ("AutoWeightsLoader", "maybe_remap_kv_scale_name")


def _remaps_kv_scales(load_weights_source: str, module_source: str) -> bool:
    """Whether the class's loader reaches vLLM's KV-scale remapping: ``AutoWeightsLoader``
    applies the quantization config's ``get_cache_scale_mapper`` to every checkpoint name (both
    layouts' spellings land on ``.attn.k_scale``), and a hand-written loop that calls
    ``maybe_remap_kv_scale_name`` does the same per name."""
    return KV_REMAP_MARKERS[0] in load_weights_source or KV_REMAP_MARKERS[1] in module_source


def _class_remaps_kv_scales(cls: type) -> bool:
    method = getattr(cls, "load_weights", None)
    try:
        return _remaps_kv_scales(inspect.getsource(method) if method else "", inspect.getsource(sys.modules[cls.__module__]))
    except (OSError, TypeError):
        return False


def _source_remaps_kv_scales(module_name: str) -> bool:
    """The same, for a class whose module cannot be imported here: its module's source."""
    import importlib.util

    try:
        spec = importlib.util.find_spec(module_name)
    except ImportError:
        return False
    source = Path(spec.origin).read_text(encoding="utf-8") if spec is not None and spec.origin else ""
    return _remaps_kv_scales(source, source)


def vllm_packed_table() -> dict:
    import vllm
    from vllm.model_executor.models.registry import _VLLM_MODELS

    architectures: dict[str, dict[str, list[str]]] = {}
    unavailable: dict[str, str] = {}
    remapping: list[str] = []  # architectures whose loader lands either layout's KV-scale names
    for arch, (short_name, class_name) in sorted(_VLLM_MODELS.items()):
        # most entries name a module of vllm.model_executor.models; newer ones a full module path
        module_name = short_name if short_name.startswith("vllm.") else f"vllm.model_executor.models.{short_name}"
        try:
            module = importlib.import_module(module_name)
            architectures[arch] = _class_groups(getattr(module, class_name))
            if _class_remaps_kv_scales(getattr(module, class_name)):
                remapping.append(arch)
        except Exception as exc:  # noqa: BLE001 - an optional dependency missing in this environment
            from_source = _source_class_groups(module_name, class_name)
            if from_source is not None:
                architectures[arch] = from_source
                if _source_remaps_kv_scales(module_name):
                    remapping.append(arch)
            else:
                # the reason without the venv's own path, so the table is the same from any install
                reason = f"{type(exc).__name__}: {exc}".replace(str(Path(vllm.__file__).parent.parent), "<site-packages>")
                unavailable[arch] = reason.splitlines()[0][:160]
    return {"vllm": vllm.__version__, "architectures": architectures, "unavailable": unavailable, "kv_scales_remapped": sorted(remapping)}


def emit(table: dict, data_file: Path, argv: list[str]) -> int:
    """Print a table as the shipped data file holds it, and with --write write it there."""
    text = json.dumps(table, indent=1, sort_keys=True) + "\n"
    if "--write" in argv:
        data_file.write_text(text, encoding="utf-8")
    else:
        sys.stdout.write(text)
    return 0


def main(argv: list[str]) -> int:
    return emit(vllm_packed_table(), DATA, argv)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
