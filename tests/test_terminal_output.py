"""Off a terminal at 80 columns (a CI log, `| tee`), `diff`, `bytes` and `audit` print every tensor
and component name whole, and no colour codes. The names come from each command's own --json
document; the text output is read as the pipe delivers it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_audit_integrity import rebuild

NAME = re.compile(r"model\.[A-Za-z0-9_.]*[A-Za-z0-9_]")
ANSI = "\x1b["
COLOUR = re.compile(r"\x1b\[[0-9;]*?(?:3[0-7]|9[0-7]|38;[25])[;m]")  # an SGR sequence that sets a foreground colour


def run(*args: str, env: dict[str, str] | None = None) -> str:
    env = {**{k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "NO_COLOR")}, "COLUMNS": "80", "LINES": "40", **(env or {})}
    proc = subprocess.run([sys.executable, "-m", "fp4forge.cli", *args], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode in (0, 1), f"{args}: exit {proc.returncode}\n{proc.stderr[-2000:]}"
    return proc.stdout


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> tuple[Path, Path, Path]:
    from fp4forge.quantize.act_scales import ConstantAmax
    from fp4forge.quantize.export import QuantizeOptions, quantize_checkpoint
    from fp4forge.quantize.recipe import load_recipe
    from fp4forge.testbed import build_tiny_laguna

    root = tmp_path_factory.mktemp("terminal")
    source = build_tiny_laguna(root / "src", seed=0)
    quantized = root / "nvfp4"
    quantize_checkpoint(source, quantized, QuantizeOptions(load_recipe("nvfp4-experts-fp8-attn"), act_amax=ConstantAmax(8.0)))

    def drop_input_scales(tensors):  # a W4A4 defect whose findings name long tensor names
        for name in [n for n in tensors if n.endswith("mlp.experts.13.gate_proj.input_global_scale")]:
            del tensors[name]

    broken = rebuild(quantized, root / "broken", drop_input_scales)
    return source, quantized, broken


def _assert_whole(names: set[str], text: str) -> None:
    assert names, "the --json document names nothing to look for"
    cut = sorted(n for n in names if n not in text)
    assert not cut, f"{len(cut)} names not printed whole at 80 columns, e.g. {cut[:3]}\n{text[:3000]}"
    assert ANSI not in text, "colour codes off a terminal"


def test_diff_prints_every_tensor_and_component_whole(checkpoints):
    source, quantized, _ = checkpoints
    doc = json.loads(run("diff", str(source), str(quantized), "--json"))
    text = run("diff", str(source), str(quantized))
    shown = [e for e in doc["tensors"] if e["status"] != "identical"][:40]  # the table lists the first 40
    _assert_whole({e["name"] for e in shown} | set(doc["components"]), text)


def test_bytes_prints_every_component_whole(checkpoints):
    _, quantized, _ = checkpoints
    doc = json.loads(run("bytes", str(quantized), "--json"))
    _assert_whole({c["name"] for c in doc["components"]} | set(doc["dtypes"]), run("bytes", str(quantized)))


def test_audit_prints_every_tensor_it_names_whole(checkpoints):
    _, _, broken = checkpoints
    doc = json.loads(run("audit", str(broken), "--json"))
    named = {n for f in doc["findings"] for n in NAME.findall(f["message"])}
    assert any(n.endswith("experts.13.gate_proj") for n in named), doc["findings"]  # the planted defect
    _assert_whole(named, run("audit", str(broken)))


def test_no_color_is_honoured_even_where_colour_is_forced(checkpoints):
    _, _, broken = checkpoints  # the audit colours its severities
    assert not COLOUR.search(run("audit", str(broken)))
    assert COLOUR.search(run("audit", str(broken), env={"FORCE_COLOR": "1"})), "control: FORCE_COLOR gives colour"
    assert not COLOUR.search(run("audit", str(broken), env={"FORCE_COLOR": "1", "NO_COLOR": "1"}))
