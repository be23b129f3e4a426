"""`fp4forge quantize --threads N` and `--no-error-report` through the command line: the shards do
not depend on either, the error report does not depend on the thread count, a bad count is a
named error before any output."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

RECIPE = "nvfp4-all-linear"


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    from fp4forge.testbed import build_tiny_laguna

    return build_tiny_laguna(tmp_path_factory.mktemp("threads") / "tiny-laguna", seed=1)


def quantize(source: Path, out: Path, *flags: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "fp4forge.cli", "quantize", str(source), str(out), "--recipe", RECIPE, "--act-scales", "constant:8", "--json", *flags]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def digests(out: Path, pattern: str) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(out.glob(pattern))}


def test_threads_and_error_report_leave_the_shards_alone(source, tmp_path):
    from fp4forge.checkpoint.names import PROVENANCE_JSON
    from fp4forge.quantize.act_scales import ConstantAmax
    from fp4forge.quantize.export import QuantizeOptions, quantize_checkpoint
    from fp4forge.quantize.recipe import load_recipe

    one, two, quiet = tmp_path / "t1", tmp_path / "t2", tmp_path / "quiet"
    summaries = {
        out: quantize_checkpoint(source, out, QuantizeOptions(load_recipe(RECIPE), act_amax=ConstantAmax(8.0), workers=workers))
        for out, workers in ((one, 1), (two, 2))
    }
    run = quantize(source, quiet, "--threads", "2", "--no-error-report")  # the flags as typed
    assert run.returncode == 0, run.stderr
    shards = digests(one, "*.safetensors")
    assert shards and shards == digests(two, "*.safetensors") == digests(quiet, "*.safetensors")
    # the error report is summed on one thread per unit: the same numbers whatever --threads is
    assert (one / PROVENANCE_JSON).read_bytes() == (two / PROVENANCE_JSON).read_bytes()
    reported = summaries[one].weight_error
    assert reported["by_component"] and all(entry["mean"] > 0 for entry in reported["by_component"].values())
    assert json.loads(run.stdout)["weight_error"] == {}
    provenance = json.loads((quiet / PROVENANCE_JSON).read_text())
    assert provenance["weight_error"] is None and provenance["options"]["error_report"] is False


def test_a_thread_count_below_one_is_refused_before_any_output(source, tmp_path):
    run = quantize(source, tmp_path / "out", "--threads", "0")
    assert run.returncode != 0 and "Traceback" not in run.stderr
    assert "--threads" in run.stderr
    assert not (tmp_path / "out").exists()


def test_the_cpu_reader_reads_ahead_within_its_budget(source, monkeypatch):
    """The reader queues units in plan order until the bytes held (queued, read, computing) reach
    the budget, never further (plus the unit that crosses it), whatever the compute does; the
    coalesced reads give the same tensors as the per-tensor reads."""
    import torch

    from fp4forge.checkpoint.layout import layout_for_config
    from fp4forge.checkpoint.reader import open_checkpoint
    from fp4forge.quantize import export, schedule_cpu, unit as unit_module
    from fp4forge.quantize.act_scales import ConstantAmax
    from fp4forge.quantize.plan import plan_export
    from fp4forge.quantize.recipe import load_recipe

    ckpt = open_checkpoint(source)
    options = export.QuantizeOptions(load_recipe(RECIPE), act_amax=ConstantAmax(8.0), workers=2)
    units = plan_export(export._source_specs(ckpt), layout_for_config(ckpt.config), options.recipe, options.layout_format).units
    sizes = {u.key: sum(ckpt.locate(n)[1].nbytes for n in [*(f"{t.module}.weight" for t in u.linears), *u.passthrough]) for u in units}
    assert len(units) > 8 and any(len(u.linears) > 1 for u in units)
    for unit in units:
        coalesced, plain = schedule_cpu.read_unit_coalesced(unit, ckpt), unit_module.read_unit(unit, ckpt)
        assert coalesced.nbytes == plain.nbytes == sizes[unit.key]
        assert coalesced.passthrough == plain.passthrough
        assert coalesced.weights.keys() == plain.weights.keys()
        assert all(torch.equal(coalesced.weights[m], plain.weights[m]) and coalesced.weights[m].dtype == plain.weights[m].dtype for m in plain.weights)

    queued: list[str] = []
    real = schedule_cpu.unit_nbytes
    monkeypatch.setattr(schedule_cpu, "unit_nbytes", lambda unit, c: queued.append(unit.key) or real(unit, c))
    budget = 4 * max(sizes.values())
    quantizer = export.UnitQuantizer(options)
    for i, (unit, tensors, _, nbytes) in enumerate(schedule_cpu.process_units(units, ckpt, quantizer, 2, export.ExportSchedule(cpu_read_ahead_bytes=budget))):
        assert unit.key == units[i].key and nbytes == sizes[unit.key] and queued == [u.key for u in units[: len(queued)]]
        held = sum(sizes[key] for key in queued[i + 1 :])  # queued, not yet yielded
        assert held < budget + max(sizes.values())
        assert held >= budget or len(queued) == len(units), (i, held, len(queued))


@pytest.mark.parametrize("nice", [5, 0])
def test_the_compute_threads_yield_the_cores_to_the_reader_and_the_writer(source, monkeypatch, nice):
    """With ``ExportSchedule.compute_nice`` set (``FP4FORGE_COMPUTE_NICE``; the benchmark's niced arm) the compute
    threads run that many steps below the process, the reader and the caller (the writer) at the
    process's priority; 0, the default, leaves every thread alone."""
    import os
    import threading

    from fp4forge.checkpoint.layout import layout_for_config
    from fp4forge.checkpoint.reader import open_checkpoint
    from fp4forge.quantize import export, schedule_cpu
    from fp4forge.quantize.act_scales import ConstantAmax
    from fp4forge.quantize.plan import plan_export
    from fp4forge.quantize.recipe import load_recipe

    def priority() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    ckpt = open_checkpoint(source)
    options = export.QuantizeOptions(load_recipe(RECIPE), act_amax=ConstantAmax(8.0), workers=2)
    units = plan_export(export._source_specs(ckpt), layout_for_config(ckpt.config), options.recipe, options.layout_format).units
    seen: dict[str, set[int]] = {"compute": set(), "read": set()}
    real_quantize, real_read = schedule_cpu.quantize_unit, schedule_cpu.read_unit_coalesced
    monkeypatch.setattr(schedule_cpu, "quantize_unit", lambda *a: seen["compute"].add(priority()) or real_quantize(*a))
    monkeypatch.setattr(schedule_cpu, "read_unit_coalesced", lambda *a: seen["read"].add(priority()) or real_read(*a))
    base = priority()
    schedule = export.ExportSchedule(compute_nice=nice)
    results = list(schedule_cpu.process_units(units, ckpt, export.UnitQuantizer(options), 2, schedule))
    assert len(results) == len(units)
    assert seen["compute"] == {min(base + nice, 19)} and seen["read"] == {base} and priority() == base
