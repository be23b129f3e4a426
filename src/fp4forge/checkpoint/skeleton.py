"""The tensors a checkpoint of a given config.json holds on disk, derived without weights.

The transformers model is built on the meta device and run through the same steps
``save_pretrained`` uses (ignored keys, tied weights, and the reverse weight conversion that turns
transformers 5's fused 3-D experts back into per-expert 2-D tensors), so the names and shapes are
exactly the on-disk ones. The synthetic testbed writes these; the audit checks checkpoints
against them.
"""

from __future__ import annotations

import copy
import math
from typing import Any, Callable

import torch
from transformers import AutoModelForCausalLM, PreTrainedConfig
from transformers.core_model_loading import revert_weight_conversion
from transformers.modeling_utils import remove_tied_weights_from_state_dict
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from fp4forge.checkpoint.skeleton_data import MAX_COUNT, check_counts  # noqa: F401 - MAX_COUNT: re-exported
from fp4forge.checkpoint.writer import TensorSpec
from fp4forge.errors import ConfigError

TORCH_TO_SAFETENSORS = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.float64: "F64", torch.int64: "I64", torch.int32: "I32"}


def model_config_dict(config: dict[str, Any]) -> dict[str, Any]:
    """The config as written to disk: fp4forge's own annotations removed."""
    return {k: v for k, v in config.items() if not k.startswith("_fp4forge")}



def to_transformers_config(config: dict[str, Any] | PreTrainedConfig) -> PreTrainedConfig:
    if isinstance(config, PreTrainedConfig):
        return config
    check_counts(config)
    model_type = config.get("model_type")
    if model_type not in CONFIG_MAPPING:
        raise ConfigError(f"model_type {model_type!r} is not known to this transformers version")
    try:
        # a deep copy: transformers writes into nested dicts (rope_scaling gains rope_theta)
        return CONFIG_MAPPING[model_type].from_dict(copy.deepcopy(model_config_dict(config)))
    except Exception as exc:  # noqa: BLE001 - transformers validates an untrusted file in its own ways (strict dataclasses, ...)
        reason = " ".join(str(exc).split())  # one line: validation messages span several
        raise ConfigError(f"invalid {model_type} config: {type(exc).__name__}: {reason}") from exc


def config_dtype(config: PreTrainedConfig) -> torch.dtype:
    dtype = getattr(config, "dtype", None) or torch.bfloat16
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    if dtype not in TORCH_TO_SAFETENSORS:
        raise ConfigError(f"unsupported checkpoint dtype {dtype!r}")
    return dtype


WRAPPER_SUFFIX = "ForConditionalGeneration"
TEXT_PREFIX, WRAPPED_TEXT_PREFIX = "model.", "model.language_model."


def _named_class(config: dict[str, Any] | PreTrainedConfig, hf_config: PreTrainedConfig) -> tuple[type | None, str | None]:
    """(the transformers class config.json's `architectures` names, when it takes this config;
    else None) and that name. The skeleton follows the named class, wrappers included: a
    vision-language release stores its text model under `model.language_model.`."""
    architectures = config.get("architectures") if isinstance(config, dict) else getattr(config, "architectures", None)
    name = architectures[0] if isinstance(architectures, list) and architectures and isinstance(architectures[0], str) else None
    if name is None:
        return None, None
    import transformers
    from transformers import PreTrainedModel

    try:
        cls = getattr(transformers, name, None)
    except Exception:  # noqa: BLE001 - transformers' lazy module raises its own errors for broken optional imports
        cls = None
    if isinstance(cls, type) and issubclass(cls, PreTrainedModel) and isinstance(hf_config, cls.config_class):
        return cls, name
    return None, name


def _auto_model(hf_config: PreTrainedConfig, dtype: torch.dtype) -> Any:
    """The config's causal LM; for a config no causal LM takes (vision-language, speech,
    encoder-decoder wrappers), the first auto class that takes it."""
    from transformers import AutoModel, AutoModelForImageTextToText, AutoModelForSeq2SeqLM

    for auto in (AutoModelForCausalLM, AutoModelForImageTextToText, AutoModelForSeq2SeqLM):
        try:
            return auto.from_config(hf_config, dtype=dtype)
        except ValueError as exc:
            if "Unrecognized configuration class" not in str(exc):
                raise
    return AutoModel.from_config(hf_config, dtype=dtype)


def build_meta_model(config: dict[str, Any] | PreTrainedConfig) -> tuple[Any, dict[str, torch.Tensor], Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]]:
    """(the model config.json names, built on the meta device: of the class `architectures` names
    when transformers has it, else its causal LM; its state dict as ``save_pretrained`` keeps it
    before renaming (ignored keys and tied weights removed); the function turning part of that
    state dict into on-disk names: transformers' reverse weight conversion, and a wrapper's
    `model.language_model.` prefix when a wrapper's name stands over a text-only config)."""
    hf_config = to_transformers_config(config)
    dtype = config_dtype(hf_config)
    cls, class_name = _named_class(config, hf_config)
    prefix = WRAPPED_TEXT_PREFIX if cls is None and class_name and class_name.endswith(WRAPPER_SUFFIX) else None
    try:
        with torch.device("meta"):
            model = cls._from_config(hf_config, dtype=dtype) if cls is not None else _auto_model(hf_config, dtype)
        # The same steps as PreTrainedModel.save_pretrained, minus the data.
        state_dict = model.state_dict()
        for key in model._keys_to_ignore_on_save or []:
            state_dict.pop(key, None)
        state_dict = remove_tied_weights_from_state_dict(state_dict, model)
    except Exception as exc:  # noqa: BLE001 - a config transformers accepted but cannot build (a zero head count, ...)
        reason = " ".join(str(exc).split())
        raise ConfigError(f"transformers cannot build {hf_config.model_type} from this config: {type(exc).__name__}: {reason}") from exc

    def on_disk(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        reverted = revert_weight_conversion(model, dict(tensors))
        if prefix is None:
            return reverted
        return {(prefix + name[len(TEXT_PREFIX):] if name.startswith(TEXT_PREFIX) else name): t for name, t in reverted.items()}

    return model, state_dict, on_disk


def checkpoint_specs(config: dict[str, Any] | PreTrainedConfig) -> list[TensorSpec]:
    """Every tensor ``save_pretrained`` writes for this config, in its natural layer order (the
    model :func:`build_meta_model` builds)."""
    model, state_dict, on_disk = build_meta_model(config)
    try:
        state_dict = on_disk(state_dict)
    except Exception as exc:  # noqa: BLE001 - transformers' conversion of a model it built
        reason = " ".join(str(exc).split())
        raise ConfigError(f"transformers cannot convert {type(model).__name__} to its checkpoint names: {type(exc).__name__}: {reason}") from exc
    specs = []
    for name, tensor in state_dict.items():
        if tensor.dtype not in TORCH_TO_SAFETENSORS:
            raise ConfigError(f"tensor {name} has dtype {tensor.dtype}, which fp4forge cannot describe", tensor=name)
        specs.append(TensorSpec(name, TORCH_TO_SAFETENSORS[tensor.dtype], tuple(tensor.shape)))
    return specs


def count_parameters(config: dict[str, Any] | PreTrainedConfig) -> int:
    """Number of parameters a full checkpoint of ``config`` stores (as save_pretrained writes it)."""
    return sum(math.prod(spec.shape) for spec in checkpoint_specs(config))



def expected_tensor_specs(config: dict[str, Any] | PreTrainedConfig) -> list[TensorSpec]:
    """The on-disk (name, dtype, shape) of every tensor a BF16 checkpoint of ``config`` holds."""
    return checkpoint_specs(config)
