"""The model card: Markdown assembled only from artifacts that exist.

Every number on the card comes from a file under ``reports/`` (or the checkpoint's own
``config.json`` / ``fp4forge.json``); a section whose artifact is missing, corrupt or left from an
earlier run (``card_artifacts``) says so and lands in "What this card does not claim". Nothing here
measures anything.

The card opens with its verdict (``card_verdict``: ship / do not ship / not established, one line
per report); ``SECTIONS`` is the rest of its outline: title, the artifacts a section needs, and its
renderer.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fp4forge.audit.findings import split_fix
from fp4forge.checkpoint.atomic import write_text_atomic
from fp4forge.checkpoint.names import CONFIG_JSON, PROVENANCE_JSON
from fp4forge.errors import ConfigError
from fp4forge.report.card_artifacts import Artifacts, server_life
from fp4forge.report.card_metadata import front_matter
from fp4forge.fidelity.readable import UNREADABLE_PERPLEXITY_SHARE
from fp4forge.report.card_verdict import Verdict, card_verdict, fidelity_vocab_size, verdict_lines
from fp4forge.report.plotting import pyplot
from fp4forge.report.markdown import interval_text, table

PLOTS = "plots"
# Fewer resampled documents than this and a bootstrap interval is said to be rough (a percentile
# bootstrap over few clusters covers less than its level).
FEW_INTERVAL_UNITS = 10


@dataclass
class Card:
    markdown: str
    sections: list[str]
    missing: list[str]  # every artifact the card could not quote (missing, corrupt or stale)
    plots: list[str]
    verdict: Verdict | None = None
    problems: dict[str, str] = field(default_factory=dict)  # artifact -> why it was not quoted


Renderer = Callable[["CardContext"], list[str]]


@dataclass
class CardContext:
    art: Artifacts
    card_dir: Path
    plots: list[str] = field(default_factory=list)
    non_claims: list[str] = field(default_factory=list)
    base_model: str | None = None  # the Hub repository id the front matter names

    def plot_dir(self) -> Path:
        path = self.art.reports / PLOTS
        path.mkdir(parents=True, exist_ok=True)
        return path

    def image(self, path: Path, alt: str) -> str:
        self.plots.append(str(path))
        return f"![{alt}]({self.art.relative(path, self.card_dir)})"


def _missing(ctx: CardContext, *names: str) -> list[str]:
    """A section without its artifacts: each named as missing, corrupt or stale, as it is."""
    problems = [(ctx.art.display(n), ctx.art.problems.get(ctx.art.display(n), "missing")) for n in names]
    if all(problem == "missing" for _, problem in problems):
        shown = ", ".join(f"`{name}`" for name, _ in problems)
        return [f"_Not measured: {shown} {'is' if len(names) == 1 else 'are'} missing, so this section states nothing._"]
    shown = "; ".join(f"`{name}` is {problem}" for name, problem in problems)
    return [f"_Not measured: {shown}; so this section states nothing._"]


def _num(value: float | None, digits: int = 4) -> str:
    return "–" if value is None else f"{value:.{digits}g}"


def _int(value: int | None) -> str:
    return "–" if value is None else f"{value:,}"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _pct(value: float | None) -> str:
    return "–" if value is None else f"{value * 100:.1f} %"


# -- sections -----------------------------------------------------------------------------------
def summary_section(ctx: CardContext) -> list[str]:
    provenance = ctx.art.json(f"ckpt:{PROVENANCE_JSON}")
    config = ctx.art.json(f"ckpt:{CONFIG_JSON}")
    byte_doc = ctx.art.json("bytes.json")
    if provenance is None or byte_doc is None:
        return _missing(ctx, *[n for n, d in ((f"ckpt:{PROVENANCE_JSON}", provenance), ("bytes.json", byte_doc)) if d is None])
    recipe = provenance.get("recipe", {})
    kv = provenance.get("kv_cache") or {}
    rows = [
        ["base model", _base_model_cell(ctx, provenance)],
        ["architecture", ", ".join((config or {}).get("architectures", [])) or "–"],
        ["recipe", f"`{recipe.get('name', '–')}` ({recipe.get('source', '–')})"],
        ["layout", provenance.get("layout", "–")],
        ["KV cache", f"{kv.get('scheme', 'not quantized')}" + (f", scales for {kv['layers']} layers" if kv.get("layers") else "")],
        ["headline bits/param", _num(byte_doc["total"]["bpp"], 4)],
        ["routed-expert bits/param", _num(byte_doc.get("experts_bpp"), 4)],
        ["stored bytes", _int(byte_doc["total"]["bytes"])],
        ["parameters", _int(byte_doc["total"]["params"])],
        ["activation scales", _activation_source(provenance)],
    ]
    return table(["", ""], rows)


def _base_model_cell(ctx: CardContext, provenance: dict[str, Any]) -> str:
    location = f"`{provenance.get('source', {}).get('location', '–')}`"
    if ctx.base_model is None or ctx.base_model == provenance.get("source", {}).get("location"):
        return location if ctx.base_model is None else f"[{ctx.base_model}](https://huggingface.co/{ctx.base_model})"
    return f"[{ctx.base_model}](https://huggingface.co/{ctx.base_model}), exported from {location}"


def _activation_source(provenance: dict[str, Any]) -> str:
    scales = provenance.get("activation_scales") or {}
    if scales.get("source") == "calibration":
        data = json.loads(scales.get("metadata", {}).get("calibration", "{}")).get("data", {})
        return f"calibrated on {_int(data.get('tokens'))} tokens ({data.get('samples', '–')} × {data.get('seq_len', '–')})"
    if scales.get("source"):
        return f"{scales['source']} (not calibrated)"
    return "none"


def bytes_section(ctx: CardContext) -> list[str]:
    doc = ctx.art.json("bytes.json")
    if doc is None:
        return _missing(ctx, "bytes.json")
    rows = [[c["name"], _int(c["tensors"]), _int(c["bytes"]), _int(c["params"]), _num(c["bpp"], 4), _pct(c["share"])]
            for c in doc["components"]]
    rows.append(["**total**", _int(sum(c["tensors"] for c in doc["components"])), _int(doc["total"]["bytes"]),
                 _int(doc["total"]["params"]), _num(doc["total"]["bpp"], 4), "100.0 %"])
    lines = table(["component", "tensors", "bytes", "params", "bits/param", "share of bytes"], rows)
    dtype_rows = [[dtype, _int(v["tensors"]), _int(v["bytes"])] for dtype, v in doc["dtypes"].items()]
    lines += ["", *table(["dtype", "tensors", "bytes"], dtype_rows)]
    plot = _plot_bytes(doc, ctx.plot_dir() / "bytes.png")
    if plot:
        lines += ["", ctx.image(plot, "share of stored bytes by component")]
    if doc.get("unknown_tensors"):
        lines += ["", f"{len(doc['unknown_tensors'])} tensors match no component of layout `{doc['layout']}`."]
    return lines


def _audit_lines(ctx: CardContext) -> list[str]:
    """The audit's counts, then every finding with its message and its fix."""
    audit = ctx.art.json("audit.json")
    if audit is None:
        return ["### Audit", "", *_missing(ctx, "audit.json")]
    s = audit["summary"]
    a = audit.get("audit", {})
    lines = ["### Audit", "", f"`fp4forge audit` ({'deep: every value read' if a.get('deep') else 'headers only'}; "
             f"target vLLM {a.get('vllm_version', '–')}; layout `{a.get('layout', '–')}`): "
             f"**{_count(s['errors'], 'error')}, {_count(s['warnings'], 'warning')}, {_count(s['infos'], 'info')}**.", ""]
    if audit["findings"]:
        lines += table(["rule", "severity", "instances", "message", "fix"], [
            [f"`{f['rule']}`", f["severity"], _int(f.get("count", 1)), *(_cell(part or "–") for part in split_fix(f["message"]))]
            for f in audit["findings"]
        ])
    return lines


