"""Session fixtures for llm-compressor exports of the tiny Laguna (a pytest plugin module:
register it with ``pytest_plugins = ["tests.fixtures_lc"]`` in tests/conftest.py).

The exports run ``scripts/lc_export.py`` with the llm-compressor venv (``FP4FORGE_LC_VENV``,
default ``<repo>/.venv-lc``; made by ``scripts/setup-lc-venv.sh``). Each is produced once per
session, on first use. A venv that is not ready fails the tests that need it; it never skips them,
so CI cannot pass vacuously.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
LC_VENV_ENV_VAR = "FP4FORGE_LC_VENV"
LC_READY_STAMP = ".fp4forge-ready"
LC_EXPORT_SCRIPT = REPO_ROOT / "scripts" / "lc_export.py"
# The on-disk layout, not the accuracy, is under test: 4 x 128 tokens of calibration keeps a
# W4A4 export well under a minute on 2 cores (the script's defaults are 16 x 256).
LC_CALIBRATION_ARGS = ("--samples", "4", "--seq-len", "128")
LC_EXPORT_TIMEOUT_S = 900


def lc_venv_path() -> Path:
    return Path(os.environ.get(LC_VENV_ENV_VAR, REPO_ROOT / ".venv-lc"))


@pytest.fixture(scope="session")
def lc_venv() -> Path:
    """The llm-compressor venv; fails (never skips) when it was not set up."""
    venv = lc_venv_path()
    if not (venv / LC_READY_STAMP).is_file():
        pytest.fail(
            f"llm-compressor venv {venv} is not ready (no {LC_READY_STAMP} stamp). "
            f"Run `make test`, or `scripts/setup-lc-venv.sh {venv}` "
            f"(or point {LC_VENV_ENV_VAR} at a ready venv).",
            pytrace=False,
        )
    return venv


@pytest.fixture(scope="session")
def lc_source_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The BF16 tiny Laguna MoE (16 experts top-4, shared expert) that the exports start from."""
    from fp4forge.testbed import build_tiny_laguna

    return build_tiny_laguna(tmp_path_factory.mktemp("lc") / "tiny-laguna-bf16", seed=0)


def run_lc_export(venv: Path, src: Path, out: Path, scheme: str, *extra: str) -> Path:
    cmd = [str(venv / "bin" / "python"), str(LC_EXPORT_SCRIPT), str(src), str(out), "--scheme", scheme, *extra]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=LC_EXPORT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"llm-compressor export {scheme} {' '.join(extra)} ran past {LC_EXPORT_TIMEOUT_S} s", pytrace=False)
    if proc.returncode != 0 or not (out / "config.json").is_file():
        tail = (proc.stdout + proc.stderr)[-4000:]
        pytest.fail(f"llm-compressor export failed (exit {proc.returncode}): {' '.join(cmd)}\n{tail}", pytrace=False)
    return out


@pytest.fixture(scope="session")
def lc_fp8_dynamic_dir(lc_venv: Path, lc_source_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """llm-compressor FP8_DYNAMIC export (data-free): F8_E4M3 weights, BF16 per-channel scales."""
    return run_lc_export(lc_venv, lc_source_dir, tmp_path_factory.mktemp("lc") / "fp8-dynamic", "FP8_DYNAMIC")


@pytest.fixture(scope="session")
def lc_nvfp4_kv_dir(lc_venv: Path, lc_source_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """llm-compressor NVFP4 W4A4 export with FP8 per-tensor KV-cache scales, compressed-tensors
    layout. One export serves both the W4A4 and the KV-FP8 cases: the calibration pass that W4A4
    needs anyway also fills the KV observers."""
    out = tmp_path_factory.mktemp("lc") / "nvfp4-kvfp8"
    return run_lc_export(lc_venv, lc_source_dir, out, "NVFP4", "--kv-fp8", *LC_CALIBRATION_ARGS)


@pytest.fixture(scope="session")
def modelopt_nvfp4_kv_dir(lc_nvfp4_kv_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """fp4forge's ModelOpt-layout conversion of :func:`lc_nvfp4_kv_dir`."""
    from fp4forge.checkpoint.convert import ct_nvfp4_to_modelopt

    return ct_nvfp4_to_modelopt(lc_nvfp4_kv_dir, tmp_path_factory.mktemp("lc") / "nvfp4-kvfp8-modelopt")
