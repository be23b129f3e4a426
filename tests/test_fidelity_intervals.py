"""Fidelity's intervals over documents: coverage on a synthetic case with a known answer, the
per-document sums by hand, the document numbers packing records, and the refusals (no text the
model owns, text the teacher cannot read) as named errors with their exit codes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fp4forge.errors import ExitCode, TextRequiredError, UnreadableTextError
from fp4forge.fidelity.intervals import fidelity_intervals, unit_sums
from fp4forge.fidelity.readable import UNREADABLE_PERPLEXITY_SHARE, check_readable
from fp4forge.model.samples import OWN_TEXT_FILES, Document, pack
from tests.trained_fixtures import trained_laguna  # noqa: F401 (the cached trained testbed)

LEVEL = 0.95
REPLICATIONS = 400
DOCUMENTS = 60
# Binomial standard error of a coverage of 0.95 over 400 replications is 0.011; a percentile
# bootstrap over 60 skewed clusters covers a little less than its level. Stated tolerance: 0.04.
COVERAGE_TOLERANCE = 0.04


def _replication(rng: np.random.Generator) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Documents of random length; each has its own level (KL scale, agreement rate), so positions
    of one document are correlated. Known answer: mean KL per position 1.0, agreement 0.8."""
    lengths = rng.integers(20, 200, size=DOCUMENTS)
    scale = rng.gamma(shape=2.0, scale=0.5, size=DOCUMENTS)  # mean 1.0
    rate = rng.beta(8.0, 2.0, size=DOCUMENTS)  # mean 0.8
    owner = np.repeat(np.arange(DOCUMENTS), lengths)
    kl = scale[owner] * rng.exponential(1.0, size=owner.size)
    agree = (rng.random(owner.size) < rate[owner]).astype(float)
    nll = np.log(1.0 + kl)
    return {"kl": kl, "agree": agree, "teacher_nll": nll, "student_nll": nll}, owner


def _coverage(document_level: bool, replications: int = REPLICATIONS, resamples: int = 400) -> dict[str, float]:
    rng = np.random.default_rng(2026)
    hits = {"kl": 0, "top1_agreement": 0}
    truth = {"kl": 1.0, "top1_agreement": 0.8}
    for number in range(replications):
        values, owner = _replication(rng)
        units = owner if document_level else np.arange(owner.size)
        # one row: the first token is predicted by nothing, position i predicts token i + 1
        ids = np.concatenate([[units[0]], units])[None, :]
        found = fidelity_intervals(values, ids, level=LEVEL, resamples=resamples, seed=number)["intervals"]
        for name in hits:
            hits[name] += found[name]["low"] <= truth[name] <= found[name]["high"]
    return {name: count / replications for name, count in hits.items()}


def test_document_intervals_cover_the_known_answer_at_their_level() -> None:
    coverage = _coverage(document_level=True)
    assert all(abs(c - LEVEL) <= COVERAGE_TOLERANCE for c in coverage.values()), coverage
    # The same data resampled by position (as if positions were independent) covers far less
    # (about 0.3 to 0.4): the test tells the unit apart. Fewer, smaller runs: ~6,600 units each.
    by_position = _coverage(document_level=False, replications=40, resamples=100)
    assert all(c < LEVEL - 0.2 for c in by_position.values()), by_position


def test_unit_sums_and_the_reported_numbers_by_hand() -> None:
    values = {"kl": np.array([1.0, 2.0, 3.0, 4.0]), "agree": np.array([1.0, 0.0, 1.0, 1.0])}
    sums, counts = unit_sums(values, np.array([7, 7, 9, 7]))
    assert counts.tolist() == [3.0, 1.0] and sums["kl"].tolist() == [7.0, 3.0] and sums["agree"].tolist() == [2.0, 1.0]
    # one document: every resample is the whole run, the interval is the point estimate
    one = {"kl": np.array([0.5, 1.5]), "agree": np.array([1.0, 0.0]), "teacher_nll": np.log([2.0, 8.0]), "student_nll": np.log([4.0, 4.0])}
    found = fidelity_intervals(one, np.array([[0, 0, 0]]))
    assert found["documents"] == 1 and found["tokens"] == 2 and found["interval_unit"] == "document"
    assert found["intervals"]["kl"] == {"low": 1.0, "high": 1.0, "level": 0.95}
    assert found["intervals"]["teacher_perplexity"]["low"] == pytest.approx(4.0)  # exp(mean(log 2, log 8))
    # two rows of one document each: the first token of a row is predicted by nothing
    two = fidelity_intervals(one, np.array([[5, 5], [8, 8]]))
    assert two["documents"] == 2 and two["tokens"] == 2 and two["intervals"]["kl"]["low"] == 0.5 and two["intervals"]["kl"]["high"] == 1.5


