"""The model card's verdict: ship, do not ship, or not established, and why, from the artifacts.

Five lines, each from the report behind it (linked): the audit, the server run here, fidelity
against the teacher, quality against the teacher, the serving target's numerics. Each line either
*holds*, is *not established* or says *do not ship*; the card's verdict is the worst line. The rule
(``DECISION_RULE``, printed on the card and in docs/pipeline.md#the-verdict):

* **do not ship**: an audit error; a server that did not come up or logged errors at start-up; a
  fidelity interval wholly beyond its level; the teacher scoring higher in the paired comparison.
* **not established**: a report missing, corrupt or left from an earlier run; a headers-only audit;
  not served here, or errors logged after readiness; fidelity on text the teacher cannot read,
  without an interval, or with an interval that straddles its level; quality without the paired
  comparison, refused, without its stated power, or at the floor of the suite; the target's
  numerics unrecorded or not the ones fidelity measured.
* **ship**: every line holds. A line that holds still names what it rests on (warnings, the
  smallest difference the quality suite could have detected, the hardware served on).

Older artifacts lack the intervals and the power statement: they read as "not established".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fp4forge.audit.findings import split_fix
from fp4forge.checkpoint.names import CONFIG_JSON
from fp4forge.fidelity.readable import UNREADABLE_PERPLEXITY_SHARE
from fp4forge.report.card_artifacts import server_life
from fp4forge.report.markdown import interval_bounds, interval_text

if TYPE_CHECKING:
    from fp4forge.report.card import CardContext

HOLDS, NOT_ESTABLISHED, DO_NOT_SHIP = "holds", "not established", "do not ship"
SHIP = "ship"
ORDER = (HOLDS, NOT_ESTABLISHED, DO_NOT_SHIP)
# Fidelity levels a shippable export stays inside: bounds of the stored 95 % intervals. Levels, not
# measurements: a working 4-bit export of a language model stays well inside both, an export with
# wrong scales or a dropped tensor falls far outside. An interval across a level is not established.
KL_MEAN_MAX = 0.10  # nats per predicted token, KL(teacher ‖ student)
TOP1_AGREEMENT_MIN = 0.85
COMPARE = "quality-teacher/compare.json"
NUMERICS_KEYS = ("target", "moe_backend", "activations", "moe_input_scale")
MESSAGE_CHARS = 240  # a finding's message on the verdict line (the audit table has it whole)

DECISION_RULE = (
    "Decision rule: any audit error, a server that failed or logged errors at start-up, a fidelity interval "
    f"wholly beyond its level (mean KL > {KL_MEAN_MAX:g}, top-1 agreement < {TOP1_AGREEMENT_MIN:.0%}) or the "
    "teacher scoring higher → **do not ship**; else a missing, corrupt or stale report, no server run here, "
    "fidelity or quality without an interval or stated power, text the teacher cannot read, an interval across "
    "its level, or a suite at its floor → **not established**; **ship** only when every line holds."
)


@dataclass(frozen=True)
class Reason:
    topic: str
    state: str  # HOLDS | NOT_ESTABLISHED | DO_NOT_SHIP
    text: str
    reports: tuple[str, ...] = ()  # artifact names (as Artifacts reads them) the line rests on


@dataclass(frozen=True)
class Verdict:
    decision: str  # SHIP | NOT_ESTABLISHED | DO_NOT_SHIP
    reasons: tuple[Reason, ...]

    def to_json(self) -> dict[str, Any]:
        return {"decision": self.decision, "rule": DECISION_RULE,
                "reasons": [{"topic": r.topic, "state": r.state, "text": r.text, "reports": list(r.reports)} for r in self.reasons]}


def decide(reasons: list[Reason]) -> Verdict:
    worst = max((r.state for r in reasons), key=ORDER.index, default=NOT_ESTABLISHED)
    return Verdict(SHIP if worst == HOLDS else worst, tuple(reasons))


def card_verdict(ctx: CardContext) -> Verdict:
    lines = (("audit", audit_reason), ("served", served_reason), ("fidelity", fidelity_reason), ("quality", quality_reason),
             ("target numerics", target_reason))
    return decide([_guarded(ctx, topic, reason) for topic, reason in lines])


def _guarded(ctx: CardContext, topic: str, reason: Any) -> Reason:
    """One line; a report without the fields it reads leaves it not established, never a traceback."""
    try:
        return reason(ctx)
    except (KeyError, TypeError, IndexError, AttributeError, ValueError) as error:
        return Reason(topic, NOT_ESTABLISHED, f"its report lacks what this line reads ({type(error).__name__}: {error}): "
                      "corrupt, or written by another fp4forge version.")


def _unusable(ctx: CardContext, name: str, topic: str, what: str) -> Reason:
    problem = ctx.art.problems.get(ctx.art.display(name), "missing")
    return Reason(topic, NOT_ESTABLISHED, f"`{ctx.art.display(name)}` is {problem}; {what}.")


def _short(message: str) -> str:
    """A finding's message without its fix, cut for the verdict line."""
    text = split_fix(str(message))[0]
    return text if len(text) <= MESSAGE_CHARS else text[: MESSAGE_CHARS - 1].rstrip() + "…"


