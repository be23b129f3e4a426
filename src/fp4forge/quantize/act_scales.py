"""Where activation (input) amax values come from: calibration statistics, or an explicit
constant the user asked for. There is no silent default: W4A4 and static FP8 need one of
them, and the choice is recorded in the provenance (the audit flags constants).

Statistics file (written by `fp4forge calibrate`, see `write_stats`): a safetensors file with
F32 tensors, names as on disk (per-expert 2-D module names, not transformers' fused ones)
  `<module>.input_amax`                 [1]  running max |x| of the Linear's input over all
                                             calibration tokens (routed experts: the tokens the
                                             coverage policy gives them; an expert that saw none
                                             carries its layer peers' max)
  `<layer>.self_attn.k_amax`            [1]  (and `v_amax`) max |K| / |V| as written to the KV
                                             cache (after k-norm and RoPE)
  `<layer>.self_attn.k_amax_per_head`   [num_kv_heads]  (and `v_amax_per_head`) the same per KV head
plus `__metadata__` {"fp4forge_stats": "1", "calibration": "<JSON>"}; the JSON holds the MoE
coverage policy ("routed" | "all-experts"), `tokens_per_expert` {experts module: [count per
expert]}, `experts_without_tokens` [expert modules], and the data (sample count, seq_len, token
count, sources, a digest of the token ids).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from fp4forge.errors import ConfigError

STATS_MARKER = "fp4forge_stats"
STATS_METADATA_KEY = "calibration"


@dataclass(frozen=True)
class ConstantAmax:
    value: float

    def input_amax(self, module: str) -> float:
        return self.value

    def kv_amax(self, layer_prefix: str) -> tuple[float, float]:
        return self.value, self.value

    def provenance(self) -> dict:
        return {"source": "constant", "amax": self.value, "note": "explicit constant, not calibrated"}


class StatsAmax:
    def __init__(self, path: str | Path):
        from safetensors import safe_open

        self.path = Path(path)
        try:
            with safe_open(self.path, framework="pt") as fh:
                metadata = fh.metadata() or {}
                self._values = {name: float(fh.get_tensor(name).float().max()) for name in fh.keys()}
        except (OSError, ValueError, RuntimeError) as exc:  # safetensors raises these for bad files
            raise ConfigError(f"cannot read statistics file {self.path}: {exc}") from None
        if metadata.get(STATS_MARKER) is None:
            raise ConfigError(f"{self.path} is not an fp4forge statistics file (no {STATS_MARKER} metadata)")
        self.metadata = metadata

    def _get(self, name: str) -> float:
        if name not in self._values:
            raise ConfigError(f"statistics file {self.path} has no {name!r}; was it calibrated on this model?")
        return self._values[name]

    def input_amax(self, module: str) -> float:
        return self._get(f"{module}.input_amax")

    def kv_amax(self, layer_prefix: str) -> tuple[float, float]:
        return self._get(f"{layer_prefix}.self_attn.k_amax"), self._get(f"{layer_prefix}.self_attn.v_amax")

    def provenance(self) -> dict:
        return {"source": "calibration", "file": self.path.name, "metadata": self.metadata}


def parse_act_scales(option: str | None, stats: str | Path | None):
    """A statistics file or ``constant:AMAX`` (at most one of the two)."""
    if stats is not None and option is not None:
        raise ConfigError("give either calibration statistics or a constant activation amax, not both", option="act_scales")
    if stats is not None:
        return StatsAmax(stats)
    if option is None:
        return None
    kind, _, value = option.partition(":")
    try:
        amax = float(value)
    except ValueError:
        amax = float("nan")
    if kind != "constant" or not amax > 0 or amax == float("inf"):
        raise ConfigError(f"the activation amax must be constant:AMAX with a finite AMAX > 0, got {option!r}", option="act_scales")
    return ConstantAmax(amax)


def write_stats(path: str | Path, tensors: dict, metadata: dict) -> Path:
    """Write a statistics file atomically (temp file beside it, then rename)."""
    import json
    import os
    import tempfile

    import torch

    from fp4forge.checkpoint.safetensors_format import encode_header, reference_order

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    bad = sorted(n for n, t in tensors.items() if t.dtype != torch.float32)
    if bad:
        raise ConfigError(f"statistics tensors must be F32, got others for {bad[:3]}")
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent)
    try:
        # Encoded here, not by safetensors' save_file: it orders a metadata map of two keys by a
        # per-process random hash, so two identical calibrations wrote different bytes.
        header = {STATS_MARKER: "1", STATS_METADATA_KEY: json.dumps(metadata, sort_keys=True)}
        entries = reference_order([(name, "F32", tuple(t.shape)) for name, t in tensors.items()])
        prefix, _ = encode_header(entries, header)
        with os.fdopen(fd, "wb") as fh:
            fh.write(prefix)
            for name, _, _ in entries:
                fh.write(tensors[name].detach().contiguous().numpy().tobytes())
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)
    return path

