"""`fp4forge card` from a fixed set of artifacts (tests/fixtures/card: a real pipeline run on the
tiny Laguna, served by vLLM CPU with the plugin): every table on the card is checked, cell by cell,
against the JSON it came from; deleting any one artifact makes the card say so, not invent it.

The oracle is the artifact files, read here with ``json`` and parsed out of the Markdown here, not
through the card's own helpers.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path
from statistics import NormalDist
from typing import Any

import pytest

from fp4forge.report.card import render_card, write_card

FIXTURE = Path(__file__).parent / "fixtures" / "card" / "ckpt"
ARTIFACTS = sorted(str(p.relative_to(FIXTURE / "reports")) for p in (FIXTURE / "reports").rglob("*.json"))
# Artifacts a section cannot do without, and the section that must then say so.
SECTION_OF = {
    "bytes.json": ("Summary", "Where the bytes are"),
    "audit.json": ("Verification",),
    "shards.json": ("Verification",),
    "kv.json": ("Verification",),
    "serve-cmd.json": ("Serving",),
    "serve.json": ("Serving",),
    "bench/summary.json": ("Performance",),
    "quality/score.json": ("Quality",),
    "quality-teacher/score.json": (),  # the teacher arm's own score: the card shows the comparison
    "quality-teacher/compare.json": (),  # optional (--quality-teacher); without it no paired section
    "fidelity.json": ("Fidelity against the BF16 teacher",),
    "calibration.json": ("How it was made",),
    "quantize.json": ("How it was made",),
    "pipeline.json": (),  # the provenance table's step list; without it that table is simply absent
    "diff.json": (),  # only with a sibling; without it the verification has no diff table
}


@pytest.fixture()
def ckpt(tmp_path: Path) -> Path:
    copy = tmp_path / "tiny-laguna-nvfp4"
    shutil.copytree(FIXTURE, copy)
    return copy


def load(ckpt: Path, name: str) -> Any:
    return json.loads((ckpt / "reports" / name).read_text())


def sections(markdown: str) -> dict[str, str]:
    parts = re.split(r"^## (.+)$", markdown, flags=re.M)
    return {parts[i].strip(): parts[i + 1] for i in range(1, len(parts), 2)}


def tables(text: str) -> list[list[list[str]]]:
    """Every Markdown table in ``text``: rows of stripped cells, header first, separator dropped."""
    found, current = [], []
    for line in text.splitlines():
        if line.startswith("|"):
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
            if not all(set(c) <= {"-"} and c for c in cells):
                current.append(cells)
        elif current:
            found.append(current)
            current = []
    if current:
        found.append(current)
    return found


def number(cell: str) -> float:
    return float(cell.replace(",", "").replace("%", "").replace("*", "").strip())


def close(cell: str, value: float, rel: float = 5e-4) -> bool:
    return number(cell) == pytest.approx(value, rel=rel, abs=1e-12)


def test_card_is_written_from_the_artifacts(ckpt: Path) -> None:
    card = write_card(ckpt)
    text = (ckpt / "README.md").read_text()
    assert text == card.markdown
    assert card.missing == []
    assert list(sections(text)) == ["Verdict", "Summary", "Where the bytes are", "Verification", "Serving", "Performance", "Quality",
                                    "Fidelity against the BF16 teacher", "How it was made", "Provenance",
                                    "What this card does not claim"]
    for plot in card.plots:
        assert Path(plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert Path(plot).relative_to(ckpt).as_posix() in text


def test_summary_table(ckpt: Path) -> None:
    byte_doc, provenance = load(ckpt, "bytes.json"), json.loads((ckpt / "fp4forge.json").read_text())
    rows = dict(tables(sections(render_card(ckpt).markdown)["Summary"])[0][1:])
    assert close(rows["headline bits/param"], byte_doc["total"]["bpp"])
    assert close(rows["routed-expert bits/param"], byte_doc["experts_bpp"])
    assert number(rows["stored bytes"]) == byte_doc["total"]["bytes"]
    assert number(rows["parameters"]) == byte_doc["total"]["params"]
    assert provenance["recipe"]["name"] in rows["recipe"]
    assert rows["layout"] == provenance["layout"]
    calibration = json.loads(provenance["activation_scales"]["metadata"]["calibration"])["data"]
    assert f"{calibration['tokens']:,} tokens" in rows["activation scales"]


def test_byte_tables(ckpt: Path) -> None:
    doc = load(ckpt, "bytes.json")
    components, dtypes = tables(sections(render_card(ckpt).markdown)["Where the bytes are"])
    assert components[0] == ["component", "tensors", "bytes", "params", "bits/param", "share of bytes"]
    for row, c in zip(components[1:], doc["components"], strict=False):
        assert row[0] == c["name"]
        assert [number(row[1]), number(row[2]), number(row[3])] == [c["tensors"], c["bytes"], c["params"]]
        assert row[4] == "–" if c["bpp"] is None else close(row[4], c["bpp"])
        assert number(row[5]) == pytest.approx(c["share"] * 100, abs=0.05)
    total = components[-1]
    assert len(components) == len(doc["components"]) + 2
    assert number(total[2]) == doc["total"]["bytes"] == sum(c["bytes"] for c in doc["components"])
    assert {row[0]: (number(row[1]), number(row[2])) for row in dtypes[1:]} == {
        k: (v["tensors"], v["bytes"]) for k, v in doc["dtypes"].items()}


def test_verification_tables(ckpt: Path) -> None:
    audit, shards, kv = load(ckpt, "audit.json"), load(ckpt, "shards.json"), load(ckpt, "kv.json")
    text = sections(render_card(ckpt).markdown)["Verification"]
    rule_table, shard_table, kv_table, diff_table = tables(text)
    # one row per finding: its message and its fix, split where the audit joined them
    assert rule_table[0] == ["rule", "severity", "instances", "message", "fix"]
    assert [(r[0].strip("`"), r[1], int(r[2]), f"{r[3]} Fix: {r[4]}") for r in rule_table[1:]] == [
        (f["rule"], f["severity"], f["count"], f["message"]) for f in audit["findings"]]
    s = audit["summary"]
    assert f"{s['errors']} errors, {s['warnings']} warning{'s' if s['warnings'] != 1 else ''}" in text
    assert [(r[0].strip("`"), number(r[1]), number(r[2]), number(r[3]), r[4]) for r in shard_table[1:]] == [
        (sh["name"], sh["tensors"], sh["file_bytes"], sh["declared_end"], "yes" if sh["end_equals_size"] else "**NO**")
        for sh in shards["shards"]]
    equal = sum(sh["end_equals_size"] for sh in shards["shards"])
    assert f"{equal}/{len(shards['shards'])} shards' declared end equals the file size exactly" in text
    for row, layer in zip(kv_table[1:], kv["layers"], strict=True):
        assert row[0].strip("`") == layer["layer"]
        for cell, key in zip(row[1:], ("k_scale", "k_amax", "v_scale", "v_amax")):
            assert close(cell, layer[key], rel=1e-5), (layer["layer"], key)
    diff = load(ckpt, "diff.json")
    keys = ("identical", "different", "only_in_a", "only_in_b")
    assert {r[0]: [number(c) for c in r[1:]] for r in diff_table[1:-1]} == {
        name: [c[k] for k in keys] for name, c in diff["components"].items()}
    assert [number(c) for c in diff_table[-1][1:]] == [diff["summary"][k] for k in keys]
    assert f"{2 * len(kv['layers'])} KV scale tensors for {len(kv['layers'])} attention layers (2 per layer)" in text


def test_serving_section(ckpt: Path) -> None:
    rec, served = load(ckpt, "serve-cmd.json"), load(ckpt, "serve.json")
    text = sections(render_card(ckpt).markdown)["Serving"]
    # the recommended line, with this machine's checkpoint path replaced by $MODEL
    assert rec["command"].rstrip().replace(rec["model"], '"$MODEL"') in text
    assert f"serve {rec['model']}" not in text
    # the fixture's serve.json predates the reproducible command: its machine-specific one is not shown
    assert "/bin/vllm" not in text and "--port" not in text.split("### Served on this machine")[1]
    for note in rec["notes"]:
        assert f"- `{note['flag']}`: {note['why']}" in text
    (findings,) = tables(text)
    assert [(r[0].strip("`"), r[1]) for r in findings[1:]] == [(f["id"], f["severity"]) for f in served["findings"]]
    assert f"ready after {served['ready_seconds']:.3g} s" in text


def test_performance_table(ckpt: Path) -> None:
    summary = load(ckpt, "bench/summary.json")
    (table,) = tables(sections(render_card(ckpt).markdown)["Performance"])
    assert len(table) == len(summary["shapes"]) + 1
    for row, entry in zip(table[1:], summary["shapes"], strict=True):
        assert (row[0], row[1], int(row[2])) == (entry["shape"], entry["load"], entry["n"])
        ttft = entry["ttft_s"]
        assert close(row[3].split()[0], ttft["median"] * 1000, rel=1e-3)
        spread = [number(v) for v in row[4].split("/")]
        assert spread == pytest.approx([ttft["min"] * 1000, ttft["p10"] * 1000, ttft["p90"] * 1000, ttft["max"] * 1000], rel=1e-3)
        assert int(row[7]) == entry["n_failed"]
        assert close(row[5].split()[0], entry["median_decode_tok_s"], rel=1e-2)


def test_quality_table(ckpt: Path) -> None:
    doc = load(ckpt, "quality/score.json")
    text = sections(render_card(ckpt).markdown)["Quality"].split("### Against the BF16 teacher")[0]
    (table,) = tables(text)
    runs = doc["runs"]
    assert table[0] == ["category", *[f"run {r['run']}" for r in runs]]
    for row in table[1:-1]:
        for cell, r in zip(row[1:], runs, strict=True):
            earned, maximum = (int(v) for v in cell.split("/"))
            assert (earned, maximum) == (r["categories"][row[0]]["earned"], r["categories"][row[0]]["max"])
    assert [tuple(int(v) for v in c.split("/")) for c in table[-1][1:]] == [(r["earned"], r["max"]) for r in runs]
    (floor,) = doc["noise_floor"].values()
    assert f"spread {floor['spread_points']} points" in text
    # the totals name the maximum; "28 / 28" would read as full marks
    totals = ", ".join(str(t) for t in floor["total_per_run"])
    assert f"totals per run {totals} of {runs[0]['max']}" in text


def test_paired_comparison_with_the_teacher(ckpt: Path) -> None:
    doc = load(ckpt, "quality-teacher/compare.json")
    text = sections(render_card(ckpt).markdown)["Quality"].split("### Against the BF16 teacher (paired)")[1]
    tests_table, categories = tables(text)
    rows = dict(tests_table[1:])
    a, b = re.findall(r"[AB] (-?[\d.]+)", rows["points, mean of runs"])
    assert (float(a), float(b)) == pytest.approx((doc["points"]["A"], doc["points"]["B"]), abs=0.05)
    low, high = (float(v) for v in re.findall(r"[-+][\d.]+", rows["95 % paired bootstrap CI, mean per-scenario difference"]))
    assert (low, high) == pytest.approx(tuple(doc["bootstrap_ci"]), abs=5e-5)
    assert float(re.search(r"p = ([\d.]+)", rows["exact sign test"])[1]) == pytest.approx(doc["sign_test"]["p"], abs=5e-4)
    assert f"{doc['sign_test']['ties']} ties" in rows["exact sign test"]
    assert float(rows["exact McNemar, fully correct"].split("=")[1]) == pytest.approx(doc["mcnemar_fully_correct"]["exact_p"], abs=5e-4)
    assert rows["discordant scenarios"].startswith(f"{doc['discordant']} of {doc['scenarios']}")
    # The power is stated once: the sign test's least discordance in the lines above the table, the
    # graded test's minimum detectable effect in its row (no scenario differed: at sd(d) 0.3, computed here).
    assert text.count(f"at least {doc['power']['min_discordant']} scenarios that differ all one way") == 1
    assert not any("resolving power" in row for row in rows)
    mde = (NormalDist().inv_cdf(0.975) + NormalDist().inv_cdf(0.8)) * 0.3 / math.sqrt(doc["scenarios"])
    assert float(rows["minimum detectable mean per-scenario difference, 80 % power"].split()[0]) == pytest.approx(mde, abs=5e-4)
    assert doc["verdict"]["text"] in text
    assert [row[0] for row in categories[1:]] == list(doc["categories"])
    for row in categories[1:]:
        c = doc["categories"][row[0]]
        assert int(row[1]) == c["max"]
        assert [int(v) for v in row[2].split(",")] == c["a"] and [int(v) for v in row[3].split(",")] == c["b"]
        assert (float(row[4]), float(row[5])) == pytest.approx((c["mean_a"], c["mean_b"]), abs=0.05)


def test_fidelity_tables(ckpt: Path) -> None:
    doc = load(ckpt, "fidelity.json")
    metrics, layers = tables(sections(render_card(ckpt).markdown)["Fidelity against the BF16 teacher"])
    m = doc["metrics"]
    values = {row[0]: row[1] for row in metrics[1:]}
    assert close(values["KL(teacher ‖ student), mean"], m["kl"]["mean"], rel=1e-3)
    assert close(values["KL, median"], m["kl"]["median"], rel=1e-3)
    assert close(values["KL, p99"], m["kl"]["p99"], rel=1e-3)
    assert number(values["top-1 agreement"]) == pytest.approx(m["top1_agreement"] * 100, abs=0.05)
    assert close(values["perplexity, teacher"], m["perplexity"]["teacher"], rel=1e-4)
    assert close(values["perplexity, student"], m["perplexity"]["student"], rel=1e-4)
    for row, layer in zip(layers[1:], doc["layers"], strict=True):
        assert row[0].strip("`") == layer["layer"]
        assert close(row[1], layer["relative_error"], rel=1e-3) and close(row[2], layer["local_relative_error"], rel=1e-3)


def test_fidelity_intervals_and_unreadable_warning_on_the_card(ckpt: Path) -> None:
    """The interval column, the documents and tokens behind it, and a report scored on unreadable
    text (allowed) carried as a warning at the top of the section; an old report says it has none."""
    path = ckpt / "reports" / "fidelity.json"
    doc = json.loads(path.read_text())
    plain = sections(render_card(ckpt).markdown)["Fidelity against the BF16 teacher"]
    assert "No intervals: this report predates them" in plain
    m = doc["metrics"]
    m["intervals"] = {"kl": {"low": 0.00125, "high": 0.00175, "level": 0.95}, "top1_agreement": {"low": 0.9, "high": 0.95, "level": 0.95},
                      "teacher_perplexity": {"low": 4000.0, "high": 4400.0, "level": 0.95}, "student_perplexity": {"low": 4100.0, "high": 4500.0, "level": 0.95}}
    m |= {"documents": 6, "tokens": m["positions"], "interval_unit": "document",
          "readability": {"readable": False, "warning": "UNREADABLE TEXT, scored anyway: the teacher cannot read this text"}}
    path.write_text(json.dumps(doc))
    text = sections(render_card(ckpt).markdown)["Fidelity against the BF16 teacher"]
    assert text.lstrip().startswith("**Warning: UNREADABLE TEXT, scored anyway")
    assert "95% percentile bootstrap over 6 documents" in text and "With so few documents" in text
    rows = {row[0]: row[2] for row in tables(text)[0][1:]}
    assert rows["KL(teacher ‖ student), mean"] == "0.00125 – 0.00175" and rows["top-1 agreement"] == "90.0 % – 95.0 %"
    assert rows["perplexity, teacher"] == "4000 – 4400" and rows["KL, median"] == "–"


def test_how_it_was_made_tables(ckpt: Path) -> None:
    calibration, export = load(ckpt, "calibration.json"), load(ckpt, "quantize.json")
    calib_table, error_table = tables(sections(render_card(ckpt).markdown)["How it was made"])
    rows = dict(calib_table[1:])
    assert number(rows["tokens"]) == calibration["tokens"]
    assert int(rows["experts that saw no calibration token"]) == len(calibration["experts_without_tokens"])
    by_component = export["weight_error"]["by_component"]
    assert [row[0] for row in error_table[1:]] == list(by_component)
    for row in error_table[1:]:
        e = by_component[row[0]]
        assert number(row[1]) == e["linears"]
        assert all(close(cell, e[key], rel=1e-3) for cell, key in zip(row[2:], ("mean", "median", "max")))


def test_provenance_table(ckpt: Path) -> None:
    provenance, pipeline = json.loads((ckpt / "fp4forge.json").read_text()), load(ckpt, "pipeline.json")
    info, steps = tables(sections(render_card(ckpt).markdown)["Provenance"])
    rows = dict(info[1:])
    assert rows["fp4forge"] == provenance["fp4forge_version"]
    assert provenance["source"]["header_digest"] in rows["source"]
    assert [(r[0], r[1]) for r in steps[1:]] == [(s["name"], s["status"]) for s in pipeline["steps"] if s["name"] != "card"]


def test_non_claims_follow_from_the_artifacts(ckpt: Path) -> None:
    text = sections(render_card(ckpt).markdown)["What this card does not claim"]
    assert "not run on gb10" in text  # serve.json is a CPU run, the serve line is for gb10
    assert "vLLM's CPU build" in text
    assert "untrained" in text  # the testbed teacher's perplexity is near its vocabulary size
    silent = len(load(ckpt, "calibration.json")["experts_without_tokens"])
    assert f"{silent} routed experts saw no calibration token" in text
    assert "missing" not in text


def test_an_fp8_kv_cache_served_unquantized_is_a_non_claim(ckpt: Path) -> None:
    """serve.json of a CPU without AVX-512/AMX (the pipeline's run_serve writes kv_fallback)."""
    from fp4forge.serve.recommend import CheckpointFacts, cpu_kv_fallback

    assert "served here with an unquantized" not in sections(render_card(ckpt).markdown)["What this card does not claim"]
    facts = CheckpointFacts("LagunaForCausalLM", "compressed-tensors", ("nvfp4",), ("fp8",), "fp8", 8, 4)
    fallback = cpu_kv_fallback(facts, "cpu", fp8_kv=False)
    assert fallback is not None
    served = load(ckpt, "serve.json")
    (ckpt / "reports" / "serve.json").write_text(json.dumps({**served, "kv_fallback": fallback.to_json()}))
    text = sections(render_card(ckpt).markdown)["What this card does not claim"]
    assert "declares an FP8 KV cache, but it was served here with an unquantized bfloat16 cache" in text
    assert "`--dtype bfloat16 --kv-cache-dtype bfloat16`" in text and "not exercised" in text


@pytest.mark.parametrize("artifact", ARTIFACTS)
def test_a_deleted_artifact_is_named_as_missing(ckpt: Path, artifact: str) -> None:
    (ckpt / "reports" / artifact).unlink()
    card = render_card(ckpt)
    parts = sections(card.markdown)
    shown = f"reports/{artifact}"
    owners = SECTION_OF[artifact]
    for section in owners:
        assert f"_Not measured: `{shown}`" in parts[section], section
    if owners:
        assert f"`{shown}` is missing" in parts["What this card does not claim"]
        assert card.missing == [shown]
    elif artifact == "pipeline.json":
        assert "Made by `fp4forge pipeline`" not in parts["Provenance"]
    elif artifact.startswith("quality-teacher/"):
        assert ("Against the BF16 teacher" in parts["Quality"]) == (artifact != "quality-teacher/compare.json")
    else:
        assert "Against the sibling" not in parts["Verification"]
    others = {k: v for k, v in parts.items() if k not in (*owners, "What this card does not claim")}
    assert all("_Not measured" not in v for v in others.values())


def test_card_cli(ckpt: Path, tmp_path: Path) -> None:
    fp4forge = str(Path(sys.executable).with_name("fp4forge"))
    target = tmp_path / "card.md"
    proc = subprocess.run([fp4forge, "card", str(ckpt), "--out", str(target), "--json"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["card"] == str(target) and doc["missing"] == [] and doc["unusable"] == {}
    # the fixture's teacher cannot read its text and its reports predate intervals and power
    assert doc["verdict"]["decision"] == "not established" and doc["verdict"]["rule"].startswith("Decision rule:")
    assert [r["topic"] for r in doc["verdict"]["reasons"]] == ["audit", "served", "fidelity", "quality", "target numerics"]
    # Images are linked relative to the card's own directory.
    assert "](tiny-laguna-nvfp4/reports/plots/bytes.png)" in target.read_text()
    proc = subprocess.run([fp4forge, "card", str(tmp_path / "nowhere")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "not a directory" in proc.stderr


def test_the_card_judges_readability_against_the_vocabulary_fidelity_recorded(ckpt: Path) -> None:
    """Fidelity records the vocabulary it judged readability against (also a config's
    text_config's); the card uses that, not only config.json's top-level vocab_size."""
    path = ckpt / "reports" / "fidelity.json"
    doc = json.loads(path.read_text())
    teacher = doc["metrics"]["perplexity"]["teacher"]
    vocab = int(teacher)  # the teacher's perplexity is then over half of it: unreadable
    doc["metrics"]["readability"] = {"readable": False, "vocab_size": vocab, "warning": "UNREADABLE TEXT, scored anyway"}
    path.write_text(json.dumps(doc))
    assert f"on a {vocab:,}-token vocabulary" in render_card(ckpt).markdown