def _messages(findings: list[dict[str, Any]]) -> str:
    return "; ".join(f"`{f.get('rule') or f.get('id')}`: {_short(f.get('message', ''))}" for f in findings)


# -- the five lines -------------------------------------------------------------------------------
def audit_reason(ctx: CardContext) -> Reason:
    doc = ctx.art.json("audit.json")
    if doc is None:
        return _unusable(ctx, "audit.json", "audit", "nothing on this card shows the checkpoint is well-formed")
    findings = doc.get("findings") or []
    errors = [f for f in findings if f.get("severity") == "error"]
    warnings = [f for f in findings if f.get("severity") == "warning"]
    run = doc.get("audit") or {}
    scope = f"{'deep' if run.get('deep') else 'headers only'}, target vLLM {run.get('vllm_version', '–')}"
    read = f" Warnings: {_messages(warnings)}." if warnings else " No warnings."
    if errors:
        return Reason("audit", DO_NOT_SHIP, f"{len(errors)} error(s) ({scope}): {_messages(errors)}.{read}", ("audit.json",))
    if not run.get("deep"):
        return Reason("audit", NOT_ESTABLISHED, f"no errors, but headers only: no tensor value was read (`audit --deep`).{read}",
                      ("audit.json",))
    return Reason("audit", HOLDS, f"no errors ({scope}).{read}", ("audit.json",))


def served_reason(ctx: CardContext) -> Reason:
    served = ctx.art.json("serve.json")
    if served is None:
        return _unusable(ctx, "serve.json", "served", "not served here, so nothing on this card shows that vLLM loads it")
    verdict = served.get("verdict") or {}
    line = f" The log doctor: `{str(verdict.get('summary', '')).replace('`', chr(39))}`." if verdict else " (No doctor's verdict line recorded.)"
    where = f"vLLM {served.get('vllm_version', '–')} on `{served.get('hardware', '–')}`"
    errors = [f for f in served.get("findings") or [] if f.get("severity") == "error"]
    if errors or (verdict and verdict.get("state") != "ready"):
        return Reason("served", DO_NOT_SHIP, f"{where} did not come up cleanly.{line} {_messages(errors)}".rstrip(), ("serve.json",))
    life = server_life(ctx.art, "student")
    late = [f for f in (life or {}).get("findings_after_ready") or [] if f.get("severity") == "error"]
    reports = ("serve.json", "servers/student.json") if life else ("serve.json",)
    if late:
        return Reason("served", NOT_ESTABLISHED, f"{where} came up, then logged errors while serving "
                      f"{', '.join(life.get('served_steps') or []) or 'its steps'}: {_messages(late)}.{line}", reports)
    target = (ctx.art.json("serve-cmd.json") or {}).get("hardware") if ctx.art.exists("serve-cmd.json") else None
    elsewhere = f" Not on the target `{target}`." if target and target != served.get("hardware") else ""
    ready = f", ready after {served['ready_seconds']:.0f} s" if isinstance(served.get("ready_seconds"), (int, float)) else ""
    return Reason("served", HOLDS, f"{where}{ready}.{line}{elsewhere}", reports)


