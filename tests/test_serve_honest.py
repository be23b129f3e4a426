"""Issue 19, finding 4: the card's serve command is reproducible and path-free, with the
environment it ran with; each server's whole log is kept and errors after readiness reach the
card. Built from real vLLM CPU logs (tests/fixtures/vllm_logs, first line: the launcher's exact
command) and the real pipeline artifacts of tests/fixtures/card."""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from fp4forge.pipeline.steps import Context, ServerSlot
from fp4forge.report.card import render_card
from fp4forge.serve.launcher import DEFAULT_ENV, portable_command
from fp4forge.serve.process import startup_status

LOGS = Path(__file__).parent / "fixtures" / "vllm_logs"
CARD_FIXTURE = Path(__file__).parent / "fixtures" / "card" / "ckpt"
DIED_AFTER_READY = LOGS / "cpu-stock-laguna-moe-sigmoid-router.log"  # ready at line 109, EngineDeadError after one request
CLEAN = LOGS / "cpu-plugin-ct-w4a4.log"


def launched_command(log: Path) -> list[str]:
    first = log.read_text().splitlines()[0]
    assert first.startswith("$ ")
    return first[2:].split()


def test_portable_command_of_a_real_launch_has_no_machine_paths() -> None:
    command = launched_command(DIED_AFTER_READY)  # /work/main/.venv-vllm/bin/vllm serve /tmp/s6/tiny-laguna --port 34263 ...
    env = {**DEFAULT_ENV, "FP4FORGE_VLLM_NUMERICS": "w4a4"}
    text = portable_command(command, env, served_model_name="tiny-laguna")
    assert "/work/" not in text and "/tmp/" not in text and "34263" not in text and "cpu-stock-laguna" not in text
    assert text.splitlines()[0] == "VLLM_CPU_KVCACHE_SPACE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 FP4FORGE_VLLM_NUMERICS=w4a4 \\"
    assert 'vllm serve "$MODEL"' in text and "--port 8000" in text and "--served-model-name tiny-laguna" in text
    # every other flag of the real launch survives, in order
    joined = " ".join(line.strip(" \\") for line in text.splitlines())
    assert "--enforce-eager --max-model-len 2048 --dtype float32" in joined


def test_startup_status_of_a_real_log() -> None:
    statuses = [s for s in map(startup_status, CLEAN.read_text().splitlines()) if s]
    assert statuses and not any(s.startswith("INFO") or s.startswith("$") for s in statuses)
    assert any("Loading weights took" in s for s in statuses)
    assert all(len(s) <= 120 for s in statuses)


@pytest.fixture()
def ckpt(tmp_path: Path) -> Path:
    out = tmp_path / "tiny-laguna-nvfp4"
    shutil.copytree(CARD_FIXTURE, out)
    return out


def keep_life(ckpt: Path, log: Path, role: str, ready_line: int, steps: list[str]) -> None:
    # the options a server's life reads (PipelineOptions would import torch for its recipe check)
    ctx = Context(ckpt.parent / "tiny-laguna", ckpt, SimpleNamespace(serve_hardware="cpu"))  # type: ignore[arg-type]
    slot = ServerSlot(ctx, ckpt if role == "student" else ctx.src, role)
    slot.ready_line, slot.ready_seconds, slot.steps = ready_line, 61.0, steps
    record = SimpleNamespace(log=str(log), command=launched_command(log), env={"VLLM_CPU_KVCACHE_SPACE": "1"})
    slot._keep_life(record)


def test_errors_after_readiness_reach_the_card(ckpt: Path) -> None:
    keep_life(ckpt, DIED_AFTER_READY, "student", 109, ["serve", "perf"])
    kept = ckpt / "reports" / "servers" / "student.log"
    assert kept.read_text() == DIED_AFTER_READY.read_text()  # the whole log, not cut at readiness
    card = render_card(ckpt).markdown
    serving = card.split("## Serving")[1].split("## Performance")[0]
    assert "**The student server logged" in serving and "after it became ready** (while serving serve, perf)" in serving
    claims = card.split("## What this card does not claim")[1]
    assert "The student server (this checkpoint) logged errors while it served serve, perf" in claims


def test_a_clean_life_and_the_teacher_command(ckpt: Path) -> None:
    ready = next(i for i, line in enumerate(CLEAN.read_text().splitlines(), 1) if "Application startup complete" in line)
    keep_life(ckpt, CLEAN, "student", ready, ["serve"])
    keep_life(ckpt, CLEAN, "teacher", ready, ["quality-teacher"])
    card = render_card(ckpt).markdown
    serving = card.split("## Serving")[1].split("## Performance")[0]
    assert "**The student server logged" not in serving and "**The teacher server logged" not in serving
    assert "The BF16 teacher (tiny-laguna), the unquantized reference arm, was served with:" in serving
    teacher_block = serving.split("The BF16 teacher (tiny-laguna), the unquantized reference arm, was served with:")[1]
    assert 'vllm serve "$MODEL"' in teacher_block and "/tmp/" not in teacher_block and "/work/" not in teacher_block
    assert "`VLLM_CPU_KVCACHE_SPACE=1`" in teacher_block
    assert "Its log doctor's findings at start-up" in teacher_block
