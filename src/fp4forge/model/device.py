"""Where compute runs: the one parser of ``--device`` (library keyword ``device``).

``None`` or ``"auto"`` picks CUDA when torch sees a GPU, else the CPU; ``"cpu"`` forces the CPU;
``"cuda"`` / ``"cuda:N"`` ask for a GPU and are refused with a named error (option ``device``)
when torch has none, so a typo or a CPU-only machine never ends in a traceback.
"""

from __future__ import annotations

import torch

from fp4forge.errors import ConfigError

DEVICE_CHOICES = ("auto", "cpu", "cuda", "cuda:N")


def resolve_device(value: str | torch.device | None = None) -> torch.device:
    """The ``torch.device`` that ``value`` names (see the module docstring)."""
    if isinstance(value, torch.device):
        value = str(value)
    text = "auto" if value is None else str(value).strip().lower()
    if text == "auto":
        return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    if text == "cpu":
        return torch.device("cpu")
    if text == "cuda" or (text.startswith("cuda:") and text[5:].isdigit()):
        if not torch.cuda.is_available():
            raise ConfigError(f"{value!r} asked for a CUDA GPU, but torch {torch.__version__} sees none (use cpu)", option="device")
        device = torch.device(text)
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError(f"{value!r}: torch sees {torch.cuda.device_count()} CUDA device(s)", option="device")
        return device
    raise ConfigError(f"unknown device {value!r}; one of {', '.join(DEVICE_CHOICES)}", option="device")


def is_cuda(device: torch.device) -> bool:
    return device.type == "cuda"