def verification_section(ctx: CardContext) -> list[str]:
    lines = _audit_lines(ctx)
    shards = ctx.art.json("shards.json")
    lines += ["", "### Shards and index", ""]
    if shards is None:
        lines += _missing(ctx, "shards.json")
    else:
        ok = sum(1 for sh in shards["shards"] if sh["end_equals_size"])
        lines += [f"{ok}/{len(shards['shards'])} shards' declared end equals the file size exactly; "
                  f"{_int(shards['tensors'])} tensors.", ""]
        lines += table(["shard", "tensors", "file bytes", "declared end", "equal"], [
            [f"`{sh['name']}`", _int(sh["tensors"]), _int(sh["file_bytes"]), _int(sh["declared_end"]), "yes" if sh["end_equals_size"] else "**NO**"]
            for sh in shards["shards"]
        ])
        index = shards["index"]
        if index.get("present"):
            lines += ["", f"Index: {_int(index['entries'])} entries, {index['entries_not_in_their_shard']} pointing at the wrong shard, "
                      f"{index['tensors_not_in_index']} tensors missing from it; `total_size` {_int(index['total_size'])} "
                      f"(shard data {_int(index['shard_data_bytes'])} bytes)."]
        else:
            lines += ["", "No index file (single shard)."]
    kv = ctx.art.json("kv.json")
    lines += ["", "### FP8 KV-cache scales", ""]
    if kv is None:
        lines += _missing(ctx, "kv.json")
    elif not kv["layers"]:
        lines += ["The checkpoint ships no KV-cache scales."]
    else:
        count = sum(1 for layer in kv["layers"] for role in ("k_scale", "v_scale") if layer.get(role) is not None)
        lines += [f"{count} KV scale tensors for {len(kv['layers'])} attention layers ({count / len(kv['layers']):g} per layer), "
                  f"layout `{kv['layout']}`, declared in the config: {'yes' if kv['declared'] else '**no**'}.", ""]
        lines += table(["layer", "k_scale", "k amax", "v_scale", "v amax"], [
            [f"`{layer['layer']}`", _num(_first(layer.get("k_scale")), 6), _num(_first(layer.get("k_amax")), 6),
             _num(_first(layer.get("v_scale")), 6), _num(_first(layer.get("v_amax")), 6)] for layer in kv["layers"]
        ])
        for f in kv["findings"]:
            lines.append(f"- **{f['severity']}**: {f['message']}")
    if ctx.art.exists("diff.json"):
        lines += _diff_lines(ctx)
    return lines


