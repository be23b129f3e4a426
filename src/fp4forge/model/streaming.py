"""Layer-streamed execution of a transformers causal LM straight from its checkpoint.

The model is built on the meta device from ``config.json``; nothing is materialised until asked.
Then, one stage at a time:

1. **Prologue.** The embedding table and the rotary embedding are materialised, the decoder
   layers are swapped for recorders, and the base model's *own* forward runs: it embeds the
   tokens and builds the attention masks (sliding window included), position ids and rotary
   cos/sin exactly as the full model does; the recorders capture what each layer receives.
2. **Decoder layers.** Layer i is materialised from the checkpoint (``Checkpoint.read_tensor``,
   one disk tensor at a time written into its slot of the freshly allocated parameters), every
   batch of activations goes through it, and it goes back to the meta device.
3. **Head.** The final norm and lm_head, last.

transformers 5 fuses routed experts in memory (``mlp.experts.gate_up_proj`` [E, 2I, H]) while the
disk holds per-expert 2-D tensors. :class:`WeightPlan` reads transformers' own conversion table
(``get_model_conversion_mapping``: renamings plus ``MergeModulelist`` / ``Concatenate``
converters) and turns it into "disk tensor -> (parameter, expert, offset)" placements, so each
expert is copied in place instead of stacked (no 2x transient at 256 experts). Anything in that
table this module does not understand is refused, never guessed.

**Devices.** Everything above runs on one ``torch.device`` (``device=``; CPU or CUDA). While
layer i is materialised and run on the device, a background reader thread (:class:`LayerPrefetcher`)
already reads layer i+1's tensors from the checkpoint into host memory (page-locked when the
device is CUDA, so the host-to-device copy is a plain DMA): disk and compute overlap. Results do
not depend on the prefetch: the same tensors are copied into the same slots. A reader may hand
over a value with ``on_device(device)`` instead of a tensor (a quantized student's stored codes
and scales): it is decoded on the device the layer is materialised on.

**Memory.** Host: at most two decoder layers' tensors (the one being materialised and the one
read ahead), the embedding table while embedding, and the activations that do not fit on the
device. Device: one decoder layer's parameters, the layer's transient working set (one batch
through it), and the activations kept on the device, up to ``activation_budget_bytes``; so the
peak device memory is about one to two layers plus the activation budget (two while the
caching allocator still holds the previous layer's blocks). Activations beyond the device budget
move to host RAM (up to ``ram_budget_bytes``) and beyond that spill to files
(:class:`ActivationStore`). On the CPU the device tier is RAM too; its budget defaults to 0 there,
so the CPU behaviour is the RAM budget alone. The host bound, stated: docs/gpu.md#host-memory.
"""

from __future__ import annotations

import contextlib
import math
import re
import shutil
import tempfile
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn
from transformers import AutoModelForCausalLM, PreTrainedModel
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import (
    Concatenate,
    MergeModulelist,
    PrefixChange,
    WeightConverter,
    WeightRenaming,
    rename_source_key,
)

from fp4forge.checkpoint.reader import TORCH_DTYPES, Checkpoint, HostAlloc, host_copy
from fp4forge.checkpoint.skeleton import config_dtype, model_config_dict, to_transformers_config
from fp4forge.errors import CheckpointError, ConfigError
from fp4forge.model.device import is_cuda, resolve_device
from fp4forge.model.host_memory import SlabRing, aligned, empty_host_cache
from fp4forge.model.samples import DEFAULT_RAM_BUDGET_BYTES  # re-exported: its users import it here

# Activations kept on a CUDA device before they move to host RAM (the CPU default is 0: RAM alone).
DEFAULT_DEVICE_ACTIVATION_BYTES = 8 * 2**30


def default_activation_budget(device: torch.device) -> int:
    return DEFAULT_DEVICE_ACTIVATION_BYTES if is_cuda(device) else 0


# -- where tensors come from ---------------------------------------------------------------------
class TensorReader(Protocol):
    """Named tensors as ``save_pretrained`` names them (BF16 logical weights for a student)."""

    def shapes(self) -> dict[str, tuple[int, ...]]: ...

    def read(self, name: str) -> torch.Tensor: ...


