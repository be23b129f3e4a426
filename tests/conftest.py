"""Shared pytest fixtures.

vLLM section: the vLLM CPU venv, tiny testbed models built once per session, and one real
``vllm serve`` per model for the whole session. The servers that the collected tests need are
launched together on first use, so their ~1 min start-ups overlap instead of adding up.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

pytest_plugins = ["tests.fixtures_lc"]

from fp4forge.serve import VllmServer, launch_vllm

REPO_ROOT = Path(__file__).resolve().parents[1]

# fp4forge's on-disk caches (the audit's skeleton cache) go to a directory of this test
# session, for the tests and every fp4forge subprocess they start: no state from, or into, the
# home cache.
os.environ["FP4FORGE_CACHE_DIR"] = tempfile.mkdtemp(prefix="fp4forge-test-cache-")


# -- vLLM venv ----------------------------------------------------------------------------------
VLLM_VENV_ENV_VAR = "FP4FORGE_VLLM_VENV"
VLLM_READY_STAMP = ".fp4forge-ready"


def vllm_venv_path() -> Path:
    return Path(os.environ.get(VLLM_VENV_ENV_VAR, REPO_ROOT / ".venv-vllm"))


@pytest.fixture(scope="session")
def vllm_venv() -> Path:
    """The vLLM CPU venv; fails (never skips) when it was not set up, so CI cannot pass vacuously."""
    venv = vllm_venv_path()
    if not (venv / VLLM_READY_STAMP).is_file():
        pytest.fail(
            f"vLLM venv {venv} is not ready (no {VLLM_READY_STAMP} stamp). "
            f"Run `make test`, or `scripts/setup-vllm-venv.sh {venv}` "
            f"(or point {VLLM_VENV_ENV_VAR} at a ready venv).",
            pytrace=False,
        )
    return venv


# -- tiny testbed models ------------------------------------------------------------------------
@pytest.fixture(scope="session")
def tiny_laguna_dense_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny random Laguna with dense MLPs only: stock vLLM CPU serves it (its MoE router cannot)."""
    from fp4forge.testbed import build_tiny_laguna

    return build_tiny_laguna(tmp_path_factory.mktemp("models") / "tiny-laguna-dense", seed=0, dense=True)


@pytest.fixture(scope="session")
def tiny_qwen3_moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny random Qwen3-MoE: a softmax-routed MoE that stock vLLM CPU serves."""
    from fp4forge.testbed import build_tiny_qwen3_moe

    return build_tiny_qwen3_moe(tmp_path_factory.mktemp("models") / "tiny-qwen3-moe", seed=0)


# -- vLLM servers -------------------------------------------------------------------------------
# fp32 so that greedy tokens equal transformers' exactly; bf16 has near-ties on random weights.
# --enforce-eager skips torch.compile: ~1 min start instead of ~2.5 min.
VLLM_COMMON_ARGS = ["--enforce-eager", "--max-model-len", "2048", "--dtype", "float32", "--max-logprobs", "20"]
POOLSIDE_PARSER_ARGS = [
    "--enable-auto-tool-choice",
    "--tool-call-parser",
    "poolside_v1",
    "--reasoning-parser",
    "poolside_v1",
]
VLLM_TEST_ENV = {"HF_HUB_OFFLINE": "1"}  # local dirs only; the hub is unreachable from CI anyway
VLLM_READY_TIMEOUT_S = 420.0


@dataclass(frozen=True)
class VllmServerSpec:
    model_fixture: str
    served_model_name: str
    extra_args: tuple[str, ...]


# Keyed by the server fixture's name, so the pool can tell which servers the collected tests use.
VLLM_SERVER_SPECS: dict[str, VllmServerSpec] = {
    "vllm_laguna_dense": VllmServerSpec(
        "tiny_laguna_dense_dir", "tiny-laguna-dense", (*VLLM_COMMON_ARGS, *POOLSIDE_PARSER_ARGS)
    ),
    "vllm_qwen3_moe": VllmServerSpec("tiny_qwen3_moe_dir", "tiny-qwen3-moe", tuple(VLLM_COMMON_ARGS)),
}


class VllmServerPool:
    """Launches servers without waiting, hands each out once it is ready, stops them all at the end."""

    def __init__(self, venv: Path, log_dir: Path) -> None:
        self.venv = venv
        self.log_dir = log_dir
        self.servers: dict[str, VllmServer] = {}

    def launch(self, name: str, model_dir: Path) -> None:
        if name in self.servers:
            return
        spec = VLLM_SERVER_SPECS[name]
        self.servers[name] = launch_vllm(
            model_dir,
            venv=self.venv,
            served_model_name=spec.served_model_name,
            log_path=self.log_dir / f"{name}.log",
            extra_args=list(spec.extra_args),
            env=VLLM_TEST_ENV,
        )

    def ready(self, name: str) -> VllmServer:
        server = self.servers[name]
        server.wait_ready(VLLM_READY_TIMEOUT_S)
        return server

    def stop_all(self) -> None:
        for server in self.servers.values():
            server.stop()


def vllm_servers_used_by(session: pytest.Session) -> list[str]:
    """Server fixtures the collected tests request, directly or as a parametrize value."""
    used: set[str] = set()
    for item in session.items:
        used.update(getattr(item, "fixturenames", ()))
        callspec = getattr(item, "callspec", None)
        if callspec is not None:
            used.update(value for value in callspec.params.values() if isinstance(value, str))
    return [name for name in VLLM_SERVER_SPECS if name in used]


@pytest.fixture(scope="session")
def vllm_server_pool(
    request: pytest.FixtureRequest, vllm_venv: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[VllmServerPool]:
    pool = VllmServerPool(vllm_venv, tmp_path_factory.mktemp("vllm-logs"))
    try:
        for name in vllm_servers_used_by(request.session):
            pool.launch(name, request.getfixturevalue(VLLM_SERVER_SPECS[name].model_fixture))
        yield pool
    finally:
        pool.stop_all()


def vllm_server_from_pool(request: pytest.FixtureRequest, pool: VllmServerPool, name: str) -> VllmServer:
    # A test that asks for a server via getfixturevalue is not in the collected set; launch it now.
    pool.launch(name, request.getfixturevalue(VLLM_SERVER_SPECS[name].model_fixture))
    return pool.ready(name)


@pytest.fixture(scope="session")
def vllm_laguna_dense(request: pytest.FixtureRequest, vllm_server_pool: VllmServerPool) -> VllmServer:
    """Dense tiny Laguna behind vLLM with the poolside_v1 tool-call and reasoning parsers (fp32)."""
    return vllm_server_from_pool(request, vllm_server_pool, "vllm_laguna_dense")


@pytest.fixture(scope="session")
def vllm_qwen3_moe(request: pytest.FixtureRequest, vllm_server_pool: VllmServerPool) -> VllmServer:
    """Tiny Qwen3-MoE behind stock vLLM (fp32)."""
    return vllm_server_from_pool(request, vllm_server_pool, "vllm_qwen3_moe")