def _diff_lines(ctx: CardContext) -> list[str]:
    diff = ctx.art.json("diff.json")
    lines = ["", "### Against the sibling checkpoint", ""]
    if diff is None:
        return lines + _missing(ctx, "diff.json")
    lines += [f"`fp4forge diff` against `{diff.get('sibling', '–')}` (blake2b of every tensor's raw bytes):", ""]
    rows = [[name, *(_int(c.get(k)) for k in DIFF_COLUMNS)] for name, c in diff.get("components", {}).items()]
    rows.append(["**total**", *(_int(diff.get("summary", {}).get(k)) for k in DIFF_COLUMNS)])
    return lines + table(["component", "identical", "different", "only here", "only in the sibling"], rows)


DIFF_COLUMNS = ("identical", "different", "only_in_a", "only_in_b")


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _first(value: float | list[float] | None) -> float | None:
    return max(value) if isinstance(value, list) else value


SERVER_ROLES = (("student", "this checkpoint"), ("teacher", "the BF16 teacher"))
MODEL_NOTE = "`$MODEL` is the model's directory (or Hugging Face repo id); port and served name are fixed defaults."


def _portable_target_line(rec: dict[str, Any]) -> str:
    """The recommended line with the checkpoint's path (this machine's) replaced by ``$MODEL``."""
    import shlex

    command = rec["command"].rstrip()
    model = rec.get("model")
    if model:
        command = command.replace(shlex.quote(model), '"$MODEL"').replace(model, "$MODEL")
    return command


def _findings_table(findings: list[dict[str, Any]]) -> list[str]:
    return table(["finding", "severity", "line", "message"], [
        [f"`{f['id']}`", f["severity"], str(f.get("line", "–")), _cell(f["message"])] for f in findings
    ])


def _env_lines(env: dict[str, str] | None) -> list[str]:
    from fp4forge.serve.launcher import LAUNCHER_ONLY_ENV

    shown = {k: v for k, v in (env or {}).items() if k not in LAUNCHER_ONLY_ENV}
    if not shown:
        return []
    return ["", "The environment it ran with (set by fp4forge, part of the command above): "
            + ", ".join(f"`{k}={v}`" for k, v in shown.items()) + "."]


def serve_section(ctx: CardContext) -> list[str]:
    rec = ctx.art.json("serve-cmd.json")
    lines: list[str] = []
    if rec is None:
        lines += _missing(ctx, "serve-cmd.json")
    else:
        lines += [f"For **{rec['hardware']}** with vLLM {rec['vllm_version']} (`fp4forge serve cmd --hardware {rec['hardware']}`):", "",
                  "```bash", _portable_target_line(rec), "```", "", MODEL_NOTE, ""]
        numerics = rec.get("numerics")
        if numerics:
            lines += [f"MoE numerics of this line: **{numerics['activations'].upper()}**, MoE input scale "
                      f"**{numerics['moe_input_scale']}** ({numerics['moe_backend'].upper()} on {numerics['target']}).", ""]
        lines += [f"- `{n['flag']}`: {n['why']}" for n in rec["notes"]]
        lines += [f"- **warning**: {w}" for w in rec["warnings"]]
    served = ctx.art.json("serve.json")
    if rec is not None and (served is None or served.get("hardware") != rec["hardware"]):
        ctx.non_claims.append(f"The serve line for {rec['hardware']} comes from fp4forge's knowledge table for vLLM "
                              f"{rec['vllm_version']}; it was not run on {rec['hardware']} for this card.")
    lines += ["", "### Served on this machine", ""]
    lives = {role: life for role, _ in SERVER_ROLES if (life := server_life(ctx.art, role)) is not None}
    if served is None:
        lines += _missing(ctx, "serve.json")
        ctx.non_claims.append("The checkpoint was not served here: nothing on this card shows that vLLM loads it.")
    else:
        fallback = served.get("kv_fallback")
        if fallback:
            ctx.non_claims.append(f"The checkpoint declares an {fallback['declared'].upper()} KV cache, but it was served here with "
                                  f"an unquantized {fallback['served_dtype']} cache (`{' '.join(fallback['argv'])}`): this CPU "
                                  "cannot run vLLM's FP8 KV cache (it needs AVX-512 or AMX), so the calibrated k/v scales "
                                  "were not exercised by the serving, performance or quality results on this card.")
        if served.get("verdict"):
            lines += [f"The log doctor's verdict: `{_verdict(served)}`", ""]
        lines += [f"vLLM {served['vllm_version']} on `{served['hardware']}`, ready after {_num(served['ready_seconds'], 3)} s; "
                  f"the log doctor's findings at start-up (`fp4forge serve doctor reports/{served['log']}`):", ""]
        lines += table(["finding", "severity", "message"], [
            [f"`{f['id']}`", f["severity"], _cell(f["message"])] for f in served["findings"]
        ])
        student_life = lives.get("student") or {}
        command = served.get("reproducible_command") or student_life.get("command")
        if command:
            lines += ["", "The command that was run (reproducible: the same flags and environment):", "", "```bash", command, "```", "",
                      MODEL_NOTE]
            lines += _env_lines(served.get("env") or student_life.get("env"))
        elif isinstance(served.get("command"), list):
            ctx.non_claims.append("The serve command that was run was recorded by an older fp4forge, with this machine's paths "
                                  "and without its environment: it is not shown.")
    lines += _server_lives(ctx, lives, served is not None)
    return lines


