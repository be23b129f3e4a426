"""Presentation of `fp4forge quality`: Markdown for model cards, rich tables for people.

Input is the documents built by ``fp4forge.quality.report`` / ``probes``; no statistics here.
Per-category differences are always shown next to the within-arm spread, never alone.
"""

from __future__ import annotations

from typing import Any

from rich.table import Table

from fp4forge.quality.stats import arm_floor_status
from fp4forge.report.markdown import table


def _p(value: float | None) -> str:
    return "–" if value is None else f"{value:.3f}"


def _signed(value: float | None, digits: int = 1) -> str:
    return "–" if value is None else f"{value:+.{digits}f}"


def _runs(values: list[int]) -> str:
    # a comma, not a slash: "28 / 28" reads as full marks
    return ", ".join(str(v) for v in values)


_table = table


# -- listing ------------------------------------------------------------------------------------
def listing_markdown(listing: list[dict[str, Any]]) -> str:
    rows = [[item["id"], item["category"], str(item["max_points"]), str(item["steps"]), item["summary"]] for item in listing]
    return "\n".join(_table(["id", "category", "max", "steps", "what it tests"], rows)) + "\n"


def listing_rich(listing: list[dict[str, Any]]) -> Table:
    table = Table(title=f"{len(listing)} scenarios")
    for header in ("id", "category", "max", "steps", "what it tests"):
        table.add_column(header, justify="right" if header in ("max", "steps") else "left")
    for item in listing:
        table.add_row(item["id"], item["category"], str(item["max_points"]), str(item["steps"]), item["summary"])
    return table


# -- compare ------------------------------------------------------------------------------------
def category_rows(doc: dict[str, Any]) -> list[list[str]]:
    rows = []
    for name, row in doc["categories"].items():
        within = row["within_noise"]
        rows.append([
            name, str(row["max"]), _runs(row["a"]), _runs(row["b"]), f"{row['mean_a']:.1f}", f"{row['mean_b']:.1f}",
            _signed(row["diff"]), "–" if row["within_arm_spread"] is None else str(row["within_arm_spread"]),
            "–" if within is None else ("yes" if within else "no"),
        ])
    return rows


CATEGORY_HEADERS = ["category", "max", "A per run", "B per run", "mean A", "mean B", "B − A", "within-arm spread", "within noise"]