def _against_level(low: float, high: float, *, at_most: float | None = None, at_least: float | None = None) -> str:
    """An interval against a level: wholly inside holds, wholly beyond is do-not-ship, across is open."""
    if at_most is not None:
        return HOLDS if high <= at_most else DO_NOT_SHIP if low > at_most else NOT_ESTABLISHED
    assert at_least is not None
    return HOLDS if low >= at_least else DO_NOT_SHIP if high < at_least else NOT_ESTABLISHED


def fidelity_reason(ctx: CardContext) -> Reason:
    doc = ctx.art.json("fidelity.json")
    if doc is None:
        return _unusable(ctx, "fidelity.json", "fidelity", "KL and top-1 against the teacher were not measured")
    m = doc.get("metrics") or {}
    kl, top1 = (m.get("kl") or {}).get("mean"), m.get("top1_agreement")
    point = f"mean KL {kl:.4g}, top-1 agreement {top1:.1%}" if kl is not None and top1 is not None else "no KL or top-1"
    unreadable = _unreadable_text(ctx, m)
    if unreadable:
        return Reason("fidelity", NOT_ESTABLISHED, f"{point}, on text the teacher cannot read: {unreadable}.", ("fidelity.json",))
    intervals = m.get("intervals") or {}
    kl_ci, top1_ci = interval_bounds(intervals.get("kl")), interval_bounds(intervals.get("top1_agreement"))
    if kl_ci is None or top1_ci is None:
        return Reason("fidelity", NOT_ESTABLISHED, f"{point} without an interval: not established: no interval.", ("fidelity.json",))
    states = [_against_level(*kl_ci[:2], at_most=KL_MEAN_MAX), _against_level(*top1_ci[:2], at_least=TOP1_AGREEMENT_MIN)]
    size = ", ".join(f"{m[k]:,} {k}" for k in ("documents", "tokens") if isinstance(m.get(k), int))
    text = (f"mean KL {kl:.4g} {interval_text(intervals['kl'], '{:.4g}'.format)}, "
            f"top-1 agreement {top1:.1%} {interval_text(intervals['top1_agreement'], '{:.1%}'.format)} "
            f"({kl_ci[2]:.0%} intervals{', ' + size if size else ''}); levels: KL ≤ {KL_MEAN_MAX:g}, top-1 ≥ {TOP1_AGREEMENT_MIN:.0%}.")
    return Reason("fidelity", max(states, key=ORDER.index), text, ("fidelity.json",))


def fidelity_vocab_size(ctx: CardContext, metrics: dict[str, Any]) -> int | None:
    """The vocabulary size fidelity judged readability against (its ``readability`` block, which
    also finds a ``text_config``'s), else the checkpoint config's, for reports older than it."""
    recorded = (metrics.get("readability") or {}).get("vocab_size")
    return recorded or (ctx.art.json(f"ckpt:{CONFIG_JSON}") or {}).get("vocab_size")


def _unreadable_text(ctx: CardContext, metrics: dict[str, Any]) -> str | None:
    """Why the teacher cannot read the fidelity text (its perplexity near its vocabulary), or None."""
    teacher = (metrics.get("perplexity") or {}).get("teacher")
    vocab = fidelity_vocab_size(ctx, metrics)
    if not vocab and ctx.art.json(f"ckpt:{CONFIG_JSON}") is None:
        return f"its vocabulary size is unknown (`{CONFIG_JSON}` is {ctx.art.problems.get(CONFIG_JSON, 'missing')})"
    if teacher is None or not vocab:
        return "the teacher's perplexity or the vocabulary size is not recorded"
    if teacher >= UNREADABLE_PERPLEXITY_SHARE * vocab:
        return f"teacher perplexity {teacher:.0f} on a {vocab:,}-token vocabulary (over {UNREADABLE_PERPLEXITY_SHARE:.0%} of it)"
    return None