class _CharTokenizer:
    """One token per character: document boundaries are where the texts' lengths say."""

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
        return {"input_ids": [ord(c) for c in text]}


def test_packing_numbers_each_token_by_its_document() -> None:
    documents = [Document("a", text="aaaaa"), Document("b", text="bbb"), Document("c", text="cccccccc")]
    ids, owners = pack(_CharTokenizer(), documents, samples=3, seq_len=4)
    assert owners.tolist() == [[0, 0, 0, 0], [0, 1, 1, 1], [2, 2, 2, 2]]
    assert [[chr(i) for i in row] for row in ids.tolist()][1] == ["a", "b", "b", "b"]


def test_readability_line_is_half_the_vocabulary() -> None:
    assert UNREADABLE_PERPLEXITY_SHARE == 0.5
    assert check_readable(2047.9, 4096, False)["readable"] is True
    with pytest.raises(UnreadableTextError, match="4,096") as refused:
        check_readable(2048.0, 4096, False)
    assert refused.value.exit_code == ExitCode.FINDINGS and refused.value.option == "allow_unreadable"
    allowed = check_readable(60748.0, 4096, True)
    assert allowed["readable"] is False and allowed["warning"].startswith("UNREADABLE TEXT, scored anyway")


@pytest.fixture(scope="module")
def random_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A random tiny Laguna and its NVFP4 experts at a constant activation amax."""
    from fp4forge.quantize.act_scales import ConstantAmax
    from fp4forge.quantize.export import QuantizeOptions, quantize_checkpoint
    from fp4forge.quantize.recipe import load_recipe
    from fp4forge.testbed import build_tiny_laguna

    root = tmp_path_factory.mktemp("random-pair")
    model = build_tiny_laguna(root / "bf16", seed=0)
    quantize_checkpoint(model, root / "nvfp4", QuantizeOptions(recipe=load_recipe("nvfp4-experts"), act_amax=ConstantAmax(8.0)))
    return model, root / "nvfp4"


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fp4forge.cli", *args], capture_output=True, text=True, timeout=300)


def test_fidelity_refuses_without_text_and_on_unreadable_text(random_pair: tuple[Path, Path], tmp_path: Path) -> None:
    """A random testbed reads no text. No text given: TextRequiredError naming --text (exit 2);
    the built-in corpus asked for: UnreadableTextError naming --allow-unreadable (exit 1); neither
    prints a report or writes the teacher cache. The override scores it with the warning."""
    from fp4forge import measure_fidelity
    from fp4forge.fidelity.options import FidelityOptions

    teacher, student = random_pair
    with pytest.raises(TextRequiredError):
        measure_fidelity(teacher, student)
    small = ("--samples", "2", "--seq-len", "32", "--batch-size", "2", "--json")
    cache = tmp_path / "teacher.safetensors"
    no_text = _cli("fidelity", str(teacher), str(student), *small)
    assert no_text.returncode == ExitCode.UNUSABLE and "--text" in no_text.stderr and "Traceback" not in no_text.stderr
    unreadable = _cli("fidelity", str(teacher), str(student), *small, "--builtin", "--teacher-cache", str(cache))
    assert unreadable.returncode == ExitCode.FINDINGS and "--allow-unreadable" in unreadable.stderr, unreadable.stderr
    assert "metrics" not in no_text.stdout + unreadable.stdout and not cache.exists()
    allowed = measure_fidelity(teacher, student, FidelityOptions(samples=2, seq_len=32, batch_size=2, builtin_corpus=True, allow_unreadable=True))
    assert allowed.metrics["readability"]["warning"].startswith("UNREADABLE TEXT, scored anyway")


def test_trained_testbed_needs_its_own_text_and_then_carries_intervals(trained_laguna: Path, tmp_path: Path) -> None:  # noqa: F811
    """Without text: a named error that points at the text the testbed ships (exit 2). With its
    held-out text: the teacher reads it, and KL, top-1 agreement and both perplexities carry
    intervals over the documents scored."""
    from fp4forge import measure_fidelity
    from fp4forge.calibrate import CalibrationOptions, calibrate_checkpoint
    from fp4forge.checkpoint.stats import write_stats
    from fp4forge.fidelity.options import FidelityOptions
    from fp4forge.quantize.act_scales import StatsAmax
    from fp4forge.quantize.export import QuantizeOptions, quantize_checkpoint
    from fp4forge.quantize.recipe import load_recipe

    heldout, calibration = (trained_laguna / OWN_TEXT_FILES[split] for split in ("heldout", "calibration"))
    result = calibrate_checkpoint(trained_laguna, CalibrationOptions(samples=2, seq_len=64, text_files=(calibration,), builtin_corpus=False))
    stats = StatsAmax(write_stats(tmp_path / "stats.safetensors", result.tensors, result.metadata))
    student = tmp_path / "nvfp4"
    quantize_checkpoint(trained_laguna, student, QuantizeOptions(recipe=load_recipe("nvfp4-experts"), act_amax=stats))
    with pytest.raises(TextRequiredError, match=OWN_TEXT_FILES["heldout"]):
        measure_fidelity(trained_laguna, student)
    no_text = _cli("fidelity", str(trained_laguna), str(student), "--json")
    assert no_text.returncode == ExitCode.UNUSABLE and "--text" in no_text.stderr and "metrics" not in no_text.stdout
    # Its shortest held-out documents (they run to ~1,900 tokens): several documents in few tokens.
    lines = sorted(heldout.read_text(encoding="utf-8").splitlines(), key=len)[:24]
    short = tmp_path / "heldout-short.jsonl"
    short.write_text("\n".join(lines) + "\n", encoding="utf-8")
    report = measure_fidelity(trained_laguna, student, FidelityOptions(samples=6, seq_len=128, text_files=(short,)))
    m = report.metrics
    assert m["readability"]["readable"] and m["readability"]["warning"] is None
    assert m["interval_unit"] == "document" and m["documents"] >= 3 and m["tokens"] == m["positions"] == 6 * 127
    points = {"kl": m["kl"]["mean"], "top1_agreement": m["top1_agreement"],
              "teacher_perplexity": m["perplexity"]["teacher"], "student_perplexity": m["perplexity"]["student"]}
    for name, point in points.items():
        interval = m["intervals"][name]
        assert interval["level"] == 0.95 and interval["low"] <= point <= interval["high"], (name, point, interval)
    assert m["intervals"]["kl"]["high"] > m["intervals"]["kl"]["low"] > 0
    print(f"\ntrained testbed nvfp4-experts W4A4: KL {points['kl']:.6f} [{m['intervals']['kl']['low']:.6f}, {m['intervals']['kl']['high']:.6f}], "
          f"top-1 {points['top1_agreement']:.4f}, teacher ppl {points['teacher_perplexity']:.3f}, {m['documents']} documents, {m['tokens']} tokens")



@pytest.mark.parametrize("readability, banner, note", [
    ({"readable": False, "warning": "UNREADABLE TEXT, scored anyway: the teacher cannot read this text"}, True, False),
    ({"readable": None, "warning": "the config names no vocab_size: whether the teacher reads this text was not checked"}, False, True),
    ({"readable": True, "warning": None}, False, False),
])
def test_the_fidelity_table_calls_text_unreadable_only_when_it_was_found_so(readability, banner, note) -> None:
    """Text not checked (no vocab_size) is said to be unchecked, not unreadable."""
    from rich.console import Console

    from fp4forge.report.calibrate_tables import fidelity_rich

    metrics = {"kl": {"estimator": "exact", "mean": 0.001, "median": 0.0005, "p99": 0.01}, "positions": 100, "documents": 4, "tokens": 100,
               "perplexity": {"teacher": 2.0, "student": 2.1}, "top1_agreement": 0.99, "intervals": {}, "readability": readability}
    report = {"student": "s", "teacher": "t", "numerics": "w4a4", "kv_cache": "bf16", "moe_input_scale": "global-max", "metrics": metrics, "layers": []}
    console = Console(record=True, width=200)
    for table in fidelity_rich(report):
        console.print(table)
    text = console.export_text()
    assert ("UNREADABLE TEXT" in text) is banner
    assert ("was not checked" in text) is note