def compare_markdown(doc: dict[str, Any]) -> str:
    arms, points, sign = doc["arms"], doc["points"], doc["sign_test"]
    floor_a, floor_b = doc["noise_floor"]["A"], doc["noise_floor"]["B"]
    low, high = doc["bootstrap_ci"]
    lines = [
        f"# Quality comparison — suite {doc['suite']['name']} {doc['suite']['version']}",
        "",
        f"**Verdict: {doc['verdict']['text']}.**",
        *[f"- {note}" for note in doc["verdict"].get("notes", [])],
        *_answers_section(doc),
        "",
        f"- A = `{arms['A']['label']}`: {_describe_arm(arms['A'])}",
        f"- B = `{arms['B']['label']}`: {_describe_arm(arms['B'])}",
        "",
        *_table(["", "A", "B"], [
            ["runs", str(doc["runs"]["A"]), str(doc["runs"]["B"])],
            ["points per run", _runs(arms["A"]["points_per_run"]), _runs(arms["B"]["points_per_run"])],
            ["mean points", f"{points['A']:.1f} / {doc['max_points']}", f"{points['B']:.1f} / {doc['max_points']}"],
            ["mean per-scenario fraction", f"{doc['mean_fraction']['A']:.3f}", f"{doc['mean_fraction']['B']:.3f}"],
            ["A/A: points spread between own runs", _floor_spread(floor_a), _floor_spread(floor_b)],
            ["A/A: scenarios that flip between own runs", _floor_flips(floor_a), _floor_flips(floor_b)],
            ["A/A: categories that moved", _floor_categories(floor_a), _floor_categories(floor_b)],
            ["failed requests", str(arms["A"]["failed_requests"]), str(arms["B"]["failed_requests"])],
        ]),
        "",
        "## Paired tests (scenarios paired, runs averaged within an arm)",
        "",
        *_table(["test", "result"], [
            ["difference B − A", f"{points['diff']:+.1f} points; mean per-scenario {doc['mean_fraction_diff']:+.4f}"],
            ["95% paired bootstrap CI (mean per-scenario difference)", f"[{low:+.4f}, {high:+.4f}] ({doc['bootstrap']['resamples']} resamples, seed {doc['bootstrap']['seed']})"],
            ["exact sign test", f"p = {_p(sign['p'])}: {sign['favours_a']} favour A, {sign['favours_b']} favour B, {sign['ties']} ties"],
            ["sign-flip permutation", f"p = {_p(doc['sign_flip_p'])}"],
            ["exact McNemar, fully correct in every run", f"p = {_p(doc['mcnemar_fully_correct']['exact_p'])} (b = {doc['mcnemar_fully_correct']['b']}, c = {doc['mcnemar_fully_correct']['c']})"],
            ["discordant scenarios", f"{doc['discordant']} of {doc['scenarios']} ({doc['discordance_rate']:.1%}); {doc['flips_also_within_arm']} also flip within an arm"],
        ]),
        "",
        "## Per category (descriptive: ~4 scenarios each cannot support a per-category test)",
        "",
        *_table(CATEGORY_HEADERS, category_rows(doc)),
        "",
        "## Flip list (scenarios whose score differs between the arms)",
        "",
        *_flip_table(doc),
    ]
    lines += [
        "",
        *_power_section(doc),
        "",
        "## Defects reported beside the score (scenarios affected, per run)",
        "",
        *_table(["flag", "A", "B"], [
            [key, _runs([f[key] for f in arms["A"]["flags_per_run"]]), _runs([f[key] for f in arms["B"]["flags_per_run"]])]
            for key in arms["A"]["flags_per_run"][0]
        ]),
    ]
    if doc.get("warnings"):
        lines += ["", "## Warnings", "", *[f"- {w}" for w in doc["warnings"]]]
    return "\n".join(lines) + "\n"


def _flip_table(doc: dict[str, Any]) -> list[str]:
    if not doc["flips"]:
        return ["None: every scenario earned the same points in both arms."]
    return _table(["scenario", "category", "max", "A per run", "B per run", "favours", "flips within A", "flips within B"], [
        [f["id"], f["category"], str(f["max"]), _runs(f["a"]), _runs(f["b"]), f["favours"],
         "yes" if f["flips_within_a"] else "no", "yes" if f["flips_within_b"] else "no"] for f in doc["flips"]
    ])


def _power_section(doc: dict[str, Any]) -> list[str]:
    power = doc["power"]
    return [
        f"## What {doc['scenarios']} scenarios can detect",
        "",
        *[f"- {line}" for line in power_lines(power)],
        "- Graded scores, 80% power: minimum detectable mean difference "
        + (f"{power['mde_80']:.3f} at the observed sd(d) = {power['sd_diff']:.3f}; " if power["mde_80"] is not None else "")
        + ", ".join(f"{v:.3f} at sd {k}" for k, v in power["mde_80_by_sd"].items()) + ".",
        "",
        *_table(["discordance ψ", "share favouring one arm q", "gap δ", "power"],
                [[f"{row['psi']:.3f}", f"{row['q']:.1f}", f"{row['delta']:.3f}", f"{row['power']:.2f}"] for row in power["sign_test"]]),
    ]


