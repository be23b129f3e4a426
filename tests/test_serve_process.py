"""`fp4forge serve up` / `serve down`: a recorded server that outlives the call, stopped by PID."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import httpx
import pytest
import typer
from typer.testing import CliRunner

import fp4forge
from fp4forge.cli import serve as cli_serve
from fp4forge.errors import ServeError
from fp4forge.serve.process import ServeRecord, read_records, serve_down, serve_up, write_record

SMALL = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}
NVFP4_ATTENTION_RECIPE = """name = "nvfp4-attention"
description = "attention q/k/v/o NVFP4 W4A4 (the dense testbed has no experts)"
[[rules]]
components = ["attention"]
scheme = "nvfp4"
ignore = ['re:.*\\.self_attn\\.g_proj$']
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"


def test_down_never_signals_a_pid_that_is_not_our_server(tmp_path: Path) -> None:
    """PIDs get reused: a stale record pointing at another process only loses its file."""
    record = ServeRecord("stale", os.getpid(), 1, "m", "log", ["vllm", "serve"], time.time())
    write_record(tmp_path, record)
    assert [r.name for r in serve_down(["stale"], directory=tmp_path)] == ["stale"]
    assert read_records(tmp_path) == []
    assert _alive(os.getpid())
    with pytest.raises(ServeError, match="no recorded server named nope"):
        serve_down(["nope"], directory=tmp_path)


def test_stop_group_stops_every_member_and_the_leader_keeps_its_exit_code() -> None:
    """The one stop of a server's process group (``serve up`` / ``down`` and the launcher): a shell
    leader with a child in its group; both end, and the leader, reaped through its Popen, reports
    the SIGTERM."""
    import signal
    import subprocess

    from fp4forge.serve.launcher import _live_group_members, stop_group

    proc = subprocess.Popen(["sh", "-c", "sleep 60 & sleep 60"], start_new_session=True)
    deadline = time.monotonic() + 10
    while len(_live_group_members(proc.pid)) < 3 and time.monotonic() < deadline:  # sh and both sleeps
        time.sleep(0.05)
    assert len(_live_group_members(proc.pid)) == 3
    stop_group(proc.pid, timeout=10, reap=proc.poll)
    assert _live_group_members(proc.pid) == []
    assert proc.wait(timeout=5) == -signal.SIGTERM