class CheckpointTensors:
    """A plain (unquantized) checkpoint, tensor by tensor."""

    def __init__(self, ckpt: Checkpoint):
        self.ckpt = ckpt

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {info.name: tuple(info.shape) for _, info in self.ckpt.tensors()}

    def read(self, name: str) -> torch.Tensor:
        return self.ckpt.read_tensor(name)

    def will_need(self, names: list[str]) -> None:
        """Ask the kernel to start reading the file range that holds ``names`` (per shard, from
        the first tensor's start to the last one's end) into the page cache now, asynchronously:
        one large request in flight instead of one tensor-sized read at a time. A hint; no-op for
        sources that are not local files."""
        will_need = getattr(self.ckpt.source, "will_need", None)
        if will_need is None:
            return
        spans: dict[str, tuple[int, int]] = {}
        for name in names:
            shard, info = self.ckpt.locate(name)
            begin = self.ckpt.headers[shard].data_start + info.begin
            lo, hi = spans.get(shard, (begin, begin + info.nbytes))
            spans[shard] = (min(lo, begin), max(hi, begin + info.nbytes))
        for shard, (lo, hi) in spans.items():
            will_need(shard, lo, hi - lo)  # the source's one posix_fadvise WILLNEED (checkpoint/source.py)

    def host_nbytes(self, names: list[str]) -> list[int]:
        """The bytes :meth:`read_host` hands over for each of ``names`` (sizes a read-ahead slab)."""
        return [self.ckpt.locate(name)[1].nbytes for name in names]

    def read_host(self, name: str, pin: bool, out: torch.Tensor | None = None, alloc: HostAlloc | None = None) -> torch.Tensor:
        """``read``, but a local file is read straight into the (page-locked with ``pin``) tensor:
        one copy from the page cache, the GIL released while the kernel copies. With ``out`` (a
        contiguous host tensor of the tensor's dtype and element count, e.g. one slice of a
        stack), the values go there and ``out`` is returned; with ``alloc`` (a read-ahead slab's
        ``empty``), the tensor is made by it."""
        shard, info = self.ckpt.locate(name)
        local_path = getattr(self.ckpt.source, "path", None)
        dtype = getattr(torch, TORCH_DTYPES.get(info.dtype, ""), None)
        if out is not None and (out.dtype != dtype or out.numel() != math.prod(info.shape) or not out.is_contiguous()):
            raise CheckpointError(f"cannot read {info.dtype}{list(info.shape)} into {out.dtype}{list(out.shape)}", file=self.ckpt.display, tensor=name)
        if local_path is None or dtype is None or info.dtype == "F4":
            value = self.read(name)
            if out is not None:
                return out.copy_(value.reshape(out.shape))
            return host_copy(value, pin, alloc)
        if out is None:
            out = alloc(tuple(info.shape), dtype) if alloc is not None else torch.empty(tuple(info.shape), dtype=dtype, pin_memory=pin)
        view = memoryview(out.reshape(-1).view(torch.uint8).numpy()) if info.nbytes else memoryview(b"")
        got = 0
        with open(local_path(shard), "rb", buffering=0) as fh:
            fh.seek(self.ckpt.headers[shard].data_start + info.begin)
            while got < info.nbytes:
                n = fh.readinto(view[got:])
                if not n:
                    raise CheckpointError(f"file ends {info.nbytes - got} bytes before the tensor does", file=self.ckpt.display, tensor=name)
                got += n
        return out


# -- the model skeleton --------------------------------------------------------------------------
def build_meta_model(config: dict[str, Any]) -> PreTrainedModel:
    """The transformers model of ``config`` on the meta device, in the config's dtype, eval mode.
    A ``quantization_config`` is dropped: fp4forge supplies (dequantized) weights itself."""
    plain = {k: v for k, v in model_config_dict(config).items() if k != "quantization_config"}
    hf_config = to_transformers_config(plain)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=config_dtype(hf_config))
    return model.eval()


def base_model(model: PreTrainedModel) -> nn.Module:
    return getattr(model, model.base_model_prefix)


