"""`fp4forge frontier` and `fp4forge study`: the quantization study's commands (docs/study.md).

    fp4forge frontier SRC [--formats nvfp4,int2] [--components routed_experts,attention] [--groups 16,32,row] [--out DIR] [--json]
    fp4forge study SRC OUT [--arms ...] [--formats ...] [--components ...] [--samples N] [--seq-len N] [--json]
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from fp4forge.cli.common import console, emit_json, fail, progress_bar
from fp4forge.errors import ExitCode, Fp4forgeError


def _csv(value: Optional[str]) -> Optional[tuple[str, ...]]:
    return tuple(v.strip() for v in value.split(",") if v.strip()) if value else None


def _groups(value: Optional[str]) -> Optional[tuple[int | None, ...]]:
    items = _csv(value)
    if items is None:
        return None
    groups: list[int | None] = []
    for item in items:
        if item == "row":
            groups.append(None)
        elif item.isdigit():
            groups.append(int(item))
        else:
            raise typer.BadParameter(f"group sizes are integers or 'row', got {item!r}", param_hint="--groups")
    return tuple(groups)


def register(app: typer.Typer) -> None:
    _register_frontier(app)
    _register_study(app)


def _register_frontier(app: typer.Typer) -> None:
    @app.command("frontier")
    def frontier_command(
        src: str = typer.Argument(..., help="A BF16 checkpoint directory."),
        formats: Optional[str] = typer.Option(None, "--formats", help="Comma-separated subset of nvfp4,mxfp4,fp8,int8,int4,int3,int2."),
        components: Optional[str] = typer.Option(None, "--components", help="Comma-separated subset of routed_experts,shared_expert,dense_mlp,attention,router,lm_head."),
        groups: Optional[str] = typer.Option(None, "--groups", help="INT-N group sizes, comma-separated; 'row' = one group per output row (default 16,32,64,128,row)."),
        max_tensors: Optional[int] = typer.Option(None, "--max-tensors", help="At most this many weights per component (a quick look; default every weight)."),
        out_dir: Optional[Path] = typer.Option(None, "--out", metavar="DIR", help="Write frontier.json, frontier.md and frontier.png here."),
        as_json: bool = typer.Option(False, "--json", help="Print one JSON object: {source, arms: [{component, format, bits, group_size, method, bpp, rel_error, ...}]}."),
    ) -> None:
        """Bits per parameter (scales included) against relative weight error, per component, format, group size and method."""
        from fp4forge.report.plotting import pyplot
        from fp4forge.lab.study.frontier import compute_frontier, frontier_options, write_frontier
        from fp4forge.lab.study.tables import frontier_plot, frontier_rich

        try:
            options = frontier_options(formats=_csv(formats) or None, components=_csv(components) or None, int_groups=_groups(groups) or None,
                                       max_tensors_per_component=max_tensors)
            with progress_bar("frontier", enabled=not as_json) as progress:
                result = compute_frontier(src, options, progress=progress)
        except Fp4forgeError as error:
            raise fail(error, error.exit_code, as_json) from None
        except OSError as error:
            raise fail(error, ExitCode.UNUSABLE, as_json) from None
        doc = result.to_json()
        if out_dir is not None:
            write_frontier(doc, out_dir)
            frontier_plot(doc, out_dir / "frontier.png", pyplot())
        if as_json:
            emit_json(doc)
        else:
            console().print(frontier_rich(doc))
            for skipped in doc["skipped"]:
                console(stderr=True).print(f"[yellow]not run:[/yellow] {skipped['component']} {skipped['arm']}: {skipped['reason']}")


def _register_study(app: typer.Typer) -> None:
    @app.command("study")
    def study_command(
        src: str = typer.Argument(..., help="A BF16 checkpoint directory."),
        out: Path = typer.Argument(..., help="The study's directory (created; a re-run with the same settings resumes it)."),
        arms: Optional[str] = typer.Option(None, "--arms", help="Whole-model arms, comma-separated (default all: fp8, nvfp4-w4a16-minmax, nvfp4-w4a16-mse, nvfp4-w4a16-gptq, nvfp4-w4a4-minmax, int2-g16-mse, int2-g32-mse)."),
        formats: Optional[str] = typer.Option(None, "--formats", help="Frontier formats (default all)."),
        components: Optional[str] = typer.Option(None, "--components", help="Frontier components (default every quantizable one)."),
        groups: Optional[str] = typer.Option(None, "--groups", help="Frontier INT-N group sizes ('row' = per output row)."),
        samples: Optional[int] = typer.Option(None, "--samples", help="Fidelity samples per arm (the KL interval resamples them)."),
        seq_len: Optional[int] = typer.Option(None, "--seq-len", help="Tokens per fidelity sample."),
        calibration_samples: Optional[int] = typer.Option(None, "--calibration-samples", help="Calibration samples (activation scales, GPTQ Hessians)."),
        text: Optional[list[Path]] = typer.Option(None, "--text", metavar="FILE", help="Held-out text for the KL (.txt or .jsonl with a 'text' field; repeatable) instead of the built-in corpus."),
        calibration_text: Optional[list[Path]] = typer.Option(None, "--calibration-text", metavar="FILE", help="Calibration text (repeatable) instead of the built-in corpus."),
        as_json: bool = typer.Option(False, "--json", help="Print the study document as JSON."),
    ) -> None:
        """The quantization study in one resumable run: frontier, whole-model arms with KL and CIs, GEMM bench on a GPU; a Markdown report."""
        from fp4forge.errors import given_options
        from fp4forge.lab.study.run import run_study, study_options
        from fp4forge.lab.study.tables import arms_rich

        try:
            # a flag left out (None) keeps StudyOptions' default (importing it here: torch, so not for --help)
            options = study_options(**given_options(  # type: ignore[arg-type]
                formats=_csv(formats) or None, components=_csv(components) or None, int_groups=_groups(groups) or None, arms=_csv(arms) or None,
                fidelity_samples=samples, fidelity_seq_len=seq_len, calibration_samples=calibration_samples,
                text_files=tuple(str(p) for p in text or ()), calibration_text_files=tuple(str(p) for p in calibration_text or ()),
            ))
            with progress_bar("study", enabled=not as_json) as progress:
                result = run_study(src, out, options, progress=progress)
        except Fp4forgeError as error:
            raise fail(error, error.exit_code, as_json) from None
        except OSError as error:
            raise fail(error, ExitCode.UNUSABLE, as_json) from None
        doc = result.to_json()
        if as_json:
            emit_json(doc)
            return
        if doc["arms"]:
            console().print(arms_rich(doc["arms"], f"Whole-model arms — KL vs BF16 over {options.fidelity_samples} samples (95 % CI)"))
        for line in doc["comparisons"]:
            console().print(f"- {line}")
        for item in doc["not_run"]:
            console(stderr=True).print(f"[yellow]not run:[/yellow] {item['part']}: {item['reason']}")
        console().print(f"report: {result.out / 'study.md'}")
