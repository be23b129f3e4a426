"""The layer read-ahead's host slabs (model/host_memory.py) on a CPU: here the slabs are plain
memory, not page-locked, but the carving, the sizing from the checkpoint's headers, the ring and
the values handed to the layers are the code a CUDA run uses."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from fp4forge.checkpoint.quantized import QuantizedCheckpoint, StoredWeight
from fp4forge.checkpoint.reader import open_checkpoint
from fp4forge.model.host_memory import ALIGN, HostSlab
from fp4forge.model.streaming import CheckpointTensors, LayerPrefetcher, StreamedModel, call_layer
from fp4forge.quantize.act_scales import ConstantAmax
from fp4forge.quantize.export import QuantizeOptions, quantize_checkpoint
from fp4forge.quantize.recipe import load_recipe
from tests.calibration_fixtures import laguna, one_thread  # noqa: F401 (shared fixtures)


def test_a_slab_carves_aligned_disjoint_tensors_and_counts_what_does_not_fit() -> None:
    slab = HostSlab(1000, pin=False)
    assert slab.capacity == 1024  # 1000 rounded up to ALIGN = 256
    base = slab.buffer.data_ptr()
    a, b = slab.empty((3,), torch.bfloat16), slab.empty((2, 5), torch.float32)
    assert (a.data_ptr(), b.data_ptr(), slab.used) == (base, base + ALIGN, 2 * ALIGN)
    a.fill_(1), b.fill_(2)
    assert a.tolist() == [1, 1, 1] and b.sum().item() == 20  # disjoint
    big = slab.empty((600,), torch.uint8)  # 512 + 600 > 1024: memory of its own
    assert slab.overflow_bytes == 600 and not base <= big.data_ptr() < base + slab.capacity
    slab.reset()
    assert slab.empty((1,), torch.uint8).data_ptr() == base


def test_a_slab_is_refilled_only_after_the_copies_out_of_it() -> None:
    class Event:
        waited = False

        def synchronize(self) -> None:
            Event.waited = True

    slab = HostSlab(256, pin=False)
    slab._copied = Event()
    slab.reset()
    assert Event.waited and slab._copied is None


def _forward(streamed: StreamedModel, ids: torch.Tensor) -> torch.Tensor:
    with streamed.embedding():
        hidden, calls = streamed.prologue(ids)
    for index in range(streamed.num_layers):
        with streamed.layer(index) as layer:
            hidden = call_layer(layer, hidden, calls[index])
    return hidden


def _largest_layer_bytes(path: Path, num_layers: int) -> int:
    """The largest decoder layer's tensor bytes, each rounded up to ALIGN, from safetensors."""
    sizes = [0] * num_layers
    for shard in path.glob("*.safetensors"):
        with safe_open(str(shard), "pt") as f:
            for name in f.keys():
                if name.startswith("model.layers."):
                    t = f.get_slice(name)
                    n = t.get_shape() and int(torch.tensor(t.get_shape()).prod()) or 1
                    nbytes = n * {"BF16": 2, "F32": 4, "F8_E4M3": 1, "U8": 1, "I32": 4}[t.get_dtype()]
                    sizes[int(name.split(".")[2])] += -(-nbytes // ALIGN) * ALIGN
    return max(sizes)


@pytest.mark.parametrize("student", [False, True], ids=["bf16-teacher", "nvfp4-student"])
def test_slab_read_ahead_hands_every_layer_the_values_of_a_plain_read(laguna: Path, tmp_path: Path, student: bool) -> None:
    """Layers read ahead into a ring of two slabs (layer i and i + 2 share one) give the hidden
    states of reads without read-ahead, bit for bit; the slabs are sized to the largest layer
    from the headers, and nothing falls outside them."""
    path = laguna
    if student:
        path = tmp_path / "student"
        quantize_checkpoint(laguna, path, QuantizeOptions(recipe=load_recipe("nvfp4-experts"), act_amax=ConstantAmax(8.0)))
    ckpt = open_checkpoint(path)

    def reader():
        if student:
            return QuantizedCheckpoint(ckpt, "compressed-tensors").dequantized(torch.bfloat16, formula="multiply")
        return CheckpointTensors(ckpt)

    ids = torch.randint(0, ckpt.config["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(0))
    with StreamedModel(ckpt.config, reader(), device="cpu", prefetch=False) as plain:
        reference = _forward(plain, ids)
    with StreamedModel(ckpt.config, reader(), device="cpu", prefetch=False) as streamed:
        ring = streamed.slab_ring(pin=False)
        if student:  # the stored codes and scales, not the decoded weights: less than the teacher's layer
            assert 0 < ring.slabs[0].capacity < _largest_layer_bytes(laguna, streamed.num_layers) / 2
        else:
            assert ring.slabs[0].capacity == _largest_layer_bytes(path, streamed.num_layers)
        streamed.prefetcher = LayerPrefetcher(streamed.reader, streamed._layer_disk_names, pin=True, slabs=ring)
        if student:
            assert any(isinstance(v, StoredWeight) for v in streamed.prefetcher.take(1).values())
        hidden = _forward(streamed, ids)
        assert ring.overflow_bytes == 0 and all(slab.used > 0 for slab in ring.slabs)
    assert torch.equal(hidden, reference)