def decoder_layers(model: PreTrainedModel) -> nn.ModuleList:
    layers = getattr(base_model(model), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ConfigError(f"{type(model).__name__}: no decoder layer list at {model.base_model_prefix}.layers")
    return layers


def module_name(model: PreTrainedModel, module: nn.Module) -> str:
    for name, candidate in model.named_modules():
        if candidate is module:
            return name
    raise ConfigError(f"module {type(module).__name__} is not part of {type(model).__name__}")


# -- disk tensor -> parameter placements -----------------------------------------------------------
@dataclass(frozen=True)
class Placement:
    """Where one disk tensor goes: the whole parameter, or ``param[expert]`` (MergeModulelist),
    narrowed to ``[offset, offset + size)`` along ``dim`` of that expert slice (Concatenate)."""

    disk_name: str
    param: str
    expert: int | None = None
    dim: int | None = None
    offset: int = 0
    size: int = 0

    @property
    def disk_module(self) -> str:
        return self.disk_name.rsplit(".", 1)[0]

    def target(self, param: torch.Tensor) -> torch.Tensor:
        view = param if self.expert is None else param[self.expert]
        return view if self.dim is None else view.narrow(self.dim, self.offset, self.size)


@dataclass
class WeightPlan:
    """Every parameter of the model -> the disk tensors that fill it."""

    placements: dict[str, list[Placement]]
    unexpected: list[str] = field(default_factory=list)

    def for_param(self, param: str) -> list[Placement]:
        found = self.placements.get(param)
        if not found:
            raise ConfigError(f"no checkpoint tensor fills parameter {param!r}", tensor=param)
        return found

    def disk_module(self, memory_module: str, param: str = "weight") -> str:
        """On-disk module name of an in-memory module holding one whole parameter (a Linear)."""
        (placement,) = self.for_param(f"{memory_module}.{param}")
        return placement.disk_module

    def expert_modules(self, param: str, expert: int) -> list[str]:
        """Disk modules (in concatenation order) whose weights make ``param[expert]``."""
        found = [p for p in self.for_param(param) if p.expert == expert]
        return [p.disk_module for p in sorted(found, key=lambda p: p.offset)]


def _conversions(model: PreTrainedModel) -> tuple[list[WeightRenaming], list[WeightConverter]]:
    transforms = [t for t in get_model_conversion_mapping(model) if not isinstance(t, PrefixChange)]
    return [t for t in transforms if isinstance(t, WeightRenaming)], [t for t in transforms if isinstance(t, WeightConverter)]


def _expert_index(pattern: str, disk_name: str) -> int:
    regex = re.escape(pattern).replace(r"\*", r"(\d+)")
    match = re.search(regex, disk_name)
    if match is None:
        raise ConfigError(f"cannot find the expert index of {disk_name!r} in pattern {pattern!r}", tensor=disk_name)
    return int(match.group(1))


def _check_operations(converter: WeightConverter) -> int | None:
    """The Concatenate dim of a [MergeModulelist(0)] or [MergeModulelist(0), Concatenate(d)]
    chain (None for the first); anything else is refused."""
    ops = list(converter.operations)
    if ops and isinstance(ops[0], MergeModulelist) and ops[0].dim == 0:
        if len(ops) == 1:
            return None
        if len(ops) == 2 and isinstance(ops[1], Concatenate) and ops[1].dim >= 1:
            return ops[1].dim
    raise ConfigError(f"transformers weight conversion {ops} for {converter.source_patterns} is not supported by fp4forge's layer streamer")


def build_weight_plan(model: PreTrainedModel, disk_shapes: dict[str, tuple[int, ...]]) -> WeightPlan:
    """Map every disk tensor to its place in ``model`` the way ``from_pretrained`` would."""
    renamings, converters = _conversions(model)
    meta_state = model.state_dict()
    prefix = model.base_model_prefix
    pattern_owner = {pattern: conv for conv in converters for pattern in conv.source_patterns}
    placements: dict[str, list[Placement]] = {}
    unexpected: list[str] = []
    # (param, pattern) -> pieces, to lay out concatenated sources after all are known
    pieces: dict[tuple[str, str], list[tuple[int, str]]] = {}
    for disk_name in disk_shapes:
        target, pattern = rename_source_key(disk_name, renamings, converters, prefix, meta_state)
        if target not in meta_state and disk_name in meta_state:
            target, pattern = rename_source_key(disk_name, [], [], prefix, meta_state)
        if target not in meta_state:
            unexpected.append(disk_name)
            continue
        if pattern is None:
            placements.setdefault(target, []).append(Placement(disk_name, target))
            continue
        pieces.setdefault((target, pattern), []).append((_expert_index(pattern, disk_name), disk_name))
    for (target, pattern), members in pieces.items():
        converter = pattern_owner[pattern]
        concat_dim = _check_operations(converter)
        if concat_dim is None:
            placements.setdefault(target, []).extend(Placement(name, target, expert) for expert, name in members)
            continue
        dim = concat_dim - 1  # the dim inside one expert's slice
        offset = 0
        for earlier in converter.source_patterns[: converter.source_patterns.index(pattern)]:
            sample = pieces.get((target, earlier))
            if sample:
                offset += disk_shapes[sample[0][1]][dim]
        size = disk_shapes[members[0][1]][dim]
        placements.setdefault(target, []).extend(Placement(name, target, expert, dim, offset, size) for expert, name in members)
    _add_tied(model, placements)
    return WeightPlan(placements, unexpected)


def _add_tied(model: PreTrainedModel, placements: dict[str, list[Placement]]) -> None:
    """A tied parameter absent from disk (lm_head with tied embeddings) reads its source's tensor."""
    for target, source in (getattr(model, "all_tied_weights_keys", None) or {}).items():
        if target not in placements and source in placements:
            placements[target] = [Placement(p.disk_name, target, p.expert, p.dim, p.offset, p.size) for p in placements[source]]


# -- materialising one module ----------------------------------------------------------------------
def _check_no_volatile_buffers(module: nn.Module, prefix: str) -> None:
    for name, sub in module.named_modules():
        if getattr(sub, "_non_persistent_buffers_set", None):
            raise ConfigError(f"{prefix}.{name} has non-persistent buffers the checkpoint cannot fill; the streamer does not support it")


def disk_names(module: nn.Module, prefix: str, plan: WeightPlan) -> list[str]:
    """The checkpoint tensors that fill ``module`` (in-memory name ``prefix``), in fill order."""
    names: list[str] = []
    for name, _ in [*module.named_parameters(), *module.named_buffers()]:
        full = f"{prefix}.{name}" if prefix else name
        names.extend(p.disk_name for p in plan.for_param(full))
    return names


READ_THREADS = 4  # tensors of one layer read at once: a disk (NVMe, network) wants several requests in flight


def _read_one(reader: TensorReader, name: str, pin: bool, alloc: HostAlloc | None = None) -> torch.Tensor:
    read_host = getattr(reader, "read_host", None)
    if read_host is not None:
        return read_host(name, pin, alloc=alloc) if alloc is not None else read_host(name, pin)
    return host_copy(reader.read(name), pin, alloc)


def read_tensors(reader: TensorReader, names: list[str], pin: bool = False, pool: ThreadPoolExecutor | None = None,
                 alloc: HostAlloc | None = None) -> dict[str, torch.Tensor]:
    """``names`` read from ``reader`` (into page-locked memory with ``pin``, made by ``alloc`` when
    given; on ``pool``'s threads if given)."""
    if pool is None:
        return {name: _read_one(reader, name, pin, alloc) for name in names}
    futures = {name: pool.submit(_read_one, reader, name, pin, alloc) for name in names}
    return {name: future.result() for name, future in futures.items()}


@torch.no_grad()
def materialize(
    module: nn.Module,
    prefix: str,
    plan: WeightPlan,
    reader: TensorReader,
    device: torch.device | str = "cpu",
    tensors: dict[str, torch.Tensor] | None = None,
) -> nn.Module:
    """Allocate ``module``'s parameters on ``device`` and fill every element from the checkpoint
    (from ``tensors`` when already read ahead, else from ``reader``)."""
    _check_no_volatile_buffers(module, prefix)
    module.to_empty(device=device)
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        full = f"{prefix}.{name}" if prefix else name
        written = 0
        for placement in plan.for_param(full):
            target = placement.target(tensor)
            value = tensors.pop(placement.disk_name) if tensors and placement.disk_name in tensors else reader.read(placement.disk_name)
            on_device = getattr(value, "on_device", None)  # stored codes the reader left to decode here
            if on_device is not None:
                value = on_device(target.device)
            if tuple(value.shape) != tuple(target.shape):
                raise ConfigError(f"{placement.disk_name}: shape {list(value.shape)} does not fit {full} slot {list(target.shape)}", tensor=placement.disk_name)
            target.copy_(value, non_blocking=value.is_pinned())
            written += target.numel()
        if written != tensor.numel():  # a partial fill would leave to_empty's garbage in place
            raise ConfigError(f"{full}: checkpoint tensors cover {written} of {tensor.numel()} elements", tensor=full)
    return module


def release(module: nn.Module) -> None:
    """Back to the meta device: the parameters' memory is freed."""
    module.to("meta")


class LayerPrefetcher:
    """Reads decoder layers' checkpoint tensors in the background (``READ_THREADS`` at once), one layer ahead.

    ``request(i)`` starts reading layer i (if not already); ``take(i)`` waits for it and hands
    the tensors over. Pinned host memory when the device is CUDA: layer i's tensors are carved
    from slab ``i % 2`` of ``slabs`` (model/host_memory.py) where the reader can size them, so
    the host holds two layers' bytes, once; the materialising side marks a slab ``copied`` and
    its next fill waits for that. At most the requested layers are held, so with "take i,
    request i+1" the host holds two layers at most."""

    def __init__(self, reader: TensorReader, names_of: Any, pin: bool, slabs: SlabRing | None = None):
        self.reader = reader
        self.names_of = names_of  # index -> list of disk names
        self.pin = pin
        self.slabs = slabs
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fp4forge-prefetch")
        self._readers = ThreadPoolExecutor(max_workers=READ_THREADS, thread_name_prefix="fp4forge-read")
        self._pending: dict[int, Future] = {}

    def request(self, index: int) -> None:
        if index not in self._pending:
            self._pending[index] = self._pool.submit(self._read_layer, index)

    def _read_layer(self, index: int) -> dict[str, torch.Tensor]:
        if self.slabs is None:
            return read_tensors(self.reader, self.names_of(index), self.pin, self._readers)
        slab = self.slabs.for_layer(index)
        slab.reset()  # waits for the device to finish copying the layer this slab held before
        return read_tensors(self.reader, self.names_of(index), self.pin, self._readers, alloc=slab.empty)

    def copied(self, index: int) -> None:
        """Layer ``index``'s tensors have been queued for copying to the device."""
        if self.slabs is not None:
            self.slabs.for_layer(index).copied()

    def take(self, index: int) -> dict[str, torch.Tensor]:
        self.request(index)
        return self._pending.pop(index).result()

    def close(self) -> None:
        for future in self._pending.values():
            future.cancel()
        self._pending.clear()
        self._pool.shutdown(wait=True)
        self._readers.shutdown(wait=True)
        if self.slabs is not None:
            self.slabs.close()
            self.slabs = None


# -- activations between layers ------------------------------------------------------------------
class ActivationStore:
    """Per-batch activations in three tiers shared by every store of one ``SpillSpace``: on the
    compute device up to its ``activation_budget_bytes``, in host RAM up to ``ram_budget_bytes``,
    in files beyond. ``get`` always returns the tensor on the compute device."""

    def __init__(self, space: SpillSpace, name: str):
        self.space = space
        self.name = name
        self._device: dict[int, torch.Tensor] = {}
        self._ram: dict[int, torch.Tensor] = {}
        self._files: dict[int, Path] = {}

    def put(self, index: int, tensor: torch.Tensor) -> None:
        self.drop(index)
        nbytes = tensor.numel() * tensor.element_size()
        if self.space.reserve_device(nbytes):
            self._device[index] = tensor
            return
        host = tensor.to("cpu")
        if self.space.reserve(nbytes):
            self._ram[index] = host
            return
        path = self.space.path_for(self.name, index)
        torch.save(host.contiguous(), path)
        self._files[index] = path

    def get(self, index: int) -> torch.Tensor:
        if index in self._device:
            return self._device[index]
        if index in self._ram:
            return self._ram[index].to(self.space.device)
        return torch.load(self._files[index], weights_only=True).to(self.space.device)

    def drop(self, index: int) -> None:
        if index in self._device:
            tensor = self._device.pop(index)
            self.space.release_device(tensor.numel() * tensor.element_size())
        if index in self._ram:
            tensor = self._ram.pop(index)
            self.space.release(tensor.numel() * tensor.element_size())
        path = self._files.pop(index, None)
        if path is not None:
            path.unlink(missing_ok=True)

    def clear(self) -> None:
        for index in [*self._device, *self._ram, *self._files]:
            self.drop(index)

    @property
    def spilled(self) -> int:
        return len(self._files)


class SpillSpace:
    """The device budget, the RAM budget and the spill directory that a run's activation stores
    share. ``activation_budget_bytes=None``: the device's default (:func:`default_activation_budget`)."""

    def __init__(
        self,
        ram_budget_bytes: int = DEFAULT_RAM_BUDGET_BYTES,
        spill_dir: Path | None = None,
        *,
        device: torch.device | str = "cpu",
        activation_budget_bytes: int | None = None,
    ):
        self.device = torch.device(device)
        self.ram_budget_bytes = ram_budget_bytes
        self.activation_budget_bytes = default_activation_budget(self.device) if activation_budget_bytes is None else activation_budget_bytes
        self.used_bytes = 0
        self.peak_bytes = 0
        self.spilled_batches = 0  # batches written to files
        self.device_used_bytes = 0
        self.device_peak_bytes = 0
        self.host_batches = 0  # batches that did not fit the device budget
        self._parent = spill_dir
        self._dir: Path | None = None

    def reserve_device(self, nbytes: int) -> bool:
        if self.device_used_bytes + nbytes > self.activation_budget_bytes:
            if self.activation_budget_bytes:  # a zero budget (the CPU default) is no spill
                self.host_batches += 1
            return False
        self.device_used_bytes += nbytes
        self.device_peak_bytes = max(self.device_peak_bytes, self.device_used_bytes)
        return True

    def release_device(self, nbytes: int) -> None:
        self.device_used_bytes -= nbytes

    def reserve(self, nbytes: int) -> bool:
        if self.used_bytes + nbytes > self.ram_budget_bytes:
            self.spilled_batches += 1
            return False
        self.used_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.used_bytes)
        return True

    def release(self, nbytes: int) -> None:
        self.used_bytes -= nbytes

    def path_for(self, store: str, index: int) -> Path:
        if self._dir is None:
            if self._parent is not None:
                self._parent.mkdir(parents=True, exist_ok=True)
            self._dir = Path(tempfile.mkdtemp(prefix="fp4forge-activations-", dir=self._parent))
        return self._dir / f"{store}-{index}.pt"

    def close(self) -> None:
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None


