"""Every flag an error names exists on the command that raised it.

Two walks: (1) every command that validates its options, driven with a bad value for each of its
options in turn (before any work: the sources do not exist), each error line's flags collected and
checked against that command's own flags; (2) every option name the library can put in an error
(``option="..."`` and ``require_choice(..., "name")`` anywhere in the sources), spelled the way the
command line spells it, is a flag of some command. Also: bad pipeline options exit 2 before any
step runs, and the fast path's argv table is the typer commands' own.
"""

from __future__ import annotations

import ast
import re
import sys
import typing
from pathlib import Path

import click
import pytest
import typer

import fp4forge
from fp4forge.cli import main
from fp4forge.cli.common import flag_for

SRC = Path(fp4forge.__file__).parent
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


def _commands() -> dict[str, click.Command]:
    """Every leaf command, by its path (``kv calibrate``)."""
    from fp4forge.cli import app

    root = typer.main.get_command(app)
    found: dict[str, click.Command] = {}

    def walk(command: click.Command, path: str) -> None:
        if hasattr(command, "list_commands"):  # a group (typer's own click: duck-typed)
            ctx = command.context_class(command)
            for name in command.list_commands(ctx):
                walk(command.get_command(ctx, name), f"{path} {name}".strip())
        else:
            found[path] = command

    walk(root, "")
    return found


def _options(command: click.Command) -> list[click.Option]:
    return [p for p in command.params if p.param_type_name == "option"]


def _flags(command: click.Command) -> set[str]:
    """Its flags (and --help, which every command has)."""
    return {"--help"} | {opt for p in _options(command) for opt in (*p.opts, *p.secondary_opts) if opt.startswith("--")}