def power_lines(power: dict[str, Any]) -> list[str]:
    """The comparison's power statement as sentences (``compare.json``'s ``power``), for the
    comparison's Markdown and the model card alike; a document without one says so."""
    if "min_discordant" not in power:
        return ["This comparison states no power (written by an older fp4forge): re-run `fp4forge quality compare`."]
    floor = power["floor"]
    lines = [f"A/A {floor['why']}."]
    if floor.get("applied_band"):  # which band the difference of means was held against (older documents: none)
        lines.append(f"A/A band: {floor['applied_band']['why']}.")
    if power["floor_effect"]:
        lines.append(f"**Floor effect** (both arms below {power['floor_effect_level']:.0%}): {power['floor_effect']}.")
    lines.append(f"Power: {power['text']}.")
    if power["power_at_observed"]:
        lines.append("Sign test's power at the observed discordance ψ = " + f"{power['observed_discordance']:.3f}: " + ", ".join(
            f"{row['power']:.2f} when {row['q']:.0%} of discordant scenarios favour one arm (gap δ = {row['delta']:.3f})"
            for row in power["power_at_observed"]) + ".")
    if power["descriptive_categories"]:
        lines.append("Per-category tables are descriptive: a few scenarios per category support no per-category test.")
    return lines


def _describe_arm(arm: dict[str, Any]) -> str:
    endpoint, request = arm.get("endpoint") or {}, arm.get("request") or {}
    extras = [f"{k}={v}" for k, v in request.items() if k not in ("temperature", "max_tokens", "tool_choice") and v not in (None, {}, "")]
    return (f"model `{endpoint.get('model')}` at {endpoint.get('base_url')} (server {endpoint.get('server_version') or 'version unknown'}), "
            f"temperature {request.get('temperature')}, max_tokens {request.get('max_tokens')}" + (", " + ", ".join(extras) if extras else ""))


def _floor_spread(floor: dict[str, Any]) -> str:
    return "– (1 run)" if not floor["measured"] else f"{floor['spread_points']} (totals {_runs(floor['total_per_run'])})"


def _floor_flips(floor: dict[str, Any]) -> str:
    return "– (1 run)" if not floor["measured"] else str(len(floor["flipping_scenarios"]))


def _floor_categories(floor: dict[str, Any]) -> str:
    return "– (1 run)" if not floor["measured"] else f"{floor['categories_moved']} of {len(floor['categories'])}"


def compare_rich(doc: dict[str, Any]) -> Table:
    caption = "\n".join([doc["verdict"]["text"], *power_lines(doc.get("power") or {})]).replace("**", "")  # the power beside the verdict
    table = Table(title=f"A = {doc['arms']['A']['label']}, B = {doc['arms']['B']['label']}", caption=caption)
    for header in CATEGORY_HEADERS:
        table.add_column(header, justify="left" if header == "category" else "right")
    for row in category_rows(doc):
        table.add_row(*row)
    table.add_row("total", str(doc["max_points"]), _runs(doc["arms"]["A"]["points_per_run"]), _runs(doc["arms"]["B"]["points_per_run"]),
                  f"{doc['points']['A']:.1f}", f"{doc['points']['B']:.1f}", _signed(doc["points"]["diff"]), "", "", style="bold")
    return table


# -- readable answers ---------------------------------------------------------------------------
ANSWER_HEADERS = ["arm", "answered turns", "cut at max_tokens", "reasoning only", "empty", "unread", "with parsed tool calls"]


def answers_headline(doc: dict[str, Any]) -> list[str]:
    """The refusal (or the override's warning) as the first thing a reader sees; nothing if scored."""
    block = doc.get("answers") or {}
    if block.get("refused"):
        return ["**REFUSED TO SCORE: the suite could not read the answers.** " + " ".join(f"{r}." for r in block["unreadable"])
                + " The points below are evidence of that, not a score of the model (docs/quality.md#unreadable-answers).", ""]
    if block.get("allowed"):
        return ["**WARNING: scored although the answers are unreadable** (override). " + " ".join(f"{r}." for r in block["unreadable"]), ""]
    return []


def answers_rows(doc: dict[str, Any]) -> list[list[str]]:
    rows = []
    for arm, h in ((doc.get("answers") or {}).get("arms") or {}).items():
        rows.append([arm, str(h["turns"]), str(h["truncated"]), str(h["reasoning_only"]), str(h["empty"]),
                     f"{h['unread']} ({h['unread_share']:.0%})", str(h["with_calls"])])
    return rows


