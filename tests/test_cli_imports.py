"""Importing the CLI or the package is cheap: a command's stack (torch, numpy, the quality suite,
the benchmark runner) loads only when that command runs. Measured in a fresh interpreter."""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = ("torch", "numpy", "httpx", "transformers", "matplotlib", "safetensors")
COMMAND_STACKS = ("fp4forge.quality", "fp4forge.bench", "fp4forge.calibrate", "fp4forge.quantize", "fp4forge.audit",
                  "fp4forge.report", "fp4forge.serve", "fp4forge.pipeline", "fp4forge.lab")


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


def test_plain_bytes_runs_without_typer_or_rich(tmp_path) -> None:
    """`fp4forge bytes PATH --json` takes the fast path (fp4forge.cli.fast): typer (and the pydantic
    it coerces options through) and rich stay unloaded; the JSON is the command's usual document."""
    from fp4forge.checkpoint.safetensors_format import encode_header

    prefix, _ = encode_header([("model.embed_tokens.weight", "F32", (2, 2))], None)
    (tmp_path / "model.safetensors").write_bytes(prefix + bytes(16))
    code = (
        "import sys, io, contextlib\nfrom fp4forge.cli import main\n"
        f"sys.argv = ['fp4forge', 'bytes', {str(tmp_path)!r}, '--json']\n"
        "out = io.StringIO()\n"
        "with contextlib.redirect_stdout(out):\n    main()\n"
        "assert json.loads(out.getvalue())['total']['bytes'] == 16\n"
    )
    modules = modules_after("import json\n" + code)
    assert loaded(modules, ("typer", "click", "pydantic", "rich")) == set()


def test_the_fast_path_takes_only_plain_command_lines() -> None:
    from fp4forge.cli.fast import fast_call

    assert fast_call(["bytes", "ckpt", "--json"]) is not None
    assert fast_call(["bytes", "--layout", "qwen3_moe", "ckpt", "--markdown"]) is not None
    for argv in (["bytes"], ["bytes", "--help"], ["bytes", "ckpt", "--json", "--json"], ["bytes", "ckpt", "--layout=x"],
                 ["bytes", "ckpt", "--layout"], ["bytes", "ckpt", "--layout", "--json"], ["bytes", "a", "b"], ["bytes", "ckpt", "-x"],
                 ["bytes", ""], ["audit"], ["audit", "--list-rules"], ["audit", "ckpt", "--format=modelopt"], ["diff", "a", "b"], []):
        assert fast_call(argv) is None, argv
    assert fast_call(["audit", "ckpt", "--json", "--format", "modelopt", "--vllm-version", "0.31"]) is not None
