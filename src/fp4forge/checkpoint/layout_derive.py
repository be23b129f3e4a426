"""Components of a model derived from its own definition: the transformers model class built on
the meta device, its modules classified by what they are, its parameters renamed to the on-disk
names by the checkpoint conversion transformers itself uses on save.

What a module is:

* **routed experts**: a module list of N same-class modules, or a module holding 3-D parameters
  whose first dimension is N, where N is the config's routed-expert count under any of its
  spellings (``num_experts``, ``num_local_experts``, ``n_routed_experts``, ``moe_num_experts``);
* the **MoE block** is the experts' parent. Beside the experts it holds the **shared expert**
  (a sub-module with two or more Linears, none of them N wide) and the **router** (everything
  else whose parameters have N in their shape: the gate Linear or parameter, its bias and
  correction bias; and a 1-wide gate Linear, the shared expert's sigmoid gate);
* **towers**: any sub-model (a ``PreTrainedModel`` inside the model) that is not the text decoder
  (``get_decoder()``): vision, or audio when its class says so; a **next-n / MTP** module: a class
  named so;
* ``get_output_embeddings()`` is **lm_head**, an ``nn.Embedding`` **embeddings**, a class named
  ``*Norm*`` **norms**;
* inside a decoder layer, the sub-module a parameter sits in is **attention** (an ``*Attention*``
  / ``*Attn*`` class), **linear_attention** (gated delta-net, Mamba, linear / lightning attention,
  short convolutions) or **dense_mlp** (``*MLP*`` / ``*FeedForward*`` classes, or a module of
  Linears outside any MoE block).

Anything else is ``unknown`` with the reason. The result is a :class:`DerivedComponents`: every
on-disk tensor name of the config's checkpoint with its component. This module imports torch and
transformers; :mod:`fp4forge.checkpoint.layout` caches its result so that reading it does not.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from fp4forge.checkpoint.layout import expert_counts
from fp4forge.checkpoint.skeleton import build_meta_model
from fp4forge.errors import ConfigError

LINEAR_ATTENTION_CLASS = re.compile(r"DeltaNet|Mamba|Mixer|LinearAttention|Lightning|ShortConv|Conv|Recurrent|Ssm|SSM|Kda|KDA|Gla\b|GLA")
ATTENTION_CLASS = re.compile(r"Attention|Attn|MLA$|Mla$")
MLP_CLASS = re.compile(r"MLP|Mlp|FeedForward|Ffn|FFN")
MTP_CLASS = re.compile(r"MTP|Mtp|NextN|Nextn|MultiToken")
AUDIO_CLASS = re.compile(r"Audio|Speech|Whisper|Talker")
NORM_CLASS = re.compile(r"Norm")
EXPERTS_CLASS = re.compile(r"Experts$")
SHARED_CLASS = re.compile(r"Shared")
EMBEDDING_CLASS = re.compile(r"Embedding$")
# Element-wise scales and mixes of the residual stream (hyper-connections, residual scaling)
RESIDUAL_CLASS = re.compile(r"Hyper|Residual")
AUDIO_PATH = re.compile(r"audio|speech|sound", re.IGNORECASE)


@dataclass
class DerivedComponents:
    """On-disk tensor name -> component, and why each unplaced one is unknown."""

    architecture: str
    components: dict[str, str] = field(default_factory=dict)
    reasons: dict[str, str] = field(default_factory=dict)


def _is_experts_container(module: nn.Module, counts: frozenset[int]) -> bool:
    if EXPERTS_CLASS.search(type(module).__name__) and not SHARED_CLASS.search(type(module).__name__):
        return any(True for _ in module.parameters())  # experts stored as 2-D concatenations (DBRX)
    if isinstance(module, nn.ModuleList):
        return len(module) in counts and len(module) > 1 and len({type(m) for m in module}) == 1
    if isinstance(module, nn.modules.conv._ConvNd):
        return False
    return any(p.dim() == 3 and p.shape[0] in counts for p in module.parameters(recurse=False))


def _linears(module: nn.Module) -> list[nn.Linear]:
    return [m for m in module.modules() if isinstance(m, nn.Linear)]


def _is_mlp(module: nn.Module, hidden: int) -> bool:
    """An MLP of the residual stream: a weight reading the hidden size and one writing it."""
    weights = [p for p in module.parameters() if p.dim() >= 2]
    return any(w.shape[-1] == hidden for w in weights) and any(w.shape[-2] == hidden for w in weights)


def _tensors(module: nn.Module, recurse: bool = True) -> list[torch.Tensor]:
    return [*module.parameters(recurse=recurse), *module.buffers(recurse=recurse)]


def _moe_block_roles(block_path: str, block: nn.Module, experts_path: str, counts: frozenset[int], hidden: int) -> dict[str, str]:
    """Module path (of the block's children, or the block itself) -> router | shared_expert |
    routed_experts: beside the experts, an MLP of the residual stream is a shared expert and
    anything else the routing (gate, its biases, scales); a parameter of the block itself is the
    router's when the expert count is in its shape, else the experts' output (a bias)."""
    roles: dict[str, str] = {}
    for name, child in block.named_children():
        path = f"{block_path}.{name}" if block_path else name
        if path == experts_path or not _tensors(child):
            continue
        if _is_experts_container(child, counts):  # experts in two containers (JetMoE's input and output Linears)
            roles[path] = "routed_experts"
        else:
            roles[path] = "shared_expert" if _is_mlp(child, hidden) else "router"
    own = _tensors(block, recurse=False)
    if own:
        roles[block_path] = "router" if any(set(t.shape) & counts for t in own) else "routed_experts"
    return roles


def _common_parent(model: nn.Module, first: nn.Module, second: nn.Module) -> nn.Module:
    paths = {id(m): p for p, m in model.named_modules()}
    a, b = paths[id(first)].split("."), paths[id(second)].split(".")
    common = []
    for x, y in zip(a, b):
        if x != y:
            break
        common.append(x)
    return model.get_submodule(".".join(common)) if common else model


def _text_decoder(model: nn.Module) -> nn.Module:
    """The text model: ``get_decoder()``, else the innermost sub-model holding the input embeddings."""
    from transformers import PreTrainedModel

    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    encoder = model.get_encoder() if getattr(model.config, "is_encoder_decoder", False) and hasattr(model, "get_encoder") else None
    if encoder is not None and decoder is not None and encoder is not decoder:
        return _common_parent(model, encoder, decoder)  # both halves of an encoder-decoder are the text model
    if decoder is not None and decoder is not model:
        return decoder
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    holders = [m for m in model.modules() if m is not model and isinstance(m, PreTrainedModel) and embeddings is not None and any(e is embeddings for e in m.modules())]
    return holders[-1] if holders else model


def _structure(model: nn.Module, counts: frozenset[int]) -> tuple[dict[str, str], list[str], str | None]:
    """(module path -> component for towers, MTP, experts and MoE-block children; decoder layer
    paths; lm_head path)."""
    from transformers import PreTrainedModel

    modules = dict(model.named_modules())
    paths = {id(m): p for p, m in modules.items()}
    decoder = _text_decoder(model)
    decoder_path = paths[id(decoder)]
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    hidden = embeddings.weight.shape[-1] if embeddings is not None and hasattr(embeddings, "weight") else -1
    fixed: dict[str, str] = {}
    for path, module in modules.items():
        if not path or _owner(path, fixed) is not None:
            continue
        inside_text = decoder_path == "" or path.startswith(decoder_path + ".") or (decoder_path + ".").startswith(path + ".")
        if isinstance(module, PreTrainedModel) and module is not decoder and not inside_text:
            fixed[path] = "audio" if AUDIO_CLASS.search(type(module).__name__) else "vision"
        elif MTP_CLASS.search(type(module).__name__):
            fixed[path] = "mtp"
    # The layer lists: module lists of the text model, or of its direct children (an encoder and a decoder)
    depth = decoder_path.count(".") + 1 if decoder_path else 0
    layer_lists = [p for p, m in modules.items() if isinstance(m, nn.ModuleList) and p.startswith(f"{decoder_path}.".lstrip(".")) and p.count(".") in (depth, depth + 1)]
    layer_lists = [p for p in layer_lists if not any(p.startswith(q + ".") for q in layer_lists)]
    for path, module in modules.items():
        if path and path not in layer_lists and _owner(path, fixed) is None and _is_experts_container(module, counts):
            block_path = path.rpartition(".")[0]
            fixed[path] = "routed_experts"
            fixed.update(_moe_block_roles(block_path, modules[block_path], path, counts, hidden))
    layers = [f"{p}.{k}" for p in layer_lists for k in range(len(modules[p]))]
    return fixed, layers, (paths.get(id(head)) if head is not None else None)


def _owner(path: str, table: dict[str, str]) -> str | None:
    """The entry of ``table`` for ``path`` or its nearest ancestor."""
    while True:
        if path in table:
            return table[path]
        if not path:
            return None
        path = path.rpartition(".")[0]


def _class_component(module: nn.Module) -> str | None:
    if isinstance(module, nn.ModuleList) and len(module):  # parallel copies (LongCat-Flash's two attentions)
        module = module[0]
    name = type(module).__name__
    if RESIDUAL_CLASS.search(name):
        return "residual_scales"
    if ATTENTION_CLASS.search(name) and not LINEAR_ATTENTION_CLASS.search(name):
        return "attention"
    if LINEAR_ATTENTION_CLASS.search(name):
        return "linear_attention"
    if MLP_CLASS.search(name):
        return "dense_mlp"
    return None


def _layer_component(layer: str, module_path: str, modules: dict[str, nn.Module]) -> str | None:
    """The component of a module inside a decoder layer: the innermost enclosing module whose
    class says what it is; else a layer child of two or more Linears is a dense MLP."""
    path = module_path
    while len(path) > len(layer):
        found = _class_component(modules[path])
        if found is not None:
            return found
        path = path.rpartition(".")[0]
    child = modules[layer + "." + module_path[len(layer) + 1 :].split(".")[0]]
    return "dense_mlp" if len(_linears(child)) >= 2 else None


def _component_of_tensor(name: str, modules: dict[str, nn.Module], fixed: dict[str, str], layers: list[str], head_path: str | None, decoder_path: str) -> tuple[str | None, str]:
    module_path = name.rpartition(".")[0]
    found = _owner(module_path, fixed)
    if found is not None:
        return found, ""
    if head_path is not None and (module_path == head_path or module_path.startswith(head_path + ".")):
        return "lm_head", ""
    owner = modules.get(module_path)
    if isinstance(owner, nn.Embedding) or (owner is not None and EMBEDDING_CLASS.search(type(owner).__name__)):
        return "embeddings", ""
    if owner is not None and NORM_CLASS.search(type(owner).__name__):
        return "norms", ""
    if owner is not None and RESIDUAL_CLASS.search(type(owner).__name__):
        return "residual_scales", ""
    if module_path in layers or module_path == decoder_path:
        return "residual_scales", ""  # a layer's or the text model's own vectors: residual-stream scales
    for layer in layers:
        if module_path.startswith(layer + "."):
            component = _layer_component(layer, module_path, modules)
            if component is not None:
                return component, ""
            child = modules[layer + "." + module_path[len(layer) + 1 :].split(".")[0]]
            return None, f"{type(child).__name__} in a decoder layer is none of attention, linear attention, MLP, MoE"
    if decoder_path and not module_path.startswith(decoder_path + "."):
        return ("audio" if AUDIO_PATH.search(module_path) else "vision"), ""  # a wrapper's projector between a tower and the text model
    kind = type(owner).__name__ if owner is not None else "a parameter of no module"
    return None, f"{kind} outside the decoder layers, embeddings, norms and lm_head"


def derive_components(config: dict[str, Any]) -> DerivedComponents:
    """Every on-disk tensor of ``config``'s checkpoint with its component (see the module doc)."""
    counts = expert_counts(config)
    model, state_dict, revert = build_meta_model(config)
    modules = dict(model.named_modules())
    fixed, layers, head_path = _structure(model, counts)
    decoder_path = next(p for p, m in modules.items() if m is _text_decoder(model))
    result = DerivedComponents(architecture=type(model).__name__)
    by_component: dict[str | None, dict[str, torch.Tensor]] = {}
    reasons: dict[str, str] = {}
    for name, tensor in state_dict.items():
        component, reason = _component_of_tensor(name, modules, fixed, layers, head_path, decoder_path)
        by_component.setdefault(component, {})[name] = tensor
        if component is None:
            reasons[name] = reason
    for component, tensors in by_component.items():
        try:
            on_disk = revert(tensors)
        except Exception as exc:  # noqa: BLE001 - a conversion spanning components: said, not guessed
            raise ConfigError(f"transformers' checkpoint conversion of {result.architecture} mixes components: {type(exc).__name__}: {exc}") from exc
        for disk_name in on_disk:
            if component is None:
                result.reasons[disk_name] = reasons.get(disk_name) or next(iter(reasons.values()))
            else:
                result.components[disk_name] = component
    return result