def quality_reason(ctx: CardContext) -> Reason:
    if not ctx.art.exists(COMPARE):
        what = "quality ran without" if ctx.art.exists("quality/score.json") else "quality was not measured, nor"
        return Reason("quality", NOT_ESTABLISHED, f"{what} the paired comparison against the BF16 teacher (`--quality-teacher`).")
    doc = ctx.art.json(COMPARE)
    if doc is None:
        return _unusable(ctx, COMPARE, "quality", "no comparison against the teacher can be quoted")
    verdict, power = doc.get("verdict") or {}, doc.get("power") or {}
    said = f"{verdict.get('text', verdict.get('label', 'no verdict'))} ({doc.get('discordant', '–')} of {doc.get('scenarios', '–')} scenarios discordant)"
    if verdict.get("label") == "refused":
        return Reason("quality", NOT_ESTABLISHED, f"refused: {said}.", (COMPARE,))
    if verdict.get("ordering") == "B>A":  # the pipeline's arms: A this checkpoint, B the teacher
        return Reason("quality", DO_NOT_SHIP, f"the teacher scores higher: {said}.", (COMPARE,))
    if not isinstance(power.get("min_discordant"), int):
        return Reason("quality", NOT_ESTABLISHED, f"{said}; power not stated: what difference the suite could detect is unknown.", (COMPARE,))
    floor = power.get("floor") or {}
    detect = (f"a difference needs at least {power['min_discordant']} one-way discordant scenarios of {doc.get('scenarios', '–')} "
              "to be detected" + ("" if floor.get("measured") else f"; {floor.get('why') or 'A/A floor not measured'}"))
    if power.get("floor_effect"):
        return Reason("quality", NOT_ESTABLISHED, f"{said}; at the suite's floor: {power['floor_effect']}; {detect}.", (COMPARE,))
    return Reason("quality", HOLDS, f"no regression the suite can detect: {said}; {detect}.", (COMPARE,))


def target_reason(ctx: CardContext) -> Reason:
    rec = ctx.art.json("serve-cmd.json")
    if rec is None:
        return _unusable(ctx, "serve-cmd.json", "target numerics", "no serve line for the target hardware")
    where = f"`{rec.get('hardware', '–')}` with vLLM {rec.get('vllm_version', '–')}"
    warned = f" Serve-line warnings: {'; '.join(_short(w) for w in rec['warnings'])}." if rec.get("warnings") else ""
    if "numerics" not in rec:
        return Reason("target numerics", NOT_ESTABLISHED, f"{where}: its MoE numerics are not recorded (older `serve-cmd.json`).{warned}",
                      ("serve-cmd.json",))
    numerics = rec["numerics"]
    if numerics is None:
        return Reason("target numerics", HOLDS, f"{where}: no NVFP4 routed experts, no MoE numerics to match.{warned}", ("serve-cmd.json",))
    target = _describe(numerics)
    fidelity = ctx.art.json("fidelity.json") if ctx.art.exists("fidelity.json") else None
    measured = (fidelity or {}).get("served_numerics")
    reports = ("serve-cmd.json", "fidelity.json") if fidelity else ("serve-cmd.json",)
    if measured is None:
        return Reason("target numerics", NOT_ESTABLISHED, f"{where} runs {target}; fidelity did not record that it measured these numerics.{warned}", reports)
    if any(measured.get(k) != numerics.get(k) for k in NUMERICS_KEYS):
        return Reason("target numerics", NOT_ESTABLISHED, f"{where} runs {target}, but fidelity measured {_describe(measured)}: "
                      f"its numbers are not this target's.{warned}", reports)
    return Reason("target numerics", HOLDS, f"{where} runs {target}, the numerics fidelity measured.{warned}", reports)


def _describe(numerics: dict[str, Any]) -> str:
    return (f"MoE {str(numerics.get('activations', '–')).upper()}, input scale {numerics.get('moe_input_scale', '–')} "
            f"({str(numerics.get('moe_backend', '–')).upper()} on {numerics.get('target', '–')})")


# -- the block --------------------------------------------------------------------------------------
def verdict_lines(ctx: CardContext, verdict: Verdict) -> list[str]:
    """The card's first screen: the decision, one line per reason (linking its reports), the rule."""
    lines = [f"**{verdict.decision.upper()}.** " + _why(verdict), ""]
    for r in verdict.reasons:
        links = ", ".join(f"[`{ctx.art.display(n)}`]({ctx.art.relative(ctx.art.path(n), ctx.card_dir)})" for n in r.reports)
        lines.append(f"- **{r.topic}: {r.state}**{f' ({links})' if links else ''}: {r.text}")
    return [*lines, "", DECISION_RULE]


def _why(verdict: Verdict) -> str:
    if verdict.decision == SHIP:
        return "Every line below holds."
    decisive = [r.topic for r in verdict.reasons if r.state == verdict.decision]
    return f"Decided by: {', '.join(decisive)}."