def _verdict(served: dict[str, Any]) -> str:
    """The doctor's verdict line (serve/doctor.py), fit for a code span."""
    return str(served["verdict"]["summary"]).replace("`", "'")


def _server_lives(ctx: CardContext, lives: dict[str, dict[str, Any] | None], served: bool) -> list[str]:
    """Each server's whole life: what it served, and what its log says after it became ready."""
    if not lives:
        if served:
            ctx.non_claims.append("The servers' logs after start-up were not kept (no `reports/servers/`): errors during "
                                  "benchmarking or quality runs would not show on this card.")
        return []
    lines = ["", "### Each server's whole life", "",
             "Every line each server logged, from start to stop, is kept in `reports/servers/`; the log doctor read all of it.", ""]
    served = []  # (role, what, life, its findings after readiness, the errors among them)
    for role, what in SERVER_ROLES:
        if life := lives.get(role):
            after = life.get("findings_after_ready", [])
            served.append((role, what, life, after, [f for f in after if f["severity"] == "error"]))
    rows = []
    for role, what, life, after, errors in served:
        rows.append([f"{role} ({what})", f"vLLM {life.get('vllm_version') or '–'}", _num(life.get("ready_seconds"), 3),
                     ", ".join(life.get("served_steps", [])) or "–", _int(life.get("log_lines")),
                     f"{_count(len(errors), 'error')}" + "".join(f"; `{f['id']}` ({f['severity']})" for f in after if f["severity"] != "error"),
                     f"[`servers/{life['log']}`](reports/servers/{life['log']})"])
    lines += table(["server", "version", "ready after s", "served steps", "log lines", "findings after ready", "log"], rows)
    lines += [""] + [f"* {role}: the log doctor's verdict over its whole log: `{_verdict(life)}`"
                     for role, _, life, _, _ in served if life.get("verdict")]
    for role, what, life, after, errors in served:
        if errors:
            steps = ", ".join(life.get("served_steps", [])) or "its steps"
            lines += ["", f"**The {role} server logged {_count(len(errors), 'error')} after it became ready** (while serving {steps}):", ""]
            lines += _findings_table(errors)
            ctx.non_claims.append(f"The {role} server ({what}) logged errors while it served {steps} "
                                  f"(reports/servers/{life['log']}): results of those steps may be affected.")
        if role == "teacher":
            lines += _teacher_lines(life)
    return lines


def _teacher_lines(life: dict[str, Any]) -> list[str]:
    """The teacher: the unquantized reference arm, its command and what its log said at start-up."""
    lines = ["", f"The BF16 teacher ({life.get('model', '–')}), the unquantized reference arm, was served with:", "",
             "```bash", life["command"], "```", "", MODEL_NOTE.replace("the model's directory", "the teacher's directory")]
    lines += _env_lines(life.get("env"))
    startup = life.get("startup_findings", [])
    source = ("read again from its kept log by this fp4forge's log doctor" if life.get("reread")
              else "as recorded when it stopped (its log is not kept, so they were not read again)")
    lines += ["", f"Its log doctor's findings at start-up ({source}):", ""]
    return lines + (_findings_table(startup) if startup else ["none."])


def performance_section(ctx: CardContext) -> list[str]:
    summary = ctx.art.json("bench/summary.json")
    if summary is None:
        ctx.non_claims.append("No serving performance was measured.")
        return _missing(ctx, "bench/summary.json")
    from fp4forge.report.bench_tables import SUMMARY_COLUMNS, notes, summary_rows

    run = summary.get("run") or {}
    lines = [f"`fp4forge bench perf`, workload `{run.get('workload', '–')}`; every kept request is in "
             "`reports/bench/samples.jsonl`. Medians with 95 % CIs; p10–p90 spread; bimodal cells are named.", ""]
    lines += table(list(SUMMARY_COLUMNS), [[c.replace("|", "\\|") for c in row] for row in summary_rows(summary)])
    lines += ["", *[f"- {line}" for line in notes(summary)]]
    for png in sorted((ctx.art.reports / "bench").glob("*.png")):
        lines += ["", ctx.image(png, png.stem.replace("_", " "))]
    ctx.non_claims += _performance_non_claims(summary)
    served = ctx.art.json("serve.json") if ctx.art.exists("serve.json") else None
    if served and served.get("hardware") == "cpu":
        ctx.non_claims.append("Performance was measured on vLLM's CPU build with fp4forge's emulation plugin: it says nothing "
                              "about GPU kernels' speed.")
    return lines


def _performance_non_claims(summary: dict[str, Any]) -> list[str]:
    """What the speed figures cannot say: no host recorded, no order test possible."""
    from fp4forge.bench.stats import ORDER_CORRELATION_LIMIT

    claims = []
    if not (summary.get("run") or {}).get("host"):
        claims.append("The machine the speed was measured on (CPU, cores, load) was not recorded: the figures have no context.")
    ordered = [e["load"] for e in summary.get("order", []) if e["order_correlation"] is None or abs(e["order_correlation"]) >= ORDER_CORRELATION_LIMIT]
    if ordered or "order" not in summary:
        claims.append("No speed trend across context is claimed where the shapes ran in an order that follows context, or in an "
                      "unrecorded order" + (f" (load {', '.join(ordered)})" if ordered else "") + ": such a trend cannot be told from drift.")
    return claims


