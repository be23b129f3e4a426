"""kill -9 at random points of fp4forge's long commands, for the reliability suite.

Shared by tests/test_reliability_kill.py (a few kills per command) and
benchmarks/bench_reliability.py (many). A *chain* starts a command as its own process, SIGKILLs
it after a seeded random delay, checks what is visible at the destination, starts it again (a
resume), kills it again, ... and finally lets it finish; the finished output must be byte for byte
the output of one uninterrupted run (:func:`reference_run`).

What "no partial output visible" means per command (the destination as a user sees it; names
starting with ``.`` are staging and journals, which are allowed):
- ``calibrate --out FILE``, ``quantize SRC OUT``: the destination is absent, or complete and
  identical to the reference;
- ``kv calibrate STATS --into CKPT`` (updates an existing checkpoint): every visible file is
  either its old or its final version, the checkpoint reads strictly, and a KV declaration never
  exists without the scales it declares;
- ``pipeline SRC OUT``: every visible JSON parses and every visible shard is whole (header and
  size agree), the calibration statistics file is absent or final, and every artifact the
  manifest records as done is there with its recorded SHA-256.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tests.reliability_support import Violation

RECIPE = "nvfp4-experts-fp8-attn"
KV_BASE_RECIPE = "nvfp4-experts"  # no KV cache scheme: what `kv calibrate --into` adds scales to
CALIBRATION = ["--samples", "4", "--seq-len", "64", "--batch-size", "2"]
STATS = "stats.safetensors"


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def visible_files(root: Path) -> dict[str, str]:
    """relative path -> SHA-256 of every file under ``root`` whose path has no ``.``-prefixed part."""
    if root.is_file():
        return {root.name: sha256(root)}
    out = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        if path.is_file() and not any(part.startswith(".") for part in rel.parts):
            out[str(rel)] = sha256(path)
    return out


def hidden_entries(root: Path) -> list[str]:
    """Staging litter: ``.``-prefixed names under ``root`` (the pipeline's hash cache excepted)."""
    return sorted(str(p.relative_to(root)) for p in root.rglob(".*") if p.name != ".hashes.json")


@dataclass
class KillTarget:
    """One command under test. ``workdir`` holds everything of one chain."""

    name: str
    argv: Callable[[Path], list[str]]  # fp4forge arguments
    destination: Callable[[Path], Path]
    compared: Callable[[Path], dict[str, str]]  # the final bytes compared with the reference
    prepare: Callable[[Path], None] = lambda workdir: None
    check_visible: Callable[[Path, Reference], None] = lambda workdir, reference: None


@dataclass
class Reference:
    seconds: float
    digests: dict[str, str]
    before: dict[str, str] = field(default_factory=dict)  # kv: the checkpoint before the command
    first_write: float | None = None  # seconds into the run when its first file appeared

    def kill_window(self) -> tuple[float, float]:
        """Where kills are drawn: from a little before the first write (earlier, a kill only ever
        lands in the imports and the computation, which leave nothing behind) to the end."""
        start = 0.3 * self.seconds if self.first_write is None else min(0.9 * self.first_write, 0.9 * self.seconds)
        return start, self.seconds


def _env() -> dict[str, str]:
    src = str(Path(__file__).resolve().parents[1] / "src")
    path = os.pathsep.join(p for p in [src, os.environ.get("PYTHONPATH", "")] if p)
    return {**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def _command(target: KillTarget, workdir: Path) -> list[str]:
    return [sys.executable, "-m", "fp4forge.cli", *target.argv(workdir)]


def reference_run(target: KillTarget, workdir: Path) -> Reference:
    """One uninterrupted run: its duration and the digests every resumed run must reproduce."""
    target.prepare(workdir)
    before = visible_files(target.destination(workdir)) if target.destination(workdir).exists() else {}
    existed = target.destination(workdir).exists()
    started = time.monotonic()
    proc = subprocess.Popen(_command(target, workdir), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=_env())
    first_write = None
    while proc.poll() is None:  # when the first staging file or the destination appears: where writing starts
        if first_write is None and (hidden_entries(workdir) or (not existed and target.destination(workdir).exists())):
            first_write = time.monotonic() - started
        time.sleep(0.02)
    seconds = time.monotonic() - started
    if proc.returncode != 0:
        raise RuntimeError(f"reference {target.name} failed ({proc.returncode}): {proc.stderr.read()[-2000:]}")
    reference = Reference(seconds=seconds, digests=target.compared(workdir), before=before, first_write=first_write)
    # The chains run in this same directory: outputs may name their own path (the card's serve line).
    shutil.rmtree(workdir)
    return reference


def kill_chain(target: KillTarget, reference: Reference, workdir: Path, rng: random.Random, kills: int) -> dict:
    """``kills`` SIGKILLs at seeded random points (uniform over the reference's kill window,
    measured from process start), the destination checked after each; then a run to completion
    whose output must equal the reference's. Returns what happened (for the figures)."""
    target.prepare(workdir)
    record: dict = {"command": target.name, "delays_s": [], "killed": 0, "finished_before_kill": 0, "staging_seen": 0}
    scale, completed = 1.0, False
    while record["killed"] < kills:
        low, high = reference.kill_window()
        delay = rng.uniform(low, high) * scale
        record["delays_s"].append(round(delay, 2))
        proc = subprocess.Popen(_command(target, workdir), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=_env(), start_new_session=True)
        try:
            _, stderr = proc.communicate(timeout=delay)
            if proc.returncode != 0:
                raise Violation(f"{target.name}: a resumed run failed (exit {proc.returncode}): {stderr[-1500:]!r}")
            record["finished_before_kill"] += 1
            if record["killed"]:
                completed = True
                break  # a resumed run finished: nothing left to interrupt in this chain
            shutil.rmtree(workdir)  # finished before the first kill: start over, with earlier points
            target.prepare(workdir)
            scale *= 0.7
            continue
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            record["killed"] += 1
        if hidden_entries(workdir):
            record["staging_seen"] += 1
        try:
            target.check_visible(workdir, reference)
        except Violation as exc:
            raise Violation(f"{target.name}, after a SIGKILL {delay:.1f} s in: {exc}") from None
        if target.destination(workdir).exists() and target.compared(workdir) == reference.digests:
            record["killed_after_output"] = record.get("killed_after_output", 0) + 1
            completed = True  # killed after its output was in place (while exiting): nothing left to redo
            break
    if completed:  # the last run finished before its kill: its output is the one to compare
        done = subprocess.CompletedProcess([], 0, "", "")
    else:
        done = subprocess.run(_command(target, workdir), capture_output=True, text=True, env=_env(), timeout=1800)
    if done.returncode != 0:
        raise Violation(f"{target.name}: the run after {record['killed']} kills failed (exit {done.returncode}): {done.stderr[-1500:]}")
    final = target.compared(workdir)
    if final != reference.digests:
        differing = sorted(k for k in set(final) | set(reference.digests) if final.get(k) != reference.digests.get(k))
        raise Violation(f"{target.name}: after {record['killed']} kills the output differs from an uninterrupted run in {differing}")
    record["litter"] = hidden_entries(workdir)
    return record


# -- the four commands --------------------------------------------------------------------------
def _absent_or_final(path: Path, reference: Reference) -> None:
    if path.exists() and visible_files(path) != reference.digests:
        raise Violation(f"{path.name} is visible but not the complete final output")


def calibrate_target(src: Path) -> KillTarget:
    return KillTarget(
        name="calibrate",
        argv=lambda w: ["calibrate", str(src), "--out", str(w / STATS), *CALIBRATION, "--json"],
        destination=lambda w: w / STATS,
        compared=lambda w: visible_files(w / STATS),
        check_visible=lambda w, ref: _absent_or_final(w / STATS, ref),
    )


def quantize_target(src: Path) -> KillTarget:
    return KillTarget(
        name="quantize",
        argv=lambda w: ["quantize", str(src), str(w / "out"), "--recipe", RECIPE, "--act-scales", "constant:8", "--json"],
        destination=lambda w: w / "out",
        compared=lambda w: visible_files(w / "out"),
        check_visible=lambda w, ref: _absent_or_final(w / "out", ref),
    )


def _check_kv_install(workdir: Path, reference: Reference) -> None:
    from fp4forge.checkpoint.reader import open_checkpoint
    from fp4forge.errors import Fp4forgeError

    ckpt_dir = workdir / "ckpt"
    now = visible_files(ckpt_dir)
    for rel, digest in now.items():
        if digest not in (reference.before.get(rel), reference.digests.get(rel)):
            raise Violation(f"{rel} is neither its old nor its final version")
    for rel in reference.before:
        if rel not in now:
            raise Violation(f"{rel} disappeared")
    try:
        ckpt = open_checkpoint(ckpt_dir)
    except Fp4forgeError as exc:
        raise Violation(f"the checkpoint does not read: {exc}") from None
    declared = isinstance(ckpt.config, dict) and (ckpt.config.get("quantization_config") or {}).get("kv_cache_scheme") is not None
    stored = {info.name for _, info in ckpt.tensors() if info.name.endswith(("k_scale", "v_scale"))}
    if declared and not stored:
        raise Violation("config.json declares an FP8 KV cache but no k/v scales are stored (vLLM would run it at scale 1.0)")


def kv_target(stats: Path, quantized: Path) -> KillTarget:
    def prepare(workdir: Path) -> None:
        shutil.copytree(quantized, workdir / "ckpt")

    return KillTarget(
        name="kv calibrate",
        argv=lambda w: ["kv", "calibrate", str(stats), "--into", str(w / "ckpt"), "--json"],
        destination=lambda w: w / "ckpt",
        compared=lambda w: visible_files(w / "ckpt"),
        prepare=prepare,
        check_visible=_check_kv_install,
    )


PIPELINE_OPTIONS = ["--recipe", RECIPE, "--calib-samples", "4", "--calib-seq-len", "64", "--fidelity-samples", "2", "--fidelity-seq-len", "64",
                    "--fidelity-builtin", "--fidelity-allow-unreadable"]


# The card's steps table: "| calibrate | done | 25.8 |  |" (the last cell, "why not run", is empty
# for a step that ran or was skipped). Wall seconds differ between any two runs, and a resumed run
# reports the steps an earlier run finished as skipped.
_CARD_STEP_ROW = re.compile(r"^\| ([\w-]+) \| (done|skipped) \| [0-9.]+ \|((?: [^|]*\|)?)$", re.MULTILINE)


def card_digest(path: Path) -> str:
    """SHA-256 of the card with its steps table's status and seconds normalised (every other byte counts)."""
    return hashlib.sha256(_CARD_STEP_ROW.sub(r"| \1 | ran | - |\3", path.read_text()).encode()).hexdigest()


def _pipeline_compared(workdir: Path) -> dict[str, str]:
    """The exported checkpoint (every file at OUT's top level, the card by :func:`card_digest`) and
    the calibration statistics."""
    out = workdir / "out"
    files = {k: v for k, v in visible_files(out).items() if "/" not in k}
    if "README.md" in files:
        files["README.md"] = card_digest(out / "README.md")
    stats = out / "reports" / "calibration-stats.safetensors"
    if stats.is_file():
        files["reports/calibration-stats.safetensors"] = sha256(stats)
    return files


def _check_pipeline(workdir: Path, reference: Reference) -> None:
    from fp4forge.checkpoint.safetensors_format import (
        LENGTH_PREFIX_BYTES,
        header_length,
        parse_header,
    )
    from fp4forge.checkpoint.source import check_file_size
    from fp4forge.errors import Fp4forgeError

    out = workdir / "out"
    if not out.exists():
        return
    for rel in visible_files(out):
        path = out / rel
        if rel.endswith(".json"):
            try:
                json.loads(path.read_text())
            except ValueError as exc:
                raise Violation(f"{rel} is not whole JSON: {exc}") from None
        elif rel.endswith(".safetensors"):
            data = path.read_bytes()
            try:
                length = header_length(data[:1024], source=rel, file_size=len(data))
                check_file_size(parse_header(data[LENGTH_PREFIX_BYTES : LENGTH_PREFIX_BYTES + length], source=rel), len(data))
            except Fp4forgeError as exc:
                raise Violation(f"{rel} is not a whole shard: {exc}") from None
    stats = out / "reports" / "calibration-stats.safetensors"
    if stats.exists() and sha256(stats) != reference.digests["reports/calibration-stats.safetensors"]:
        raise Violation("the calibration statistics are visible but not final")
    manifest = out / "reports" / "pipeline.json"
    if manifest.exists():
        for step in json.loads(manifest.read_text()).get("steps", []):
            if step.get("status") != "done":
                continue
            for rel, digest in (step.get("artifacts") or {}).items():
                path = out / rel
                if rel == "." or not path.is_file():  # "." is a tree hash of OUT, which later steps extend
                    if rel != "." and not path.exists():
                        raise Violation(f"the manifest records {step['name']} done but its artifact {rel} is missing")
                    continue
                if sha256(path) != digest:
                    raise Violation(f"the manifest records {step['name']} done but {rel} does not have its recorded SHA-256")


def pipeline_target(src: Path) -> KillTarget:
    return KillTarget(
        name="pipeline",
        argv=lambda w: ["pipeline", str(src), str(w / "out"), *PIPELINE_OPTIONS, "--json"],
        destination=lambda w: w / "out",
        compared=_pipeline_compared,
        check_visible=_check_pipeline,
    )


# -- a bench whose server dies -------------------------------------------------------------------
FAKE_SERVER_SCRIPT = Path(__file__).with_name("test_bench_client.py")


def _complete_lines(path: Path) -> list[str]:
    """Complete lines only (a line being written has no newline yet)."""
    if not path.is_file():
        return []
    text = path.read_text()
    return text.splitlines()[: text.count("\n")]


def bench_kill_case(rng: random.Random, workdir: Path) -> dict:
    """``fp4forge bench perf`` against the fake OpenAI server (tests/test_bench_client.py --serve),
    the server SIGKILLed after a random number of finished samples. The bench must exit 3 with no
    traceback, say how many requests it finished and kept, keep every sample line written before
    the kill unchanged, leave only whole lines, and summarise the run as aborted."""
    from fp4forge.serve import pick_free_port

    kill_after = rng.randint(1, 40)
    port = pick_free_port()
    server = subprocess.Popen([sys.executable, str(FAKE_SERVER_SCRIPT), "--serve", "--port", str(port), "--ttft", "0.01", "--token-gap", "0.005"],
                              stdout=subprocess.PIPE, text=True, env=_env())
    out = workdir / "bench"
    try:
        if not server.stdout.readline().startswith("READY"):
            raise RuntimeError("the fake server did not start")
        bench = subprocess.Popen(
            [sys.executable, "-m", "fp4forge.cli", "bench", "perf", "--url", f"http://127.0.0.1:{port}", "--model", "normal",
             "--out", str(out), "--prompt-tokens", "16,32", "--output-tokens", "8", "--warmups", "0", "--samples", "500", "--no-plots"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**_env(), "COLUMNS": "200"},
        )
        samples_file = out / "samples.jsonl"
        deadline = time.monotonic() + 120
        while len(_complete_lines(samples_file)) < kill_after:
            if bench.poll() is not None:
                raise Violation(f"the bench ended before the kill: {bench.communicate()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"fewer than {kill_after} samples within 120 s")
            time.sleep(0.01)
        os.kill(server.pid, signal.SIGKILL)
        finished_at_kill = _complete_lines(samples_file)
        server.wait(10)
        _, stderr = bench.communicate(timeout=120)
    finally:
        if server.poll() is None:
            os.kill(server.pid, signal.SIGKILL)
            server.wait(10)

    where = f"bench killed after {kill_after} samples"
    if bench.returncode != 3:  # ExitCode.ABORTED
        raise Violation(f"{where}: exit {bench.returncode}, expected 3: {stderr[-800:]!r}")
    if "Traceback" in stderr:
        raise Violation(f"{where}: traceback: {stderr[-800:]}")
    message = " ".join(stderr.split())
    lines = _complete_lines(samples_file)
    if lines[: len(finished_at_kill)] != finished_at_kill:
        raise Violation(f"{where}: samples finished before the kill were lost or changed")
    try:
        samples = [json.loads(line) for line in samples_file.read_text().splitlines()]
    except ValueError as exc:
        raise Violation(f"{where}: samples.jsonl holds a partial line: {exc}") from None
    said = re.search(r"Stopped after (\d+) finished requests \((\d+) kept\)", message)
    if not said or "stopped answering" not in message:
        raise Violation(f"{where}: the message does not say what was kept: {message[-400:]!r}")
    ok = sum(s["ok"] for s in samples)
    if (int(said.group(1)), int(said.group(2))) != (len(samples), ok):
        raise Violation(f"{where}: it says {said.group(0)!r} but the file holds {len(samples)} samples, {ok} ok")
    if ok < kill_after:
        raise Violation(f"{where}: only {ok} ok samples kept")
    summary = json.loads((out / "summary.json").read_text())
    if summary["run"]["status"] != "aborted" or summary["totals"]["kept_ok"] != ok:
        raise Violation(f"{where}: summary.json says status {summary['run']['status']!r}, kept_ok {summary['totals']['kept_ok']} (file: {ok})")
    return {"kill_after": kill_after, "samples": len(samples), "ok": ok}
