"""Two ranks through torch.distributed (gloo, CPU) against one process on the tiny Laguna:
the same calibration statistics (bit for bit, the same file bytes), the same exported checkpoint
bytes (sha256 of every file), fidelity's per-position metrics and KL equal within float tolerance,
and every rank holding the same result."""

from __future__ import annotations

import hashlib
import json
import os
import socket
from pathlib import Path

import pytest
import torch

from fp4forge.calibrate import CalibrationOptions, calibrate_checkpoint
from fp4forge.checkpoint.stats import read_stats
from fp4forge.errors import DistributedError
from fp4forge.fidelity.evaluate import FidelityOptions, evaluate
from fp4forge.model.distributed import Ranks, current
from fp4forge.quantize.act_scales import StatsAmax
from fp4forge.quantize.export import QuantizeOptions, quantize_checkpoint
from fp4forge.quantize.recipe import load_recipe
from tests.calibration_fixtures import laguna, one_thread  # noqa: F401 (shared fixtures)

WORLD = 2
# 3 batches: the ranks get 1 and 2 of them, so the split is uneven on purpose
CALIBRATION = CalibrationOptions(samples=6, seq_len=96, batch_size=2)
FIDELITY = FidelityOptions(samples=4, seq_len=96, batch_size=2, builtin_corpus=True, allow_unreadable=True)  # a random testbed reads no text
RECIPE = "nvfp4-experts-fp8-attn"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _pipeline(source: Path, out: Path) -> dict:
    """Calibrate -> statistics file -> quantize -> fidelity; the same calls in both arms."""
    from fp4forge.calibrate.run import calibrate_to_file

    stats = out / "stats" / "stats.safetensors"  # same file name in both arms: provenance names it
    stats.parent.mkdir(parents=True, exist_ok=True)
    result = calibrate_checkpoint(source, CALIBRATION)
    calibrate_to_file(source, stats, CALIBRATION)
    options = QuantizeOptions(recipe=load_recipe(RECIPE), act_amax=StatsAmax(stats), workers=1)
    summary = quantize_checkpoint(source, out / "q" / "model", options)
    report = evaluate(source, out / "q" / "model", FIDELITY)
    return {"tensors": result.tensors, "tokens_per_expert": result.metadata["tokens_per_expert"],
            "bytes_read": summary.bytes_read, "weight_error": summary.weight_error,
            "metrics": report.metrics, "layers": report.layers}


def _rank_main(rank: int, port: int, source: str, out: str) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(WORLD),
                       "RANK": str(rank), "LOCAL_RANK": str(rank), "FP4FORGE_DIST_BACKEND": "gloo"})
    torch.set_num_threads(1)
    ranks = current()
    assert (ranks.rank, ranks.world_size, ranks.backend) == (rank, WORLD, "gloo")
    torch.save(_pipeline(Path(source), Path(out)), Path(out) / f"rank{rank}.pt")


def _digests(directory: Path) -> dict[str, str]:
    return {p.relative_to(directory).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.rglob("*")) if p.is_file()}


def test_two_gloo_ranks_equal_one_process(laguna: Path, tmp_path: Path) -> None:
    single_dir, multi_dir = tmp_path / "one", tmp_path / "two"
    single_dir.mkdir()
    multi_dir.mkdir()
    single = _pipeline(laguna, single_dir)
    # fork: the children start with torch and transformers already imported (spawn costs ~30 s of
    # imports per rank on a loaded 2-core machine); the ranks form their group from the env.
    torch.multiprocessing.start_processes(_rank_main, args=(_free_port(), str(laguna), str(multi_dir)), nprocs=WORLD, join=True, start_method="fork")
    ranks = [torch.load(multi_dir / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]

    # calibration: every statistic identical (MAX is order-free), the file byte for byte
    assert (single_dir / "stats" / "stats.safetensors").read_bytes() == (multi_dir / "stats" / "stats.safetensors").read_bytes()
    on_disk = read_stats(multi_dir / "stats" / "stats.safetensors")
    for result in ranks:
        assert result["tensors"].keys() == single["tensors"].keys()
        assert all(torch.equal(result["tensors"][n], single["tensors"][n]) for n in single["tensors"])
        assert result["tokens_per_expert"] == single["tokens_per_expert"]  # SUM of the ranks' routed counts
    assert all(torch.equal(on_disk.tensor(n), t) for n, t in single["tensors"].items())
    assert sum(sum(counts) for counts in single["tokens_per_expert"].values()) > 0

    # export: the same files, the same bytes; every rank reports the whole run
    assert _digests(single_dir / "q") == _digests(multi_dir / "q")
    assert not any(p.name.startswith(".") for p in (multi_dir / "q").iterdir())  # no staging or journal left
    for result in ranks:
        assert result["bytes_read"] == single["bytes_read"]
        assert json.dumps(result["weight_error"], sort_keys=True) == json.dumps(single["weight_error"], sort_keys=True)

    # fidelity: the same positions; per-position values computed on the same batches
    for result in ranks:
        metrics, expected = result["metrics"], single["metrics"]
        assert metrics["positions"] == expected["positions"] == 4 * 95
        assert metrics["top1_agreement"] == expected["top1_agreement"]
        for key in ("mean", "median", "p99"):
            assert metrics["kl"][key] == pytest.approx(expected["kl"][key], rel=1e-6, abs=1e-9)
        assert metrics["kl"]["mean"] > 0
        for ours, theirs in zip(result["layers"], single["layers"], strict=True):
            assert ours["relative_error"] == pytest.approx(theirs["relative_error"], rel=1e-9)  # SUM order differs
    assert ranks[0]["metrics"] == ranks[1]["metrics"]


def test_blocks_of_work_cover_everything_once_and_too_few_are_refused() -> None:
    items = list(range(7))
    blocks = [Ranks(rank=r, world_size=3).share(items) for r in range(3)]
    assert blocks == [[0, 1], [2, 3], [4, 5, 6]]  # contiguous, in order, sizes differ by at most one
    with pytest.raises(DistributedError, match="2 calibration batches cannot be shared by 3 ranks"):
        Ranks(rank=1, world_size=3).require_share(2, "calibration batches")
    Ranks().require_share(1, "calibration batches")  # one process: anything goes


def test_a_launcher_environment_without_rendezvous_is_a_named_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import fp4forge.model.distributed as distributed

    monkeypatch.setattr(distributed, "_current", None)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    with pytest.raises(DistributedError, match="MASTER_ADDR"):
        distributed.current()
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(DistributedError, match="not an integer"):
        distributed.current()
    assert distributed._current is None


def _failing_rank_main(rank: int, port: int, out: str) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(WORLD),
                       "RANK": str(rank), "LOCAL_RANK": str(rank), "FP4FORGE_DIST_BACKEND": "gloo"})
    from fp4forge.errors import WriteError

    ranks = current()

    def write() -> str:
        raise WriteError("disk full")

    try:
        ranks.on_main(write, "writing the statistics")
        outcome = "returned"
    except Exception as exc:  # noqa: BLE001 - the outcome is what the test reads
        outcome = f"{type(exc).__name__}: {exc}"
    Path(out, f"rank{rank}.txt").write_text(outcome)