def quality_section(ctx: CardContext) -> list[str]:
    doc = ctx.art.json("quality/score.json")
    if doc is None:
        ctx.non_claims.append("Agentic tool-use quality was not measured.")
        return _missing(ctx, "quality/score.json")
    from fp4forge.report.quality_tables import ANSWER_HEADERS, answers_headline, answers_rows

    runs = doc["runs"]
    answers = doc.get("answers") or {}
    lines = [*answers_headline(doc)]
    if answers.get("refused"):
        ctx.non_claims.append("Agentic tool-use quality was not measured: the suite could not read most answers "
                              "(see the Quality section), so no score on this card describes the model.")
    elif answers.get("allowed"):
        ctx.non_claims.append("The quality scores were taken from unreadable answers (override): they measure the serving "
                              "format, not the model.")
    request = (runs[0].get("request") or {}) if runs else {}
    read = "streamed" if request.get("stream") else "non-streamed"
    lines += [f"`fp4forge quality run`, suite `{doc['suite']['name']}` {doc['suite']['version']}, {len(runs)} run(s), "
              f"max_tokens {request.get('max_tokens')}, answers read {read}:", ""]
    if answers_rows(doc):
        lines += table(ANSWER_HEADERS, answers_rows(doc)) + [""]
    categories = list(runs[0]["categories"]) if runs else []
    rows = [[c, *[f"{r['categories'][c]['earned']} / {r['categories'][c]['max']}" for r in runs]] for c in categories]
    rows.append(["**total**", *[f"{r['earned']} / {r['max']}" for r in runs]])
    lines += table(["category", *[f"run {r['run']}" for r in runs]], rows)
    lines += _score_floor_lines(ctx, doc)
    plot = _plot_quality(doc, ctx.plot_dir() / "quality.png")
    if plot:
        lines += ["", ctx.image(plot, "score per category and run")]
    if ctx.art.exists("quality-teacher/compare.json"):
        lines += ["", "### Against the BF16 teacher (paired)", "", *_compare_lines(ctx, ctx.art.json("quality-teacher/compare.json") or {})]
    else:
        ctx.non_claims.append("No paired quality comparison against the BF16 teacher was run (pipeline `--quality-teacher`).")
    return lines


def _score_floor_lines(ctx: CardContext, doc: dict[str, Any]) -> list[str]:
    """Each arm's A/A floor, and whether its runs could measure one (greedy runs repeat themselves)."""
    from fp4forge.quality.stats import arm_floor_status

    runs = doc["runs"]
    of_max = f" of {runs[0]['max']}" if runs else ""  # "28 / 28" would read as full marks
    lines: list[str] = []
    for arm, floor in doc.get("noise_floor", {}).items():
        status = arm_floor_status(floor, [r.get("request") or {} for r in runs if r.get("arm") == arm])
        lines += ["", f"Noise floor (arm {arm}, {floor['runs']} runs): totals per run "
                  f"{', '.join(str(t) for t in floor['total_per_run'])}{of_max}, "
                  f"spread {floor['spread_points']} points; {len(floor['flipping_scenarios'])} scenarios flip; "
                  f"{floor['categories_moved']} of {len(floor['categories'])} categories moved: {status['why']}."]
        if not status["measured"]:
            ctx.non_claims.append(f"Quality's noise floor (arm {arm}): {status['why']}.")
    if not doc.get("noise_floor"):
        ctx.non_claims.append("Quality ran once: its noise floor is unknown.")
    return lines


def detectable_effect_cell(doc: dict[str, Any]) -> str | None:
    """The smallest mean per-scenario difference the paired test detects with 80 % power
    (docs/quality.md#resolving-power-on-the-shipped-testbed); the sign test's least discordance is
    in the power lines above the table, so it is not repeated here."""
    power = doc["power"]
    if power.get("mde_80") is not None:
        mde, spread = power["mde_80"], f"the observed sd(d) {power['sd_diff']:.3f}"
    elif power.get("mde_80_by_sd"):
        mde, spread = power["mde_80_by_sd"]["0.3"], "sd(d) 0.3 (no scenario differed, so none was observed)"
    else:
        return None
    return f"{mde:.3f} (about {mde * doc['max_points']:.0f} of {doc['max_points']} points) at {spread}"