def test_a_zombie_is_not_a_live_member_of_its_group() -> None:
    """An exited leader nobody has waited for yet (a zombie) leaves the group with nothing to stop."""
    import signal
    import subprocess

    from fp4forge.serve.launcher import _live_group_members, stop_group

    proc = subprocess.Popen(["sleep", "60"], start_new_session=True)
    os.kill(proc.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while _alive(proc.pid) and time.monotonic() < deadline:  # not reaped: it stays a zombie
        time.sleep(0.05)
    assert Path(f"/proc/{proc.pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
    assert _live_group_members(proc.pid) == []
    waited: list[int] = []
    stop_group(proc.pid, reap=lambda: waited.append(1))  # nothing live: nothing signalled, nothing waited for
    assert waited == []
    assert proc.wait(timeout=5) == -signal.SIGKILL


def test_cli_down_needs_a_name(tmp_path: Path) -> None:
    app = typer.Typer()

    @app.callback()
    def main() -> None:
        """fp4forge (test harness)"""

    cli_serve.register(app)
    result = CliRunner().invoke(app, ["serve", "down", "--state-dir", str(tmp_path)])
    assert result.exit_code == 2
    result = CliRunner().invoke(app, ["serve", "down", "--all", "--state-dir", str(tmp_path), "--json"])
    assert result.exit_code == 0 and json.loads(result.stdout) == {"fp4forge_version": fp4forge.__version__, "stopped": []}


@pytest.mark.slow
def test_up_failure_explains_and_leaves_no_record(vllm_venv: Path, tiny_laguna_dense_dir: Path, tmp_path: Path) -> None:
    """NVFP4 attention with the plugin switched off: vLLM-CPU has no NVFP4 linear kernel."""
    from fp4forge.quantize.act_scales import parse_act_scales
    from fp4forge.quantize.export import QuantizeOptions, quantize_checkpoint
    from fp4forge.quantize.recipe import load_recipe

    recipe = tmp_path / "nvfp4-attention.toml"
    recipe.write_text(NVFP4_ATTENTION_RECIPE)
    model = tmp_path / "nvfp4-attention"
    options = QuantizeOptions(recipe=load_recipe(str(recipe)), act_amax=parse_act_scales("constant:8", None))
    quantize_checkpoint(tiny_laguna_dense_dir, model, options)
    with pytest.raises(ServeError) as raised:
        serve_up(model, venv=vllm_venv, directory=tmp_path / "state", env={**SMALL, "FP4FORGE_VLLM_PLUGIN": "0"},
                 ready_timeout_s=600)
    message = str(raised.value)
    assert "exited with code" in message
    assert "[no-nvfp4-linear-kernel]" in message and "fp4forge-vllm" in message  # the doctor's error and fix
    assert read_records(tmp_path / "state") == []


@pytest.mark.slow
def test_up_streams_the_doctor_records_and_down_stops(vllm_venv: Path, tiny_laguna_dense_dir: Path, tmp_path: Path) -> None:
    state = tmp_path / "state"
    seen = []
    record, doctor = serve_up(
        tiny_laguna_dense_dir, venv=vllm_venv, name="updown", directory=state, env=SMALL,
        extra_args=["--max-model-len", "2048"], on_finding=seen.append,
    )
    try:
        assert [r.name for r in read_records(state)] == ["updown"]
        models = httpx.get(f"{record.base_url}/v1/models", timeout=30, trust_env=False).json()
        assert models["data"][0]["id"] == "updown"
        ids = {f.id for f in seen}
        assert {"quantization-method", "kv-cache-dtype", "fp4forge-plugin-active"} <= ids
        assert "reasoning-autoinit-failed" not in ids  # serve up passes the fixed parser for Laguna
        assert doctor.vllm_version == "0.32.0"
        assert "--reasoning-parser" in record.command and "poolside_v1_fixed" in record.command
    finally:
        stopped = serve_down(["updown"], directory=state)
    assert [r.pid for r in stopped] == [record.pid]
    assert not _alive(record.pid)
    assert read_records(state) == []


@pytest.mark.slow
def test_ctrl_c_while_waiting_stops_the_server_and_its_record(vllm_venv: Path, tiny_laguna_dense_dir: Path, tmp_path: Path) -> None:
    """`serve up` interrupted before readiness must not orphan a vLLM process group."""
    import signal
    import subprocess
    import sys

    state = tmp_path / "state"
    fp4forge = str(Path(sys.executable).with_name("fp4forge"))
    proc = subprocess.Popen([fp4forge, "serve", "up", str(tiny_laguna_dense_dir), "--name", "cancelled", "--venv", str(vllm_venv),
                             "--state-dir", str(state)], env={**os.environ, **SMALL}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            # a test run started in the background (`cmd &` in a script) ignores SIGINT, and children
                            # inherit that: give the command the default a terminal user has
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 300
    while not read_records(state) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.1)
    (record,) = read_records(state)
    assert _alive(record.pid)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr
    assert read_records(state) == []
    assert not _alive(record.pid)
    with pytest.raises(ProcessLookupError):
        os.killpg(record.pid, 0)  # the whole group is gone, not only its leader


def test_ctrl_c_right_after_the_record_is_written_stops_the_server(tiny_laguna_dense_dir: Path, tmp_path: Path, monkeypatch) -> None:
    """A Ctrl-C that lands between writing the record and waiting for readiness (while the log
    doctor is built) must still stop the server's group and drop its record: a stand-in server
    (`sleep` in its own session) replaces vLLM, and the doctor's constructor raises the interrupt."""
    import subprocess

    from fp4forge.serve import process
    from fp4forge.serve.launcher import VllmServer

    started: list[subprocess.Popen] = []

    def fake_launch(model, *, venv, served_model_name, log_path, port, extra_args, env):
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log_path.write_text("")
        proc = subprocess.Popen(["sleep", "60"], start_new_session=True)
        started.append(proc)
        return VllmServer(proc, 1, served_model_name, Path(model), log_path, ["sleep", "60"], {})

    def interrupted_doctor():
        assert read_records(state), "the record is written before the doctor is built"
        raise KeyboardInterrupt

    state = tmp_path / "state"
    monkeypatch.setattr(process, "launch_vllm", fake_launch)
    monkeypatch.setattr(process, "LogDoctor", interrupted_doctor)
    with pytest.raises(KeyboardInterrupt):
        serve_up(tiny_laguna_dense_dir, venv=tmp_path / "no-venv", name="cancelled", vllm_version="0.32.0", directory=state)
    (proc,) = started
    assert proc.wait(timeout=30) is not None  # stopped, and reaped
    assert read_records(state) == []
