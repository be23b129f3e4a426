"""`fp4forge pipeline` (no serving) end to end on every `testbed synth` preset, with nothing but
what synth writes: the presets at `--shrink 16` (docs/testbed.md#synth-shrink) and just enough
layers to hold every kind of layer the preset has (dense and MoE, full and sliding attention).

Oracles: the pipeline's own step states, the audit's error count, and transformers' AutoTokenizer
reading the export's tokenizer with the source's vocabulary.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fp4forge.calibrate.run import CalibrationOptions
from fp4forge.checkpoint.names import CALIBRATION_TEXT_FILE, HELDOUT_TEXT_FILE
from fp4forge.fidelity.evaluate import FidelityOptions
from fp4forge.pipeline import PipelineOptions, run_pipeline
from fp4forge.quantize.job import QuantizeJob
from fp4forge.testbed.synth import PRESETS, synth_checkpoint

CI_SHRINK = 16
# Layer 0 of both Lagunas is dense and layer 1 a sliding-window MoE layer; DeepSeek-V3's first
# three layers are dense; every Qwen3-235B layer is MoE.
LAYERS = {"laguna-s-2.1-like": 2, "laguna-xs.2-like": 2, "deepseek-v3-like": 4, "qwen3-235b-like": 1}


def test_every_preset_has_a_layer_count_here() -> None:
    assert set(LAYERS) == set(PRESETS)


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_pipeline_runs_on_every_preset(preset: str, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    source = synth_checkpoint(preset, LAYERS[preset], tmp_path / "src", shrink=CI_SHRINK)
    # The model's own text, as shipped beside its weights; random weights read no text, so fidelity
    # scores it only when told to (with the unreadable-text warning).
    options = PipelineOptions(
        quantize=QuantizeJob(recipe="nvfp4-experts-fp8-attn"),
        calibration=CalibrationOptions(samples=2, seq_len=64, text_files=(source / CALIBRATION_TEXT_FILE,)),
        fidelity=FidelityOptions(samples=2, seq_len=64, text_files=(source / HELDOUT_TEXT_FILE,), allow_unreadable=True),
    )
    out = tmp_path / "out"
    run_pipeline(source, out, options)
    steps = {s["name"]: s["status"] for s in json.loads((out / "reports" / "pipeline.json").read_text())["steps"]}
    assert [name for name, status in steps.items() if status == "done"] == [
        "calibrate", "quantize", "kv", "audit", "bytes", "fidelity", "serve-cmd", "card"]
    assert json.loads((out / "reports" / "audit.json").read_text())["summary"]["errors"] == 0
    vocab_size = json.loads((source / "config.json").read_text())["vocab_size"]
    assert len(AutoTokenizer.from_pretrained(out)) == vocab_size