def _run(argv: list[str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> tuple[int, str, str]:
    """``fp4forge ARGV`` in this process: (exit code, stdout, stderr)."""
    monkeypatch.setattr(sys, "argv", ["fp4forge", *argv])
    code = 0
    try:
        main()
    except SystemExit as ended:
        code = int(ended.code or 0)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _error_of(argv: list[str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> tuple[int, str]:
    code, _, err = _run(argv, capsys, monkeypatch)
    return code, err


# The commands that check their options before any work, and positionals that do not exist.
DRIVEN = {
    "quantize": ["/nonexistent/src", "/nonexistent/out", "--recipe", "fp8"],
    "calibrate": ["/nonexistent/src", "--out", "/nonexistent/stats.safetensors"],
    "kv calibrate": ["/nonexistent/src", "--into", "/nonexistent/ckpt"],
    "fidelity": ["/nonexistent/teacher", "/nonexistent/student"],
    "pipeline": ["/nonexistent/src", "/nonexistent/out", "--recipe", "fp8"],
    "frontier": ["/nonexistent/src"],
    "study": ["/nonexistent/src", "/nonexistent/out"],
    "audit": ["/nonexistent/ckpt"],
    "bytes": ["/nonexistent/ckpt"],
    "serve cmd": ["/nonexistent/ckpt"],
    "serve doctor": ["/nonexistent/vllm.log"],
    "serve up": ["/nonexistent/ckpt"],
    "quality run": ["--url", "http://127.0.0.1:9/v1", "--model", "m", "--out", "/nonexistent/out"],
    "bench perf": ["--url", "http://127.0.0.1:9/v1", "--model", "m", "--out", "/nonexistent/out"],
}
def _bad_value(param: click.Option) -> str:
    annotation = param.type_descriptor.annotation  # typer's own parameter (its vendored click)
    kinds = {annotation, *typing.get_args(annotation)}
    return "-3" if int in kinds else "-1.5" if float in kinds else "no-such-value"


@pytest.mark.parametrize("path", sorted(DRIVEN))
def test_each_bad_option_names_flags_of_its_own_command(path: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    command = _commands()[path]
    own = _flags(command)
    named: dict[str, set[str]] = {}
    for param in _options(command):
        if param.is_flag or param.name in ("as_json", "recipe") or set(param.opts) & set(DRIVEN[path]):
            continue
        flag = next(o for o in param.opts if o.startswith("--"))
        code, err = _error_of([*path.split(), *DRIVEN[path], flag, _bad_value(param)], capsys, monkeypatch)
        assert code == 2 and "Traceback" not in err, (flag, code, err)
        named[flag] = set(FLAG.findall(err))
    stray = {flag: sorted(flags - own) for flag, flags in named.items() if flags - own}
    assert not stray, f"{path}: errors name flags it does not have: {stray}"
    assert any(flag in flags for flag, flags in named.items()), f"{path}: no error named its own flag: {named}"


def _library_option_names() -> set[str]:
    """Every option name a library error can carry: ``option="name"`` and ``require_choice(v, c, "name")``."""
    names: set[str] = set()
    for file in SRC.rglob("*.py"):
        if "cli" in file.relative_to(SRC).parts:
            continue
        for node in ast.walk(ast.parse(file.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Call):
                continue
            for keyword in node.keywords:
                if keyword.arg == "option" and isinstance(keyword.value, ast.Constant) and isinstance(keyword.value.value, str):
                    names.add(keyword.value.value)
            callee = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if callee == "require_choice" and len(node.args) == 3 and isinstance(node.args[2], ast.Constant):
                names.add(node.args[2].value)
    return names


# Options of the Python API and of library functions no command exposes as a flag: an error about
# one reaches an API caller only (the command sets the value itself, from a flag of another name).
API_ONLY = {
    "schedule",  # quantize.export.ExportSchedule: the exporter's tuning knobs, passed by benchmarks, no command exposes them
    "out",  # study's OUT is a positional argument
    "config",  # bench's served-model config, read from the server
    "per_head",  # kv calibrate --per-head is a switch; the error is about the checkpoint's layout
    "layout",  # bytes --layout / the KV layout: spelled --layout where a command has it
    "policy",  # calibrate --policy
    "m_values", "kernels",  # bench gemm
    "scheme",  # quantize.qconfig's check of a scheme the recipe parser has already accepted
}
# GptqOptions' own names: under `quantize` they are gptq.<name> (errors.option_path), spelled --gptq-*
# (checked by driving quantize above).
NESTED_ONLY = {"damp", "expert_hessian", "fallback", "min_expert_tokens"}


def test_every_library_option_is_spelled_as_some_commands_flag() -> None:
    every_flag = set().union(*(_flags(c) for c in _commands().values()))
    missing = {}
    for name in sorted(_library_option_names() - API_ONLY - NESTED_ONLY):
        spelled = {f.strip() for f in flag_for(name).split("/")}
        if not spelled <= every_flag:
            missing[name] = sorted(spelled - every_flag)
    assert not missing, f"errors would name flags no command has: {missing}"


@pytest.mark.parametrize(("flag", "value"), [("--hardware", "h300"), ("--fidelity-numerics", "w3a3"), ("--calib-samples", "0"),
                                             ("--perf-workload", "nope"), ("--format", "gguf"), ("--device", "tpu"),
                                             ("--quality-categories", "zzz"), ("--block-scales", "x"), ("--quality-runs", "0")])
def test_bad_pipeline_options_exit_2_before_any_step(flag: str, value: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text("{}")
    code, err = _error_of(["pipeline", str(src), str(tmp_path / "out"), "--recipe", "fp8", flag, value], capsys, monkeypatch)
    assert code == 2 and f"({flag})" in err, err
    assert not (tmp_path / "out").exists()


def test_the_fast_path_table_is_the_typer_commands() -> None:
    """cli/fast.py restates the flags of audit and bytes: each must be an option of the typer
    command, reaching the same keyword, and a value option there must take a value here."""
    from fp4forge.cli.fast import FAST_COMMANDS

    commands = _commands()
    for name, fast in FAST_COMMANDS.items():
        options = {opt: p for p in _options(commands[name]) for opt in p.opts}
        for flag, keyword in {**fast.flags, **fast.values}.items():
            assert flag in options and options[flag].name == keyword, (name, flag)
            assert options[flag].is_flag == (flag in fast.flags), (name, flag)
        arguments = [p for p in commands[name].params if p.param_type_name == "argument"]
        assert len(arguments) == fast.positionals, name


def test_version_is_the_package_metadata(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from importlib.metadata import version

    assert fp4forge.__version__ == version("fp4forge")
    for spelling in ("--version", "-V"):
        assert _run([spelling], capsys, monkeypatch)[:2] == (0, f"fp4forge {fp4forge.__version__}\n")

def test_the_pipeline_spells_every_option_its_steps_name_at_run_time() -> None:
    """The options a step's own job names while it runs (too few samples to share, text too short,
    no tokenizer, no device) or when made, spelled as flags `fp4forge pipeline` has."""
    from fp4forge.cli.pipeline import pipeline_flag

    flags = _flags(_commands()["pipeline"])
    paths = [f"{job}.{name}" for job in ("calibration", "fidelity")
             for name in ("samples", "seq_len", "text_files", "tokenizer", "device", "activation_budget_bytes")]
    paths += ["fidelity.numerics", "fidelity.allow_unreadable", "quantize.recipe", "quantize.layout_format", "quantize.block_scales", "quantize.device",
              "perf.workload", "quality.runs", "quality.max_tokens", "quality_categories", "hardware", "serve_hardware", "bench"]
    assert {path: pipeline_flag(path) for path in paths if pipeline_flag(path) not in flags} == {}