def _answers_section(doc: dict[str, Any]) -> list[str]:
    rows = answers_rows(doc)
    if not rows:
        return []
    return ["", "## Could the suite read the answers? (turns)", "", *_table(ANSWER_HEADERS, rows)]


# -- score --------------------------------------------------------------------------------------
def score_markdown(doc: dict[str, Any]) -> str:
    runs = doc["runs"]
    lines = [f"# Quality scores — suite {doc['suite']['name']} {doc['suite']['version']}", "", *answers_headline(doc)]
    lines += _table(["transcript", "arm", "run", "complete", "earned / max", "fully correct", "failed requests"], [
        [r["path"], r["arm"], str(r["run"]), "yes" if r["complete"] else "NO", f"{r['earned']} / {r['max']}",
         f"{r['scenarios_fully_correct']} / {r['scenarios']}", str(r["failed_requests"])] for r in runs
    ])
    lines += _answers_section(doc)
    categories = list(runs[0]["categories"]) if runs else []
    lines += ["", "## Per category (earned / max)", ""]
    lines += _table(["category", *[f"{r['arm']} run {r['run']}" for r in runs]], [
        [c, *[f"{r['categories'][c]['earned']} / {r['categories'][c]['max']}" for r in runs]] for c in categories
    ])
    lines += ["", "## Defects reported beside the score (scenarios affected)", ""]
    flag_keys = list(runs[0]["flags"]) if runs else []
    lines += _table(["flag", *[f"{r['arm']} run {r['run']}" for r in runs]], [[k, *[str(r["flags"][k]) for r in runs]] for k in flag_keys])
    kinds = sorted({k for r in runs for k in r["errors"]})
    lines += ["", "## Scoring errors by kind", ""]
    lines += _table(["kind", *[f"{r['arm']} run {r['run']}" for r in runs]], [[k, *[str(r["errors"].get(k, 0)) for r in runs]] for k in kinds])
    for arm, floor in doc["noise_floor"].items():
        lines += ["", f"## Noise floor of arm {arm} ({floor['runs']} runs)", "",
                  f"- totals per run {_runs(floor['total_per_run'])} (spread {floor['spread_points']} points);",
                  f"- {len(floor['flipping_scenarios'])} scenarios flip: {', '.join(floor['flipping_scenarios']) or 'none'};",
                  f"- {floor['categories_moved']} of {len(floor['categories'])} categories moved;",
                  f"- {arm_floor_status(floor, [r.get('request') or {} for r in runs if r.get('arm') == arm])['why']}."]
    warnings = [w for r in runs for w in r["warnings"]]
    if warnings:
        lines += ["", "## Warnings", "", *[f"- {w}" for w in warnings]]
    return "\n".join(lines) + "\n"


def score_rich(doc: dict[str, Any]) -> Table:
    runs = doc["runs"]
    block = doc.get("answers") or {}
    caption = None
    if block.get("refused") or block.get("allowed"):
        caption = ("REFUSED TO SCORE: " if block.get("refused") else "UNREADABLE ANSWERS, scored anyway: ") + "; ".join(block["unreadable"])
    table = Table(title="earned / max per category", caption=caption, caption_style="bold red")
    table.add_column("category")
    for r in runs:
        table.add_column(f"{r['arm']} run {r['run']}", justify="right")
    for category in (runs[0]["categories"] if runs else {}):
        table.add_row(category, *[f"{r['categories'][category]['earned']} / {r['categories'][category]['max']}" for r in runs])
    table.add_row("total", *[f"{r['earned']} / {r['max']}" for r in runs], style="bold")
    return table


# -- probes -------------------------------------------------------------------------------------
def _kl_row(name: str, block: dict[str, Any]) -> list[str]:
    if not block.get("positions"):
        return [name, "0", "–", "–", "–", "–", "–"]
    pct = block["kl_lower_bound_percentiles"]
    return [name, str(block["positions"]), f"{block['kl_lower_bound_mean']:.4g} ± {block['kl_lower_bound_se']:.2g}",
            f"{pct['50']:.3g} / {pct['90']:.3g} / {pct['99']:.3g}", f"{block['top1_agreement']:.3f}",
            f"{block['mean_abs_delta_p']:.3g}", f"{block['mean_shared_tokens']:.1f}"]