def _compare_lines(ctx: CardContext, doc: dict[str, Any]) -> list[str]:
    from fp4forge.report.quality_tables import CATEGORY_HEADERS, category_rows, power_lines

    arms, points, sign = doc["arms"], doc["points"], doc["sign_test"]
    low, high = doc["bootstrap_ci"]
    power = doc.get("power") or {}
    lines = [f"A = `{arms['A']['label']}`, B = `{arms['B']['label']}`, {doc['runs']['A']} and {doc['runs']['B']} runs of "
             f"{doc['scenarios']} scenarios. **Verdict: {doc['verdict']['text']}.**", ""]
    lines += [f"- {line}" for line in power_lines(power)] + [""]
    if doc["verdict"].get("ordering") == "none" and doc["verdict"].get("label") != "refused":
        ctx.non_claims.append(f"The paired quality comparison ({doc['verdict'].get('label')}) is not evidence of no regression"
                              + (f": {power['text']}." if power.get("text") else " (it states no power)."))
    mde = detectable_effect_cell(doc) if power else None
    lines += table(["test", "result"], [
        ["points, mean of runs", f"A {points['A']:.1f}, B {points['B']:.1f} of {doc['max_points']}; B − A {points['diff']:+.1f}"],
        ["95 % paired bootstrap CI, mean per-scenario difference", f"[{low:+.4f}, {high:+.4f}]"],
        ["exact sign test", f"p = {sign['p']:.3f} ({sign['favours_a']} favour A, {sign['favours_b']} favour B, {sign['ties']} ties)"],
        ["exact McNemar, fully correct", f"p = {doc['mcnemar_fully_correct']['exact_p']:.3f}"],
        ["discordant scenarios", f"{doc['discordant']} of {doc['scenarios']}; {doc['flips_also_within_arm']} also flip within an arm"],
        *([["minimum detectable mean per-scenario difference, 80 % power", mde]] if mde else []),
    ])
    from fp4forge.report.quality_tables import ANSWER_HEADERS, answers_rows

    if answers_rows(doc):  # both arms: how many turns the suite could read
        lines += ["", *table(ANSWER_HEADERS, answers_rows(doc))]
    lines += ["", "Per category (descriptive):", "",
              *table(list(CATEGORY_HEADERS), category_rows(doc))]
    lines += ["", *_flip_lines(doc)]
    plot = ctx.art.reports / "quality-teacher" / "category_scores.png"
    if plot.is_file():
        lines += ["", ctx.image(plot, "score per category, quantized vs teacher")]
    return lines


def _flip_lines(doc: dict[str, Any]) -> list[str]:
    """The flip list: every scenario whose score differs between the arms."""
    flips = doc.get("flips") or []
    if not flips:
        return ["Flip list: none (every scenario earned the same points in both arms)."]
    cells = [f"`{f['id']}` ({f['category']}, favours {f['favours']}"
             + (", also flips within an arm" if f["flips_within_a"] or f["flips_within_b"] else "") + ")" for f in flips]
    return [f"Flip list ({len(flips)} scenarios whose score differs between the arms): " + "; ".join(cells) + "."]


def fidelity_section(ctx: CardContext) -> list[str]:
    doc = ctx.art.json("fidelity.json")
    if doc is None:
        ctx.non_claims.append("Fidelity against the BF16 teacher was not measured.")
        return _missing(ctx, "fidelity.json")
    m = doc["metrics"]
    vocab = fidelity_vocab_size(ctx, m)
    warning = (m.get("readability") or {}).get("warning")
    if vocab and m["perplexity"]["teacher"] >= UNREADABLE_PERPLEXITY_SHARE * vocab:
        ctx.non_claims.append(f"The teacher's perplexity ({m['perplexity']['teacher']:.0f}) is near its vocabulary size ({vocab}): "
                              "on this text it predicts no better than chance. Either it is untrained (a random testbed) or the "
                              "text is far from what it learned (a trained testbed knows only its own corpus); either way "
                              "KL and top-1 on this text say little about a real model.")
    served = doc.get("served_numerics")
    moe = (f"MoE input scales `{doc['moe_input_scale']}`, the serve target's: {served['describe']}" if served
           else f"MoE input scales `{doc.get('moe_input_scale', 'global-max')}`")
    lines = [f"**Warning: {warning}.**", ""] if warning else []
    lines += [f"`fp4forge fidelity`, numerics `{doc['numerics']}`, {moe}; {_int(m['positions'])} positions of "
              f"{', '.join(doc['data']['sources'])} ({doc['data']['samples']} × {doc['data']['seq_len']} tokens); KV cache: {doc['kv_cache']}.",
              "", _fidelity_interval_note(m), ""]
    intervals = m.get("intervals") or {}
    ppl = m["perplexity"]
    lines += table(["metric", "value", "interval"], [
        ["KL(teacher ‖ student), mean", _num(m["kl"]["mean"], 4), interval_text(intervals.get("kl"), _num, cell=True)],
        ["KL, median", _num(m["kl"]["median"], 4), "–"],
        ["KL, p99", _num(m["kl"]["p99"], 4), "–"],
        ["top-1 agreement", _pct(m["top1_agreement"]), interval_text(intervals.get("top1_agreement"), _pct, cell=True)],
        ["perplexity, teacher", _num(ppl["teacher"], 5), interval_text(intervals.get("teacher_perplexity"), _num, cell=True)],
        ["perplexity, student", _num(ppl["student"], 5), interval_text(intervals.get("student_perplexity"), _num, cell=True)],
    ])
    lines += ["", *table(["layer", "relative error (cumulative)", "relative error (this layer alone)"], [
        [f"`{layer['layer']}`", _num(layer["relative_error"], 4), _num(layer["local_relative_error"], 4)] for layer in doc["layers"]
    ])]
    return lines


