"""What the machine was doing while a benchmark ran: the context a speed figure needs.

``host_facts`` records the CPU model, its cores (all and those this process may use), the GPUs
``nvidia-smi`` lists, and the load average; ``server_warnings`` keeps the WARNING lines of the
server's own log (vLLM logs its performance caveats at that level: a slow fallback kernel, an
allocator not preloaded, a CUDA graph skipped), split into those before and during the run.
Each fact that cannot be read is ``None``, never guessed.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

WARNING_LINE = re.compile(r"\bWARNING\b")
KEPT_WARNINGS = 40  # distinct warning messages kept per part of the log
NVIDIA_SMI_TIMEOUT_S = 10.0


def cpu_model() -> str | None:
    """The CPU's model name as /proc/cpuinfo gives it (Linux), else what ``platform`` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace").splitlines():
            if line.split(":")[0].strip() in ("model name", "Model", "cpu model"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def usable_cores() -> int | None:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count()


def load_average() -> list[float] | None:
    """The 1, 5 and 15 minute load averages (None where the system has none)."""
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def gpus() -> list[str] | None:
    """GPU names from ``nvidia-smi`` ([] when it runs and lists none; None without it)."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True,
                              timeout=NVIDIA_SMI_TIMEOUT_S, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return [line.strip() for line in done.stdout.splitlines() if line.strip()] if done.returncode == 0 else None


def host_facts() -> dict[str, Any]:
    """The machine's facts at the start of a run (``load_after`` is added when it ends)."""
    return {
        "cpu_model": cpu_model(),
        "cores_logical": os.cpu_count(),
        "cores_usable": usable_cores(),
        "gpus": gpus(),
        "platform": platform.platform(),
        "load_before": load_average(),
        "load_after": None,
    }


def log_size(log: Path | None) -> int | None:
    """Where the server's log ends now: the run's warnings are those written after it."""
    try:
        return Path(log).stat().st_size if log is not None else None
    except OSError:
        return None


def server_warnings(log: Path | None, run_started_at: int | None) -> dict[str, Any] | None:
    """The server log's WARNING lines, distinct messages, before and during the run."""
    if log is None:
        return None
    try:
        data = Path(log).read_bytes()
    except OSError as error:
        return {"log": str(log), "error": error.strerror or str(error)}
    split = run_started_at if run_started_at is not None and run_started_at <= len(data) else 0
    parts = {"before_run": data[:split], "during_run": data[split:]}
    doc: dict[str, Any] = {"log": str(log)}
    for name, chunk in parts.items():
        lines = [line.strip() for line in chunk.decode("utf-8", errors="replace").splitlines() if WARNING_LINE.search(line)]
        distinct = list(dict.fromkeys(_message(line) for line in lines))
        doc[name] = {"count": len(lines), "distinct": len(distinct), "messages": distinct[:KEPT_WARNINGS]}
    return doc


def _message(line: str) -> str:
    """The message of a vLLM log line, without its process tag, level, timestamp and source place."""
    return re.sub(r"^.*?\bWARNING\b\s+(\d\d-\d\d \d\d:\d\d:\d\d(\.\d+)?\s+)?(\[[^\]]*\]\s+)?", "", line)