KL_HEADERS = ["comparison", "positions", "KL lower bound, mean ± SE", "p50 / p90 / p99", "top-1 agreement", "mean |Δp|", "tokens in S"]


def kl_markdown(doc: dict[str, Any]) -> str:
    arms = doc["arms"]
    lines = [
        "# KL between arms (teacher-forced, over the API)",
        "",
        f"**{doc['verdict']}.**",
        "",
        f"- A: `{arms['A']['model']}` at {arms['A']['base_url']}; B: `{arms['B']['model']}` at {arms['B']['base_url']}.",
        f"- {doc['sequences']} fixed token sequences ({sum(doc['sequence_tokens'])} tokens), scored with `{doc['mode']}`, top-{doc['top_k']}.",
        f"- Estimator: {doc['estimator']}. It is a **lower bound** on the true KL, not an estimate of it.",
        "",
        *_table(KL_HEADERS, [
            _kl_row("within A (A twice)", doc["within_a"]),
            _kl_row("within B (B twice)", doc["within_b"]),
            _kl_row("between (A pass 1 vs B pass 1)", doc["between"]),
            _kl_row("between (A pass 2 vs B pass 2)", doc["between_repeat"]),
        ]),
    ]
    return "\n".join(lines) + "\n"


def kl_rich(doc: dict[str, Any]) -> Table:
    table = Table(title="Teacher-forced KL (top-k lower bound)", caption=doc["verdict"])
    for header in KL_HEADERS:
        table.add_column(header, justify="left" if header == "comparison" else "right")
    for name, key in (("within A", "within_a"), ("within B", "within_b"), ("between", "between"), ("between (repeat)", "between_repeat")):
        table.add_row(*_kl_row(name, doc[key]))
    return table


def determinism_markdown(doc: dict[str, Any]) -> str:
    forced, greedy = doc["teacher_forced"], doc["greedy"]
    fraction = forced["bitwise_stable_fraction"]
    lines = [
        "# Determinism at temperature 0",
        "",
        f"- Endpoint: `{doc['endpoint']['model']}` at {doc['endpoint']['base_url']}; {doc['sequences']} prompts × {doc['replicates']} replicates, sent one at a time.",
        f"- Teacher-forced ({doc['mode']}, top-{doc['top_k']}): **{forced['bitwise_stable']} of {forced['positions']} positions bitwise stable**"
        + ("" if fraction is None else f" ({fraction:.2%})") + f" across all replicates; prompts where only the first (cold) replicate differs: "
        f"{forced['sequences_where_only_the_cold_replicate_differs']}.",
        f"- Greedy, {doc['max_tokens']} tokens, EOS ignored: **{greedy['diverged']} of {greedy['replicate_pairs']} replicates diverge** from the first"
        + ("" if greedy["diverged_fraction"] is None else f" ({greedy['diverged_fraction']:.1%})")
        + f"; within the first 2 tokens: {greedy['diverged_within_2_tokens']}; median first divergence: "
        + ("–" if greedy["median_first_divergence"] is None else f"token {greedy['median_first_divergence']:.0f}")
        + "; median top-1/top-2 logprob gap at the divergence: "
        + ("–" if greedy["median_top2_gap_at_divergence"] is None else f"{greedy['median_top2_gap_at_divergence']:.3g}") + ".",
        f"- Generated positions before any divergence with bitwise-identical top-{doc['top_k']} logprobs: "
        f"{greedy['bitwise_stable_generated_positions']} of {greedy['generated_positions']}.",
        "",
        "First divergent token (replicates vs the first):",
        "",
        *_table(["token", "replicates"], [[k, str(v)] for k, v in greedy["first_divergence_histogram"].items()]
                + [["never", str(greedy["replicate_pairs"] - greedy["diverged"])]]),
    ]
    return "\n".join(lines) + "\n"