# -- the prologue: what each decoder layer receives ------------------------------------------------
class _PrologueDone(Exception):
    pass


class _LayerInputRecorder(nn.Module):
    """Stands in for decoder layer ``index`` during the prologue; records its call."""

    def __init__(self, index: int, calls: dict[int, tuple[tuple, dict]], last: bool):
        super().__init__()
        self.index = index
        self.calls = calls
        self.last = last

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        self.calls[self.index] = ((hidden_states, *args), kwargs)
        if self.last:
            raise _PrologueDone
        return hidden_states


@dataclass
class LayerCall:
    """How the full model calls decoder layer i: positional extras and keyword arguments
    (attention mask, position ids, rotary cos/sin, ...), without the hidden states."""

    args: tuple
    kwargs: dict[str, Any]


@torch.no_grad()
def run_prologue(model: PreTrainedModel, input_ids: torch.Tensor) -> tuple[torch.Tensor, list[LayerCall]]:
    """(layer 0's input hidden states, every layer's call) for one batch of unpadded ids."""
    base = base_model(model)
    layers = decoder_layers(model)
    calls: dict[int, tuple[tuple, dict]] = {}
    recorders = nn.ModuleList(_LayerInputRecorder(i, calls, i == len(layers) - 1) for i in range(len(layers)))
    base.layers = recorders
    try:
        base(input_ids=input_ids, use_cache=False)
    except _PrologueDone:
        pass
    finally:
        base.layers = layers
    if len(calls) != len(layers):
        raise ConfigError(f"the model's forward called {len(calls)} of {len(layers)} decoder layers")
    hidden = calls[0][0][0]
    return hidden, [LayerCall(args[1:], kwargs) for args, kwargs in (calls[i] for i in range(len(layers)))]


