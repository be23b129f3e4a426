"""Serving checkpoints with real inference servers (vLLM on CPU for now)."""

from fp4forge.serve.launcher import (
    DEFAULT_ENV,
    LOOPBACK_HOST,
    VllmServer,
    launch_vllm,
    pick_free_port,
    read_log_tail,
    start_vllm,
)

__all__ = [
    "DEFAULT_ENV",
    "LOOPBACK_HOST",
    "VllmServer",
    "launch_vllm",
    "pick_free_port",
    "read_log_tail",
    "start_vllm",
]
