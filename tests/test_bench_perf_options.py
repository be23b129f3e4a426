"""`bench.perf.PerfOptions`: options are checked once, in the library, and errors name the option
(not a CLI flag); the CLI adds its own spelling. No server is needed: a bad option stops before
any request and before anything is written."""

from __future__ import annotations

from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from fp4forge.bench.perf import PerfOptions
from fp4forge.cli.bench import EXIT_UNUSABLE, register
from fp4forge.errors import ConfigError


def options(tmp_path: Path, **overrides: object) -> PerfOptions:
    chosen = {"workload": "cpu-tiny", **overrides}
    return PerfOptions(url="http://127.0.0.1:9", model="m", out_dir=tmp_path / "run", **chosen)  # type: ignore[arg-type]


@pytest.mark.parametrize(("overrides", "option"), [
    ({"workload": "nope"}, "workload"),
    ({"mode": "burst"}, "mode"),
    ({"mode": "concurrency", "concurrency": [0]}, "concurrency"),
    ({"mode": "rate", "rates_rps": [0.0]}, "rate"),
    ({"endpoint": "embeddings"}, "endpoint"),
    ({"output_control": "stop"}, "output_control"),
    ({"samples": 0}, "samples"),
    ({"prefix_cache_fraction": 1.0}, "prefix_fraction"),
])
def test_bad_options_are_named_not_flagged(tmp_path: Path, overrides: dict[str, object], option: str) -> None:
    with pytest.raises(ConfigError) as caught:
        options(tmp_path, **overrides)
    assert caught.value.option == option
    assert "--" not in str(caught.value)  # the library never spells a CLI flag
    assert not (tmp_path / "run").exists()


def test_overrides_replace_single_workload_fields(tmp_path: Path) -> None:
    config = options(tmp_path, prompt_tokens=[16, 32], output_tokens=5, samples=3, mode="concurrency", concurrency=[1, 2]).bench_config
    assert [s.name for s in config.shapes] == ["p16-o5", "p32-o5"]
    assert config.samples == 3 and [p.label for p in config.points] == ["c1", "c2"]
    assert config.workload == "cpu-tiny"


def test_the_cli_spells_the_option_as_its_flag(tmp_path: Path) -> None:
    app = typer.Typer()
    register(app)
    result = CliRunner().invoke(app, ["bench", "perf", "--url", "http://127.0.0.1:9", "--model", "m", "--out", str(tmp_path / "r"),
                                      "--workload", "nope", "--json"])
    assert result.exit_code == EXIT_UNUSABLE
    assert "unknown workload 'nope'" in result.output and "(--workload)" in result.output