def _fidelity_interval_note(m: dict[str, Any]) -> str:
    """What the fidelity intervals resample and how many units there were."""
    intervals = m.get("intervals")
    if not intervals:
        return "No intervals: this report predates them (re-run `fp4forge fidelity`)."
    level = next(iter(intervals.values()))["level"]
    documents = m.get("documents") or 0
    note = (f"Intervals: {level:.0%} percentile bootstrap over {_count(documents, 'document')} ({_int(m.get('tokens'))} predicted "
            "tokens), each number recomputed over the drawn units (docs/fidelity.md#intervals).")
    if documents < FEW_INTERVAL_UNITS:
        note += " With so few documents the interval is rough and likely too narrow: more held-out text narrows and steadies it."
    return note


def making_section(ctx: CardContext) -> list[str]:
    lines: list[str] = ["### Calibration", ""]
    calibration = ctx.art.json("calibration.json")
    if calibration is None:
        lines += _missing(ctx, "calibration.json")
    else:
        silent = calibration.get("experts_without_tokens", [])
        lines += table(["", ""], [
            ["tokens", _int(calibration["tokens"])],
            ["MoE policy", calibration.get("moe_policy", "–")],
            ["statistics tensors", _int(calibration["tensors"])],
            ["experts that saw no calibration token", str(len(silent))],
        ])
        if silent:
            ctx.non_claims.append(f"{len(silent)} routed experts saw no calibration token; their activation scales are not "
                                  "calibrated from their own inputs (reports/calibration.json lists them).")
    lines += ["", "### Weight error of the export", ""]
    export = ctx.art.json("quantize.json")
    if export is None:
        lines += _missing(ctx, "quantize.json")
    else:
        lines += [f"`fp4forge quantize`: {_int(export['tensors_written'])} tensors, {_int(export['bytes_written'])} bytes written. "
                  "Relative Frobenius error of each dequantized weight:", ""]
        lines += table(["component:scheme", "linears", "mean", "median", "max"], [
            [name, _int(e["linears"]), _num(e["mean"], 4), _num(e["median"], 4), _num(e["max"], 4)]
            for name, e in export["weight_error"]["by_component"].items()
        ])
    return lines


def provenance_section(ctx: CardContext) -> list[str]:
    provenance = ctx.art.json(f"ckpt:{PROVENANCE_JSON}")
    lines: list[str] = []
    if provenance is None:
        lines += _missing(ctx, f"ckpt:{PROVENANCE_JSON}")
    else:
        source = provenance.get("source", {})
        lines += table(["", ""], [
            ["fp4forge", provenance.get("fp4forge_version", "–")],
            ["source", f"`{source.get('location', '–')}`, header digest `{source.get('header_digest', '–')}`"],
            ["recipe", f"`{provenance.get('recipe', {}).get('source', '–')}`"],
            ["options", ", ".join(f"{k}={v}" for k, v in provenance.get("options", {}).items())],
            ["ignored modules", str(len(provenance.get("ignored_modules", [])))],
        ])
    pipeline = ctx.art.json("pipeline.json") if ctx.art.exists("pipeline.json") else None
    if pipeline is not None:
        lines += ["", f"Made by `fp4forge pipeline` (fp4forge {pipeline['fp4forge_version']}); steps:", ""]
        lines += table(["step", "status", "seconds", "why not run"], [
            [s["name"], s["status"], "–" if s["seconds"] is None else f"{s['seconds']:.1f}",
             _cell(s.get("message") or "") if s["status"] not in ("done", "skipped") else ""]
            for s in pipeline["steps"] if s["name"] != "card"
        ])
    return lines


def non_claims_section(ctx: CardContext) -> list[str]:
    lines = [f"- `{name}` is {ctx.art.problems.get(name, 'missing')}; the card states nothing that it would have measured."
             for name in ctx.art.missing]
    lines += [f"- {claim}" for claim in dict.fromkeys(ctx.non_claims)]
    return lines or ["- Every section above comes from a measured artifact."]


@dataclass(frozen=True)
class Section:
    key: str
    title: str
    render: Renderer


SECTIONS: tuple[Section, ...] = (
    Section("summary", "Summary", summary_section),
    Section("bytes", "Where the bytes are", bytes_section),
    Section("verification", "Verification", verification_section),
    Section("serve", "Serving", serve_section),
    Section("performance", "Performance", performance_section),
    Section("quality", "Quality", quality_section),
    Section("fidelity", "Fidelity against the BF16 teacher", fidelity_section),
    Section("making", "How it was made", making_section),
    Section("provenance", "Provenance", provenance_section),
    Section("non_claims", "What this card does not claim", non_claims_section),
)


def _report_links(ctx: CardContext, first_read: int) -> list[str]:
    """Links to the reports a section quoted (those it read since ``first_read`` that exist)."""
    quoted = [n for n in dict.fromkeys(ctx.art.reads[first_read:]) if not n.startswith("ckpt:") and ctx.art.json_exists(n)]
    links = [f"[`{ctx.art.display(n)}`]({ctx.art.relative(ctx.art.path(n), ctx.card_dir)})" for n in quoted]
    return [f"Reports: {', '.join(links)}", ""] if links else []