def _real_rotary(model: PreTrainedModel) -> None:
    """Replace the meta rotary embedding by a real one built from the config (its buffers are
    computed, not stored, so ``from_pretrained`` computes them the same way)."""
    base = base_model(model)
    rotary = getattr(base, "rotary_emb", None)
    if rotary is not None and any(b.is_meta for b in rotary.buffers()):
        base.rotary_emb = type(rotary)(config=model.config)


# -- the streamed model ----------------------------------------------------------------------------
class StreamedModel:
    """A causal LM whose parts are materialised one at a time from a checkpoint, on ``device``
    (default: CUDA when available, else CPU), the next decoder layer read ahead on a background
    thread unless ``prefetch=False`` (the results are the same either way)."""

    def __init__(self, config: dict[str, Any], reader: TensorReader, *, device: torch.device | str | None = None, prefetch: bool = True):
        self.device = resolve_device(device)
        self.model = build_meta_model(config)
        self.reader = reader
        self.plan = build_weight_plan(self.model, reader.shapes())
        _real_rotary(self.model)
        rotary = getattr(base_model(self.model), "rotary_emb", None)
        if rotary is not None:
            rotary.to(self.device)
        self.layers = decoder_layers(self.model)
        self.layers_prefix = module_name(self.model, self.layers)
        self._embedding = self.model.get_input_embeddings()
        self._embedding_name = module_name(self.model, self._embedding)
        self._norm = getattr(base_model(self.model), "norm")
        self._norm_name = module_name(self.model, self._norm)
        self._head = self.model.get_output_embeddings()
        self._head_name = module_name(self.model, self._head)
        self.prefetcher: LayerPrefetcher | None = None
        if prefetch:
            pin = is_cuda(self.device)
            self.prefetcher = LayerPrefetcher(reader, self._layer_disk_names, pin=pin, slabs=self.slab_ring(pin=True) if pin else None)

    @classmethod
    def from_checkpoint(cls, ckpt: Checkpoint, *, device: torch.device | str | None = None, prefetch: bool = True) -> StreamedModel:
        if ckpt.config is None:
            raise ConfigError("checkpoint has no config.json", file=ckpt.display)
        return cls(ckpt.config, CheckpointTensors(ckpt), device=device, prefetch=prefetch)

    def _layer_disk_names(self, index: int) -> list[str]:
        return disk_names(self.layers[index], self.layer_prefix(index), self.plan)

    def slab_ring(self, pin: bool) -> SlabRing | None:
        """Two slabs (page-locked with ``pin``) of the largest layer's read-ahead bytes
        (model/host_memory.py), where the reader can size them (else None: torch's page-locked
        blocks, as before)."""
        host_nbytes = getattr(self.reader, "host_nbytes", None)
        if host_nbytes is None or not self.num_layers:
            return None
        largest = max(sum(aligned(n) for n in host_nbytes(self._layer_disk_names(i))) for i in range(self.num_layers))
        return SlabRing(largest, pin=pin)

    def close(self) -> None:
        """Stop the background reader and free its host memory (idempotent), torch's cached
        page-locked blocks included: the next step does not inherit them."""
        if self.prefetcher is not None:
            self.prefetcher.close()
            self.prefetcher = None
            empty_host_cache()

    def __enter__(self) -> StreamedModel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def head_name(self) -> str:
        return self._head_name

    def layer_prefix(self, index: int) -> str:
        return f"{self.layers_prefix}.{index}"

    @contextlib.contextmanager
    def _materialized(self, module: nn.Module, prefix: str, tensors: dict[str, torch.Tensor] | None = None,
                      layer: int | None = None) -> Iterator[nn.Module]:
        materialize(module, prefix, self.plan, self.reader, self.device, tensors)
        if layer is not None and self.prefetcher is not None:
            self.prefetcher.copied(layer)  # its read-ahead slab may be refilled once these copies finish
        try:
            yield module
        finally:
            release(module)

    @contextlib.contextmanager
    def embedding(self) -> Iterator[None]:
        """Materialise the embedding table for the prologue(s) inside the block (layer 0 is
        read ahead meanwhile)."""
        if self.prefetcher is not None and self.num_layers:
            self.prefetcher.request(0)
        with self._materialized(self._embedding, self._embedding_name):
            yield

    def prologue(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, list[LayerCall]]:
        return run_prologue(self.model, input_ids.to(self.device))

    def layer(self, index: int) -> contextlib.AbstractContextManager[nn.Module]:
        """Decoder layer ``index`` on the device inside the block; the next one is read ahead."""
        tensors = None
        if self.prefetcher is not None:
            tensors = self.prefetcher.take(index)
            if index + 1 < self.num_layers:
                self.prefetcher.request(index + 1)
        return self._materialized(self.layers[index], self.layer_prefix(index), tensors, layer=index)

    def final_norm(self) -> contextlib.AbstractContextManager[nn.Module]:
        return self._materialized(self._norm, self._norm_name)

    def lm_head(self) -> contextlib.AbstractContextManager[nn.Module]:
        return self._materialized(self._head, self._head_name)


