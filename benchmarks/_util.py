"""Shared benchmark plumbing: run a command, measure wall time and the child's peak RSS."""

from __future__ import annotations

import os
import statistics
import subprocess
import tempfile
import time
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


def run_measured(cmd: list[str], env: dict[str, str] | None = None) -> RunStats:
    """Wall time, peak RSS and CPU time (ru_maxrss, ru_utime + ru_stime of this one child, via
    wait4). stderr goes to a temporary file, so a chatty child cannot block on a full pipe."""
    with tempfile.TemporaryFile() as err:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, env=env)
        stdout = proc.stdout.read()
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)
        err.seek(0)
        stderr = err.read()
    return RunStats(wall, usage.ru_maxrss / 1024, proc.returncode, stdout, usage.ru_utime + usage.ru_stime, stderr)


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
