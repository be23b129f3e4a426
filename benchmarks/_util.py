"""Shared benchmark plumbing: run a command, measure wall time and the child's peak RSS."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "benchmarks" / "out"


@dataclass
class RunStats:
    wall_s: float
    peak_rss_mib: float
    returncode: int
    stdout: bytes
    cpu_s: float = 0.0  # user + system time of the child
    stderr: bytes = b""


# Runs the command as its own child and reports that child's wall time, peak RSS and CPU time.
# Why a separate small process: on Linux a child's ru_maxrss starts from the RSS of the process that
# forked it (the high-water mark of the old address space is carried over at exec), so measured
# straight from a benchmark that holds hundreds of MiB, every command "peaked" at least that high.
_SPAWNER = """
import json, os, subprocess, sys, time
start = time.perf_counter()
proc = subprocess.Popen(sys.argv[2:])
_, status, usage = os.wait4(proc.pid, 0)
wall = time.perf_counter() - start
with open(sys.argv[1], "w") as f:
    json.dump({"wall_s": wall, "maxrss_kib": usage.ru_maxrss, "cpu_s": usage.ru_utime + usage.ru_stime,
               "returncode": os.waitstatus_to_exitcode(status)}, f)
"""


def run_measured(cmd: list[str], env: dict[str, str] | None = None) -> RunStats:
    """Wall time, peak RSS and CPU time (ru_maxrss, ru_utime + ru_stime) of ``cmd`` alone, measured
    by a small spawner process around it (see _SPAWNER). stderr goes to a temporary file, so a
    chatty child cannot block on a full pipe."""
    with tempfile.TemporaryFile() as err, tempfile.NamedTemporaryFile("r", suffix=".json") as report:
        proc = subprocess.Popen([sys.executable, "-c", _SPAWNER, report.name, *cmd], stdout=subprocess.PIPE, stderr=err, env=env)
        stdout = proc.stdout.read()
        proc.wait()
        err.seek(0)
        stderr = err.read()
        if proc.returncode != 0:
            raise RuntimeError(f"the measuring spawner failed ({proc.returncode}): {stderr.decode(errors='replace')[-2000:]}")
        measured = json.load(report)
    return RunStats(measured["wall_s"], measured["maxrss_kib"] / 1024, measured["returncode"], stdout, measured["cpu_s"], stderr)


def summarize(values: list[float]) -> str:
    return f"median {statistics.median(values):.3f} (min {min(values):.3f}, max {max(values):.3f}, n={len(values)})"


def drop_page_cache(path: Path) -> bool:
    """Evict a file from the page cache (posix_fadvise DONTNEED); True if it worked."""
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        return True
    except OSError:
        return False


@dataclass
class SampledRun:
    """A child's wall time, exit code and memory: its peak RSS as the kernel counts it (VmHWM),
    and the peaks of the two parts of RSS sampled every ``interval_s``: anonymous memory (what
    the process allocated) and file-backed pages (mapped files: page cache counted in RSS while
    mapped, dropped by the kernel under pressure). Reads the child's /proc (Linux)."""

    wall_s: float
    returncode: int
    peak_rss_mib: float
    peak_anon_mib: float
    peak_file_mib: float
    stdout: bytes
    stderr: bytes
    cpu_s: float = 0.0  # user + system time of the child (what a busy machine does not inflate)
    samples: list[tuple[float, float, float]] | None = None  # (seconds since start, anon MiB, file MiB)


def _proc_status_kib(pid: int) -> dict[str, int]:
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as status:
            return {k: int(v.split()[0]) for k, _, v in (line.partition(":") for line in status) if k in ("VmHWM", "RssAnon", "RssFile")}
    except (OSError, ValueError):
        return {}


def run_sampled(cmd: list[str], env: dict[str, str] | None = None, interval_s: float = 0.02) -> SampledRun:
    """Run ``cmd`` and sample its memory until it exits (see :class:`SampledRun`)."""
    import time

    peaks = {"VmHWM": 0, "RssAnon": 0, "RssFile": 0}
    samples: list[tuple[float, float, float]] = []
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=env)
        while True:
            status_kib = _proc_status_kib(proc.pid)
            for key, value in status_kib.items():
                peaks[key] = max(peaks[key], value)
            if status_kib:
                samples.append((time.perf_counter() - start, status_kib.get("RssAnon", 0) / 1024, status_kib.get("RssFile", 0) / 1024))
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            time.sleep(interval_s)
        wall = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    cpu = usage.ru_utime + usage.ru_stime
    return SampledRun(wall, proc.returncode, peaks["VmHWM"] / 1024, peaks["RssAnon"] / 1024, peaks["RssFile"] / 1024, stdout, stderr, cpu, samples)


def shards(path: Path) -> list[Path]:
    return sorted(path.glob("*.safetensors"))


def evict(path: Path) -> bool:
    """Flush and evict every shard of ``path`` from the page cache (a cold read follows)."""
    os.sync()
    return all(drop_page_cache(p) for p in shards(path))


def read_all(path: Path, block: int = 64 << 20) -> tuple[int, float]:
    """Every shard of ``path`` read sequentially once: (bytes, seconds)."""
    import time

    total, start, buffer = 0, time.perf_counter(), bytearray(block)
    for file in shards(path):
        with open(file, "rb", buffering=0) as f:
            while n := f.readinto(buffer):
                total += n
    return total, time.perf_counter() - start