def call_layer(layer: nn.Module, hidden: torch.Tensor, call: LayerCall) -> torch.Tensor:
    out = layer(hidden, *call.args, **call.kwargs)
    return out[0] if isinstance(out, tuple) else out


def check_bf16_source(ckpt: Checkpoint) -> None:
    """A BF16 checkpoint with its config: what calibration and GPTQ run on."""
    from fp4forge.checkpoint.declarations import detect_format

    if ckpt.config is None:
        raise ConfigError("checkpoint has no config.json", file=ckpt.display)
    if detect_format(ckpt.config, ckpt.extra_json) is not None:
        raise ConfigError("calibrate the BF16 source checkpoint, not a quantized one", file=ckpt.display)


# -- the layer loop every layer-streamed job runs ---------------------------------------------------
LayerCalls = dict[tuple[int, ...], list[LayerCall]]  # per batch shape, how each layer is called


def embed_batches(streamed: StreamedModel, batches: list[torch.Tensor], space: SpillSpace, name: str = "in") -> tuple[ActivationStore, LayerCalls]:
    """Layer 0's inputs for every batch, and how each layer is called per batch shape."""
    store = ActivationStore(space, name)
    calls: LayerCalls = {}
    with streamed.embedding():
        for number, ids in enumerate(batches):
            hidden, layer_calls = streamed.prologue(ids)
            calls.setdefault(tuple(ids.shape), layer_calls)  # unpadded: the same for every batch of a shape
            store.put(number, hidden)
    return store, calls


def layer_call(calls: LayerCalls, ids: torch.Tensor, index: int) -> LayerCall:
    """How layer ``index`` is called for the batch ``ids``."""
    return calls[tuple(ids.shape)][index]


def run_layer(layer: nn.Module, index: int, store: ActivationStore, batches: list[torch.Tensor], calls: LayerCalls,
              out: ActivationStore | None, *, drop_inputs: bool = True) -> ActivationStore | None:
    """Every batch through ``layer``: its outputs into ``out`` (None: run for the hooks only), its
    inputs dropped from ``store`` as they are used unless ``drop_inputs`` is off."""
    for number, ids in enumerate(batches):
        hidden = call_layer(layer, store.get(number), layer_call(calls, ids, index))
        if out is not None:
            out.put(number, hidden)
        if drop_inputs:
            store.drop(number)
    return out
