"""Issue 19, finding 6: progress off a terminal is plain lines (one per step, a heartbeat during a
long one, each step's own counts and clock); on a terminal, each step gets a fresh bar."""

from __future__ import annotations

import io
import time

from fp4forge.cli.common import PlainProgress
from fp4forge.cli.pipeline import StepsView
from fp4forge.pipeline.run import StepEvent


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_heartbeat_has_the_step_own_elapsed_and_counts() -> None:
    clock, out = FakeClock(), io.StringIO()
    plain = PlainProgress("pipeline", stream=out, heartbeat_s=0, clock=clock)
    plain.begin("calibrate")
    clock.now += 75
    plain.update(12, 16, "layer 12")
    assert plain.heartbeat_text() == "calibrate: running 1m15s, 12/16 (75%), layer 12"
    plain.end("calibrate: done")
    clock.now += 5
    plain.begin("serve")
    clock.now += 3
    # nothing carried over from calibrate: no 12/16, no "layer 12", 3 s not 83 s
    assert plain.heartbeat_text() == "serve: running 3s"
    plain.update(0, 0, "starting vLLM (student: x), 3 s: Loading weights took 0.21 seconds")
    assert plain.heartbeat_text() == "serve: running 3s, starting vLLM (student: x), 3 s: Loading weights took 0.21 seconds"
    lines = out.getvalue().splitlines()
    assert lines == ["[pipeline     0s] calibrate: started", "[pipeline  1m15s] calibrate: done", "[pipeline  1m20s] serve: started"]


def test_the_heartbeat_thread_prints_during_a_silent_step() -> None:
    out = io.StringIO()
    with PlainProgress("pipeline", stream=out, heartbeat_s=0.2) as plain:
        plain.begin("serve")
        plain.update(0, 0, "starting vLLM (student: x)")
        time.sleep(0.9)
    beats = [line for line in out.getvalue().splitlines() if "serve: running" in line]
    assert len(beats) >= 2 and all("starting vLLM (student: x)" in line for line in beats)


def test_steps_view_off_a_terminal_prints_a_line_per_step(capsys) -> None:  # type: ignore[no-untyped-def]
    with StepsView(enabled=True, live=False) as view:
        view._plain = PlainProgress("pipeline", heartbeat_s=0).__enter__()
        for event in (StepEvent("calibrate", "skipped", detail="unchanged"), StepEvent("diff", "off", detail="no --sibling given"),
                      StepEvent("serve", "running"), StepEvent("serve", "running", 0, 0, "starting vLLM (student: x)"),
                      StepEvent("serve", "done", detail="findings 3, ready_s 61.2"), StepEvent("perf", "running"),
                      StepEvent("perf", "running", 5, 24, "bench perf c1 p512-o16"), StepEvent("perf", "failed", detail="boom")):
            view.update(event)
    text = capsys.readouterr()
    lines = [line.split("] ", 1)[1] for line in (text.out + text.err).splitlines()]
    assert lines[:3] == ["calibrate: skipped — unchanged", "diff: off — no --sibling given", "serve: running"]
    assert lines[3].startswith("serve: done in ") and lines[3].endswith(" — findings 3, ready_s 61.2")
    assert lines[4] == "perf: running" and lines[5].startswith("perf: failed in ")


def test_steps_view_live_gives_each_step_a_fresh_bar() -> None:
    view = StepsView(enabled=True, live=True)
    view._start()
    try:
        view.update(StepEvent("calibrate", "running", 12, 16, "layer 12"))
        first = view._task
        view.update(StepEvent("calibrate", "done"))
        view.update(StepEvent("serve", "running", 0, 0, "starting vLLM"))
        task = view._bar.tasks[-1]
        assert view._task != first and task.completed == 0 and task.total is None
    finally:
        view.__exit__(None, None, None)
