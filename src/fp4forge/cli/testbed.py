"""`fp4forge testbed tiny-laguna|tiny-qwen3-moe|shipped|trained-laguna|synth`: local test models, no internet needed."""

from __future__ import annotations

from pathlib import Path

import typer

from fp4forge.cli.common import console, emit_json, progress_bar

testbed_app = typer.Typer(no_args_is_help=True, help="Build local test models (no internet needed).")


def register(app: typer.Typer) -> None:
    import importlib

    from fp4forge.cli.commands import GROUP_EXTENSIONS

    for module in GROUP_EXTENSIONS["testbed"]:  # testbed trained-laguna, from the lab
        importlib.import_module(module).register(testbed_app)
    app.add_typer(testbed_app, name="testbed")


@testbed_app.command("tiny-laguna")
def testbed_tiny_laguna(
    out_dir: Path = typer.Argument(..., metavar="OUT", help="Directory to create."),
    seed: int = typer.Option(0, help="Seed: the same seed gives byte-identical files."),
    dense: bool = typer.Option(False, "--dense", help="Every layer a dense MLP (stock vLLM CPU can serve it)."),
    as_json: bool = typer.Option(False, "--json", help="Print a JSON summary."),
) -> None:
    """A tiny random LagunaForCausalLM: dense layer 0, sigmoid-routed MoE with shared expert, mixed attention."""
    from fp4forge.testbed import build_tiny_laguna

    with progress_bar("building tiny Laguna", not as_json) as progress:
        path = build_tiny_laguna(out_dir, seed=seed, dense=dense, progress=progress)
    _report_built(path, as_json)


@testbed_app.command("shipped")
def testbed_shipped(
    out_dir: Path = typer.Argument(..., metavar="OUT", help="Directory to create."),
    name: str = typer.Option("trained-laguna", "--name", help="Which shipped testbed (the trained tiny Laguna)."),
    as_json: bool = typer.Option(False, "--json", help="Print its identity and where it was written as JSON."),
) -> None:
    """A copy of a testbed fp4forge ships (the trained tiny Laguna), verified by sha256: the same bytes on every machine, no training."""
    from fp4forge.testbed.shipped import copy_shipped_testbed

    testbed = copy_shipped_testbed(out_dir, name)
    if as_json:
        emit_json(testbed.to_json())
        return
    console().print(f"[green]wrote[/green] {testbed.path}: {testbed.label}, sha256 {testbed.sha256} (verified)", highlight=False)


@testbed_app.command("tiny-qwen3-moe")
def testbed_tiny_qwen3_moe(
    out_dir: Path = typer.Argument(..., metavar="OUT"),
    seed: int = typer.Option(0),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """A tiny random Qwen3MoeForCausalLM (softmax routing), same tokenizer as the tiny Laguna."""
    from fp4forge.testbed import build_tiny_qwen3_moe

    with progress_bar("building tiny Qwen3-MoE", not as_json) as progress:
        path = build_tiny_qwen3_moe(out_dir, seed=seed, progress=progress)
    _report_built(path, as_json)


@testbed_app.command("synth")
def testbed_synth(
    out_dir: Path = typer.Argument(..., metavar="OUT"),
    config: str = typer.Option(..., "--config", help="A config.json path or a preset name (laguna-s-2.1-like, laguna-xs.2-like, deepseek-v3-like, qwen3-235b-like)."),
    layers: int = typer.Option(..., "--layers", min=1, help="Decoder layers to write (the first N)."),
    shrink: int = typer.Option(1, "--shrink", min=1, help="Divide widths, head and expert counts and the vocabulary by this (1: real size)."),
    seed: int = typer.Option(0),
    max_shard_gb: float = typer.Option(5.0, "--max-shard-gb", help="Shard size limit in GiB."),
    sparse: bool = typer.Option(False, "--sparse", help="Headers only; data regions are file holes."),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """A shape-true synthetic checkpoint: real names, shapes and dtypes, seeded heavy-tailed values, streamed."""
    from fp4forge.testbed import synth_checkpoint

    with progress_bar("writing synthetic checkpoint", not as_json) as progress:
        path = synth_checkpoint(config, layers, out_dir, seed=seed, max_shard_bytes=int(max_shard_gb * 2**30), sparse=sparse,
                               shrink=shrink, progress=progress)
    _report_built(path, as_json)


def _report_built(path: Path, as_json: bool) -> None:
    files = sorted(p for p in Path(path).iterdir() if p.is_file())
    if as_json:
        emit_json({"path": str(path), "files": [{"name": p.name, "bytes": p.stat().st_size} for p in files]})
    else:
        console().print(f"[green]wrote[/green] {path} ({len(files)} files, {sum(p.stat().st_size for p in files):,} bytes)")
