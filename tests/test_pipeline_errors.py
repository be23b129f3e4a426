"""Errors under `fp4forge pipeline` name what the pipeline's user can change: its own options (as
its own flags on the command line), never the flags of another command (`--text`, `--stats`)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fp4forge.calibrate.run import CalibrationOptions
from fp4forge.errors import ExitCode
from fp4forge.quantize.job import QuantizeJob
from fp4forge.pipeline import PipelineFailed, PipelineOptions, run_pipeline

RECIPE = "nvfp4-experts-fp8-attn"
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z-]*")


def pipeline_flags() -> set[str]:
    proc = subprocess.run([sys.executable, "-m", "fp4forge.cli", "pipeline", "--help"], capture_output=True, text=True, timeout=120,
                          env={"COLUMNS": "300", **__import__("os").environ})
    return set(FLAG.findall(proc.stdout))


@pytest.fixture(scope="module")
def no_chat_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Laguna as a base model: a tokenizer without a chat template, so the built-in
    (chat) calibration corpus cannot be rendered and the calibrate step fails."""
    from fp4forge.testbed import build_tiny_laguna

    model = build_tiny_laguna(tmp_path_factory.mktemp("base") / "tiny-laguna", seed=0)
    (model / "chat_template.jinja").unlink(missing_ok=True)
    config_path = model / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("chat_template", None)
    config_path.write_text(json.dumps(config))
    return model


def test_a_failed_step_names_the_pipeline_option_not_another_commands_flag(no_chat_template: Path, tmp_path: Path) -> None:
    with pytest.raises(PipelineFailed) as failed:
        run_pipeline(no_chat_template, tmp_path / "lib", PipelineOptions(quantize=QuantizeJob(recipe=RECIPE), calibration=CalibrationOptions(samples=2, seq_len=32)))
    assert "chat template" in str(failed.value) and failed.value.option == "calibration.text_files"
    assert not FLAG.search(str(failed.value))

    proc = subprocess.run([sys.executable, "-m", "fp4forge.cli", "pipeline", str(no_chat_template), str(tmp_path / "cli"),
                           "--recipe", RECIPE, "--calib-samples", "2", "--calib-seq-len", "32"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == ExitCode.FINDINGS, proc.stderr
    error_line = next(line for line in proc.stderr.splitlines() if line.startswith("error:"))
    assert "chat template" in error_line
    named = set(FLAG.findall(error_line))
    assert named == {"--calib-text"} and named <= pipeline_flags(), error_line
