"""What the model card reads: the artifacts, each parsed once, and why one could not be used.

An artifact is *missing* (no file), *corrupt* (present, but not a JSON object) or *stale*: a
pipeline run's manifest (``reports/pipeline.json``) exists and no step that ran in it wrote
the file (left from an earlier run whose step is now off, e.g. ``serve.json`` after a re-run without
``--serve``). The card quotes none of them and names each as what it is. A server's life
(``reports/servers/<role>.json``) is read again from its kept log by today's log doctor, so that what
the card says of it is current.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SERVERS_DIR = "servers/"  # reports/servers/<role>.json and .log: each server's whole life

# Step statuses of reports/pipeline.json whose recorded artifacts belong to the run it records
# (pipeline/state.py; a failed step records what it wrote before it failed: an audit with errors).
RAN_STEPS = ("done", "skipped", "running", "failed")
MANIFEST_JSON = "pipeline.json"
REPORTS_PREFIX = "reports/"  # how the manifest names an artifact under the reports directory


@dataclass
class Artifacts:
    """Reads artifacts on demand and remembers which were asked for and why one could not be used.

    An artifact is *missing* (no file), *corrupt* (a file that is not a JSON object), or *stale*: a
    pipeline run's manifest (``reports/pipeline.json``) exists and no step that ran in it
    wrote the file (left from an earlier run whose step is now off). The card quotes none of them
    and names each as what it is."""

    checkpoint: Path
    reports: Path
    missing: list[str] = field(default_factory=list)  # display names of every artifact not quoted, in order
    problems: dict[str, str] = field(default_factory=dict)  # display name -> why it was not quoted
    reads: list[str] = field(default_factory=list)  # every artifact asked for, in order (a section's links)
    _loaded: dict[str, dict[str, Any] | None] = field(default_factory=dict)  # each file parsed once
    _manifest: dict[str, Any] | None | bool = False  # False: not read yet
    lives: dict[str, dict[str, Any] | None] = field(default_factory=dict)  # server_life's, by role

    def path(self, name: str) -> Path:
        return self.checkpoint / name.removeprefix("ckpt:") if name.startswith("ckpt:") else self.reports / name

    def display(self, name: str) -> str:
        return name.removeprefix("ckpt:") if name.startswith("ckpt:") else f"reports/{name}"

    def json(self, name: str) -> dict[str, Any] | None:
        self.reads.append(name)
        if name not in self._loaded:
            doc, problem = _parse_json(self.path(name))
            problem = problem or (self._stale(name, doc) if doc is not None else None)
            self._loaded[name] = None if problem else doc
            if problem:
                self._record(name, problem)
        return self._loaded[name]

    def _record(self, name: str, problem: str) -> None:
        shown = self.display(name)
        if shown not in self.problems:
            self.missing.append(shown)
            self.problems[shown] = problem

    def json_exists(self, name: str) -> bool:
        """Whether ``name`` was read and parsed (a report the card can quote and link)."""
        return self._loaded.get(name) is not None

    def exists(self, name: str) -> bool:
        """Whether ``name`` is there to be read: on disk and not left from an earlier run (a stale
        file is recorded as such; a corrupt one counts as there, so that reading it names it)."""
        if not self.path(name).exists():
            return False
        if name.startswith("ckpt:") or name == MANIFEST_JSON or name.startswith(SERVERS_DIR):
            return True
        stale = self._stale(name, None)
        if stale:
            self._record(name, stale)
        return stale is None

    def manifest(self) -> dict[str, Any] | None:
        """The pipeline run's manifest, when there is one that parses."""
        if self._manifest is False:
            doc, problem = _parse_json(self.reports / MANIFEST_JSON)
            self._manifest = doc if problem is None and isinstance(doc.get("steps"), list) else None
        return self._manifest  # type: ignore[return-value]

    def steps_that_ran(self) -> dict[str, dict[str, Any]]:
        """The manifest's steps that ran in the run it records (finished, running or failed), by name ({} without a manifest)."""
        manifest = self.manifest() or {}
        return {s.get("name"): s for s in manifest.get("steps", []) if isinstance(s, dict) and s.get("status") in RAN_STEPS}

    def _stale(self, name: str, doc: dict[str, Any] | None) -> str | None:
        """Why a report is not the current run's (None: it is, or there is no manifest to say)."""
        if name.startswith("ckpt:") or name == MANIFEST_JSON or self.manifest() is None:
            return None
        ran = self.steps_that_ran()
        if name.startswith(SERVERS_DIR):  # a server's life belongs to the steps it served
            served = (doc or {}).get("served_steps") or []
            if any(step in ran for step in served):
                return None
            return (f"left from an earlier run: the steps it served ({', '.join(served) or 'none'}) did not run in "
                    f"the current `reports/{MANIFEST_JSON}`")
        rel = REPORTS_PREFIX + name
        for step in ran.values():
            if any(rel == a or rel.startswith(a.rstrip("/") + "/") for a in step.get("artifacts") or {}):
                return None
        return f"left from an earlier run: no step of the current `reports/{MANIFEST_JSON}` wrote it"

    def relative(self, path: Path, card_dir: Path) -> str:
        return Path(os.path.relpath(path, card_dir)).as_posix()


def _parse_json(path: Path) -> tuple[dict[str, Any] | None, str | None]:
    """The JSON object in ``path``, or None and what is wrong: missing, or present but corrupt."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None, "missing"
    except (OSError, UnicodeDecodeError) as error:
        return None, f"present but unreadable ({type(error).__name__}: {error})"
    try:
        doc = json.loads(text)
    except ValueError as error:
        return None, f"present but corrupt (not valid JSON: {error})"
    if not isinstance(doc, dict):
        return None, f"present but corrupt (a JSON {type(doc).__name__}, not an object)"
    return doc, None


def server_life(art: Artifacts, role: str) -> dict[str, Any] | None:
    """``reports/servers/<role>.json`` with its findings and verdict read again from the kept log by
    today's log doctor (``reread``: True), or as recorded when the log is gone; None when the
    record is missing, corrupt or stale."""
    if role not in art.lives:
        art.lives[role] = _read_life(art, role)
    return art.lives[role]


def _read_life(art: Artifacts, role: str) -> dict[str, Any] | None:
    name = f"{SERVERS_DIR}{role}.json"
    life = art.json(name) if art.exists(name) else None
    if life is None:
        return None
    try:
        text = (art.reports / SERVERS_DIR / str(life.get("log"))).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return {**life, "reread": False}
    from fp4forge.errors import Fp4forgeError
    from fp4forge.serve.doctor import diagnose, iter_lines

    lines = list(iter_lines(text))
    try:  # the export's own checkpoint lets the doctor judge its KV scales, as when it ran
        diagnosis = diagnose(lines, checkpoint=str(art.checkpoint)) if role == "student" else None
    except Fp4forgeError:
        diagnosis = None
    diagnosis = diagnosis or diagnose(lines, find_checkpoint=False)
    ready = life.get("ready_line") or 0
    findings = [f.to_json() for f in diagnosis.findings]
    return {**life, "reread": True, "vllm_version": diagnosis.vllm_version or life.get("vllm_version"),
            "verdict": diagnosis.verdict.to_json(), "startup_findings": [f for f in findings if f["line"] <= ready],
            "findings_after_ready": [f for f in findings if f["line"] > ready]}
