"""Remote mode against a real HTTP server on loopback that honours Range requests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fp4forge.audit.byte_table import compute_byte_table
from fp4forge.checkpoint.layout import layout_by_name
from fp4forge.checkpoint.reader import open_checkpoint
from fp4forge.checkpoint.writer import CheckpointWriter, TensorSpec
from fp4forge.errors import CheckpointError, IndexFileError, LfsPointerError, RemoteError

from tests.http_repo_server import RepoServer

LAGUNA_CONFIG = {"architectures": ["LagunaForCausalLM"], "model_type": "laguna"}


def laguna_like_specs(layers: int = 2, experts: int = 8) -> list[TensorSpec]:
    specs = [TensorSpec("model.embed_tokens.weight", "BF16", (4096, 512)), TensorSpec("lm_head.weight", "BF16", (4096, 512))]
    for layer in range(layers):
        prefix = f"model.layers.{layer}"
        for proj in "qkvo":
            specs.append(TensorSpec(f"{prefix}.self_attn.{proj}_proj.weight", "BF16", (512, 512)))
        for expert in range(experts):
            for proj in ("gate", "up", "down"):
                module = f"{prefix}.mlp.experts.{expert}.{proj}_proj"
                specs += [
                    TensorSpec(f"{module}.weight_packed", "U8", (512, 256)),
                    TensorSpec(f"{module}.weight_scale", "F8_E4M3", (512, 32)),
                    TensorSpec(f"{module}.weight_global_scale", "F32", (1,)),
                ]
        specs.append(TensorSpec(f"{prefix}.mlp.gate.weight", "BF16", (experts, 512)))
    return specs


@pytest.fixture(scope="module")
def repos(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("repos")
    good = root / "good"
    with CheckpointWriter(good, laguna_like_specs(), max_shard_bytes=4 * 2**20, sparse=True) as writer:
        writer.write_json("config.json", LAGUNA_CONFIG)
    pointer = root / "pointer"
    pointer.mkdir()
    (pointer / "config.json").write_text(json.dumps(LAGUNA_CONFIG))
    (pointer / "model.safetensors").write_text(
        "version https://git-lfs.github.com/spec/v1\noid sha256:" + "ab" * 32 + "\nsize 5368709120\n"
    )
    return {"org/good": good, "org/pointer": pointer}


@pytest.fixture(scope="module")
def server(repos):
    with RepoServer(repos) as srv:
        yield srv


def test_remote_headers_equal_local_headers(server, repos):
    remote = open_checkpoint(f"{server.endpoint}/org/good/resolve/main")
    local = open_checkpoint(repos["org/good"])
    assert remote.shard_names == local.shard_names and len(local.shard_names) >= 2
    for shard in local.shard_names:
        assert remote.headers[shard].tensors == local.headers[shard].tensors
    assert remote.index.weight_map == local.index.weight_map
    assert remote.config == LAGUNA_CONFIG
    layout = layout_by_name("laguna")
    assert compute_byte_table(remote, layout).to_json()["components"] == compute_byte_table(local, layout).to_json()["components"]


def test_remote_reads_headers_only(server, repos):
    server.requests.clear()
    remote = open_checkpoint(f"{server.endpoint}/org/good/resolve/main")
    total = sum(p.stat().st_size for p in repos["org/good"].glob("*.safetensors"))
    assert remote.source.bytes_fetched < 0.05 * total
    shard_gets = [r for r in server.requests if r[1].endswith(".safetensors")]
    assert shard_gets and all(r[2] and r[2].startswith("bytes=") for r in shard_gets)


def test_repo_id_resolves_through_hf_endpoint_in_cli(server, repos):
    env = {**os.environ, "HF_ENDPOINT": server.endpoint, "HF_HUB_OFFLINE": "0"}
    proc = subprocess.run([sys.executable, "-m", "fp4forge.cli", "bytes", "org/good", "--json"], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    remote = json.loads(proc.stdout)
    local = compute_byte_table(open_checkpoint(repos["org/good"]), layout_by_name("laguna")).to_json()
    assert remote["components"] == local["components"] and remote["total"] == local["total"]


def test_raw_url_returns_lfs_pointer_and_is_named(server):
    with pytest.raises(IndexFileError, match="git-LFS pointer"):
        open_checkpoint(f"{server.endpoint}/org/good/raw/main")


def test_lfs_pointer_in_place_of_a_shard_is_recognised(server):
    with pytest.raises(LfsPointerError, match="5368709120"):
        open_checkpoint(f"{server.endpoint}/org/pointer/resolve/main")


def test_missing_repo_and_dead_server_give_named_errors(server):
    with pytest.raises(CheckpointError):
        open_checkpoint(f"{server.endpoint}/org/absent/resolve/main")
    port = server.port
    dead = f"http://127.0.0.1:{port + 1 if port < 65000 else port - 1}/org/good/resolve/main"
    with pytest.raises(RemoteError, match="request failed"):
        open_checkpoint(dead)
    proc = subprocess.run([sys.executable, "-m", "fp4forge.cli", "bytes", dead], capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.startswith("error:") and "Traceback" not in proc.stderr
