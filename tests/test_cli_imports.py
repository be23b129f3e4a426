"""Importing the CLI or the package is cheap: a command's stack (torch, numpy, the quality suite,
the benchmark runner) loads only when that command runs. Measured in a fresh interpreter."""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = ("torch", "numpy", "httpx", "transformers", "matplotlib", "safetensors")
COMMAND_STACKS = ("fp4forge.quality", "fp4forge.bench", "fp4forge.calibrate", "fp4forge.quantize", "fp4forge.audit",
                  "fp4forge.report", "fp4forge.serve", "fp4forge.pipeline")


def modules_after(code: str) -> set[str]:
    script = f"{code}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    return set(json.loads(proc.stdout.splitlines()[-1]))


def loaded(modules: set[str], prefixes: tuple[str, ...]) -> set[str]:
    return {m for m in modules if any(m == p or m.startswith(p + ".") for p in prefixes)}


def test_import_cli_loads_no_command_stack() -> None:
    modules = modules_after("import fp4forge.cli")
    assert "fp4forge.cli" in modules
    assert loaded(modules, HEAVY + COMMAND_STACKS) == set()


def test_import_fp4forge_loads_nothing_else() -> None:
    modules = modules_after("import fp4forge")
    assert loaded(modules, ("fp4forge",)) == {"fp4forge"}
    assert loaded(modules, HEAVY) == set()


def test_a_command_loads_its_own_stack_only(tmp_path) -> None:
    """`fp4forge serve doctor` on a log: the serve stack, not quality / bench / torch."""
    log = tmp_path / "vllm.log"
    log.write_text("INFO 11-30 02:35:03 [api_server.py:1] vLLM API server version 0.32.0\n")
    code = (
        "import sys\nfrom fp4forge.cli import main\n"
        f"sys.argv = ['fp4forge', 'serve', 'doctor', {str(log)!r}, '--json']\n"
        "try:\n    main()\nexcept SystemExit:\n    pass"
    )
    modules = modules_after(code)
    assert "fp4forge.serve.doctor" in modules
    assert loaded(modules, ("fp4forge.quality", "fp4forge.bench", "torch", "numpy")) == set()