def test_a_rank_that_fails_stops_the_others_with_a_named_error(tmp_path: Path) -> None:
    torch.multiprocessing.start_processes(_failing_rank_main, args=(_free_port(), str(tmp_path)), nprocs=WORLD, join=True, start_method="fork")
    assert (tmp_path / "rank0.txt").read_text() == "WriteError: disk full"
    assert (tmp_path / "rank1.txt").read_text().startswith("DistributedError: rank 0 failed during writing the statistics")


def _export_options() -> QuantizeOptions:
    from fp4forge.quantize.act_scales import parse_act_scales

    return QuantizeOptions(recipe=load_recipe(RECIPE), act_amax=parse_act_scales("constant:8.0", None), workers=1)


def _export_rank_that_dies(rank: int, port: int, source: str, out: str) -> None:
    """Rank 1 fails at its third unit; both ranks record how they stopped."""
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(WORLD),
                       "RANK": str(rank), "LOCAL_RANK": str(rank), "FP4FORGE_DIST_BACKEND": "gloo"})
    from fp4forge.quantize import export

    if rank == 1:
        real, calls = export.UnitQuantizer.quantize, []

        def dying(self, unit, weights):  # type: ignore[no-untyped-def]
            calls.append(unit.key)
            if len(calls) == 3:
                raise RuntimeError("killed")
            return real(self, unit, weights)

        export.UnitQuantizer.quantize = dying
    try:
        quantize_checkpoint(source, Path(out) / "model", _export_options())
        outcome = "finished"
    except Exception as exc:  # noqa: BLE001 - the outcome is what the test reads
        outcome = type(exc).__name__
    Path(out, f"rank{rank}.txt").write_text(outcome)


def test_a_failed_two_rank_export_resumes_in_one_process_to_the_same_bytes(laguna: Path, tmp_path: Path) -> None:
    quantize_checkpoint(laguna, tmp_path / "reference" / "model", _export_options())
    out = tmp_path / "resumed"
    out.mkdir()
    torch.multiprocessing.start_processes(_export_rank_that_dies, args=(_free_port(), str(laguna), str(out)), nprocs=WORLD, join=True, start_method="fork")
    assert [(out / f"rank{r}.txt").read_text() for r in range(WORLD)] == ["DistributedError", "RuntimeError"]
    partial = out / ".model.partial"
    assert not (out / "model").exists() and partial.is_dir()
    assert sorted(p.name for p in partial.glob(".fp4forge-journal*")) == [".fp4forge-journal", ".fp4forge-journal.1"]
    finished = {p.name: sum(line.endswith("\t.") for line in p.read_text().splitlines()) for p in partial.glob(".fp4forge-journal*")}
    assert finished[".fp4forge-journal.1"] == 2 and finished[".fp4forge-journal"] > 0  # rank 1 died at its third unit
    resumed = quantize_checkpoint(laguna, out / "model", _export_options())
    assert resumed.resumed_units == sum(finished.values())  # both ranks' units are taken, not redone
    assert _digests(out / "model") == _digests(tmp_path / "reference" / "model")
    assert not partial.exists()