def render_card(checkpoint: Path, reports: Path | None = None, card_path: Path | None = None, base_model: str | None = None) -> Card:
    checkpoint = Path(checkpoint)
    reports = Path(reports) if reports is not None else checkpoint / "reports"
    card_dir = (card_path or checkpoint / "README.md").parent
    ctx = CardContext(Artifacts(checkpoint, reports), card_dir)
    provenance = ctx.art.json(f"ckpt:{PROVENANCE_JSON}") if ctx.art.exists(f"ckpt:{PROVENANCE_JSON}") else None
    config = ctx.art.json(f"ckpt:{CONFIG_JSON}") if ctx.art.exists(f"ckpt:{CONFIG_JSON}") else None
    metadata, ctx.base_model, unstated = front_matter(checkpoint, provenance, config, base_model)
    ctx.non_claims += unstated
    name = checkpoint.resolve().name
    description = ((provenance or {}).get("recipe") or {}).get("name")
    verdict = card_verdict(ctx)  # first: a reader who stops at the first screen knows it
    lines = [metadata + f"# {name}", "", "## Verdict", "", *verdict_lines(ctx, verdict), "",
             f"Recipe `{description}`. " if description else "",
             "Generated by `fp4forge card` from the artifacts in `reports/`; every number comes from one of them.", ""]
    for section in SECTIONS:
        first_read = len(ctx.art.reads)
        body = _render_section(ctx, section, first_read)
        lines += [f"## {section.title}", "", *body, "", *_report_links(ctx, first_read)]
    return Card("\n".join(lines).rstrip() + "\n", ["verdict", *(s.key for s in SECTIONS)], list(ctx.art.missing), ctx.plots,
                verdict, dict(ctx.art.problems))


def _render_section(ctx: CardContext, section: Section, first_read: int) -> list[str]:
    """A section's body; a report without the fields it reads is named, never a traceback."""
    try:
        return section.render(ctx)
    except (KeyError, TypeError, IndexError, AttributeError, ValueError) as error:
        read = ", ".join(f"`{ctx.art.display(n)}`" for n in dict.fromkeys(ctx.art.reads[first_read:])) or "its reports"
        ctx.non_claims.append(f"The {section.title} section states nothing: {read} lack what it reads "
                              f"({type(error).__name__}: {error}); corrupt, or written by another fp4forge version.")
        return [f"_Not stated: {read} lack what this section reads ({type(error).__name__}: {error})._"]


@dataclass(frozen=True)
class CardOptions:
    """The card job's options (`fp4forge card`, the pipeline's card step)."""

    reports: Path | None = None  # the artifacts directory (default: CHECKPOINT/reports)
    out: Path | None = None  # the card to write (default: CHECKPOINT/README.md)
    base_model: str | None = None  # the Hub repository of the source (default: what the source says)

    def __post_init__(self) -> None:
        if self.base_model is not None and (not self.base_model.strip() or any(c.isspace() for c in self.base_model)):
            raise ConfigError(f"not a Hub repository id: {self.base_model!r}", option="base_model")


def card_options(**given: Any) -> CardOptions:
    """The card's options, from `fp4forge card` or the pipeline: the one place either makes them."""
    return CardOptions(**given)


def write_card(checkpoint: Path, options: CardOptions = CardOptions()) -> Card:
    """The card job: the model card of ``checkpoint``, from its measured artifacts only."""
    out = Path(options.out) if options.out is not None else Path(checkpoint) / "README.md"
    card = render_card(checkpoint, options.reports, out, options.base_model)
    write_text_atomic(out, card.markdown)
    return card


# -- plots --------------------------------------------------------------------------------------
def _plot_bytes(doc: dict[str, Any], path: Path) -> Path | None:
    plt = pyplot()
    if plt is None:
        return None
    components = [c for c in doc["components"] if c["bytes"]]
    figure, axis = plt.subplots(figsize=(7.5, 0.35 * len(components) + 1.4))
    names = [c["name"] for c in components][::-1]
    shares = [c["share"] * 100 for c in components][::-1]
    bars = axis.barh(names, shares, color="tab:blue")
    for bar, c in zip(bars, components[::-1]):
        label = f"{_num(c['bpp'], 3)} b/p" if c["bpp"] is not None else ""
        axis.text(bar.get_width() + 0.5, bar.get_y() + bar.get_height() / 2, label, va="center", fontsize=8)
    axis.set_xlim(0, max(shares, default=0) * 1.25 + 1)  # room for the right-hand labels inside the axes
    axis.set_xlabel("share of stored bytes (%)")
    axis.set_title(f"Where the bytes are: {_num(doc['total']['bpp'], 4)} bits/param overall", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def _plot_quality(doc: dict[str, Any], path: Path) -> Path | None:
    plt = pyplot()
    runs = doc["runs"]
    if plt is None or not runs:
        return None
    categories = list(runs[0]["categories"])
    figure, axis = plt.subplots(figsize=(max(8.0, 0.6 * len(categories) + 2), 4.2))
    width = 0.8 / len(runs)
    for i, r in enumerate(runs):
        values = [r["categories"][c]["earned"] / (r["categories"][c]["max"] or 1) for c in categories]
        axis.bar([x + (i - (len(runs) - 1) / 2) * width for x in range(len(categories))], values, width, label=f"run {r['run']}")
    axis.set_xticks(range(len(categories)), categories, rotation=40, ha="right", fontsize=8)
    axis.set_ylim(0, 1.05)
    axis.set_ylabel("earned / max")
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
