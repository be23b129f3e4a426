"""The trained testbed in one call: generate the corpus, train the tiny Laguna, cache by content.

``build_trained_laguna`` writes a fresh directory. ``trained_laguna_cache_key`` hashes everything
the result depends on: the generator and training code (source bytes of each module involved,
the chat template, the tool catalogue), the generated corpus itself, the tokenizer, the training
and corpus settings, the seed and the torch/transformers/tokenizers versions. ``cached_trained_laguna``
returns ``$FP4FORGE_CACHE_DIR/trained-laguna/<key>/model`` (default ``~/.cache/fp4forge``),
building it there first when it is missing, so ``make test`` and ``make demo`` train once per
change. It lives in the lab, above ``quality`` and ``testbed``, because it needs both.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import sys
from dataclasses import asdict, dataclass
from importlib import metadata, resources
from pathlib import Path
from typing import Any

from fp4forge.errors import ConfigError
from fp4forge.lab.trained import training, training_corpus
from fp4forge.lab.trained.training_corpus import Corpus, CorpusSpec, build_corpus
from fp4forge.lab.trained.training import Progress, TrainingConfig, TrainingResult, train_laguna

CACHE_FORMAT = 1
CACHE_SUBDIR = "trained-laguna"
MODEL_SUBDIR = "model"

# Every module whose code changes what the corpus or the weights are.
KEY_MODULES = (
    "fp4forge.lab.trained.training_corpus",
    "fp4forge.quality.runner",
    "fp4forge.quality.scorer",
    "fp4forge.quality.simulated_tools",
    "fp4forge.quality.suite",  # the scenario parser
    "fp4forge.lab.trained.training",
    "fp4forge.testbed.tiny",
    "fp4forge.testbed.tokenizer",
)
KEY_DISTRIBUTIONS = ("torch", "transformers", "tokenizers")


def _module_source(name: str) -> bytes:
    module = importlib.import_module(name)
    return Path(module.__file__ or "").read_bytes()


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "absent"


def build_host(device: str = "cpu") -> dict[str, Any]:
    """What the bytes of a build depend on beyond its cache key: the kernels torch dispatched to
    (``cpu_capability``: DEFAULT, AVX2, AVX512, ...; another kind rounds differently), the CPU
    model and architecture, and the device trained on."""
    import platform

    import torch

    return {"device": device, "cpu_capability": torch.backends.cpu.get_cpu_capability(), "cpu_model": _cpu_model(),
            "machine": platform.machine()}


def _cpu_model() -> str:
    import platform

    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace").splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def corpus_digest(corpus: Corpus) -> str:
    digest = hashlib.sha256()
    for part, documents in (("train", corpus.train), ("heldout", corpus.heldout)):
        digest.update(f"{part}:{len(documents)}\n".encode())
        for document in documents:
            data = document.encode()
            digest.update(len(data).to_bytes(8, "little") + data)
    return digest.hexdigest()


def trained_laguna_key_inputs(seed: int, config: TrainingConfig, spec: CorpusSpec, corpus: Corpus, tokenizer_json: str) -> dict[str, Any]:
    """What the cache key hashes: generator + training code, corpus, tokenizer, settings, seed,
    library versions (as JSON types, so a build report or manifest holds it unchanged)."""
    doc: dict[str, Any] = {
        "format": CACHE_FORMAT,
        "code": {name: hashlib.sha256(_module_source(name)).hexdigest() for name in KEY_MODULES},
        "chat_template": hashlib.sha256(resources.files("fp4forge.testbed").joinpath("chat_template.jinja").read_bytes()).hexdigest(),
        "tool_catalogue": hashlib.sha256((training_corpus.SCENARIO_DIR / training_corpus.CATALOGUE_FILE).read_bytes()).hexdigest(),
        "corpus": corpus_digest(corpus),
        "tokenizer": hashlib.sha256(tokenizer_json.encode()).hexdigest(),
        "training": config.to_json(),
        "corpus_spec": asdict(spec),
        "seed": seed,
        "versions": {dist: _version(dist) for dist in KEY_DISTRIBUTIONS},
        "python": sys.version_info[:2],
    }
    return json.loads(json.dumps(doc))


def key_of(inputs: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:24]


def trained_laguna_cache_key(seed: int, config: TrainingConfig, spec: CorpusSpec, corpus: Corpus, tokenizer_json: str) -> str:
    """Content hash of (generator + training code, corpus, tokenizer, settings, seed, library versions)."""
    return key_of(trained_laguna_key_inputs(seed, config, spec, corpus, tokenizer_json))


def cache_root() -> Path:
    root = os.environ.get("FP4FORGE_CACHE_DIR") or Path.home() / ".cache" / "fp4forge"
    return Path(root) / CACHE_SUBDIR


def corpus_and_tokenizer(seed: int, spec: CorpusSpec) -> tuple[Corpus, Any]:
    """The generated corpus and the tokenizer the model is trained with (the stdlib BPE, or one
    fitted to the training documents when ``spec.tokenizer == "corpus"``)."""
    from fp4forge.testbed.tokenizer import build_tokenizer

    tokenizer = build_tokenizer()  # the chat template renders the same text with either
    corpus = build_corpus(spec, seed, tokenizer)
    if spec.tokenizer == "corpus":  # CorpusSpec admits "stdlib" or "corpus"
        tokenizer = build_tokenizer(fit_texts=corpus.train)
    return corpus, tokenizer


@dataclass(frozen=True)
class PreparedBuild:
    corpus: Corpus
    tokenizer: Any
    key_inputs: dict[str, Any]
    key: str

    def extra_report(self, spec: CorpusSpec, device: str) -> dict[str, Any]:
        """What the build report says beside the training measures: the key and its inputs (so a
        build can say why it differs from another), the corpus, the host."""
        corpus = self.corpus
        return {
            "cache_key": self.key if device == "cpu" else None,  # a GPU build is not what the cache holds under this key
            "cache_key_inputs": self.key_inputs,
            "corpus": {**asdict(spec), "families": corpus.families, "train_documents": len(corpus.train), "heldout_documents": len(corpus.heldout)},
            "host": build_host(device),
        }


def prepare_build(seed: int, config: TrainingConfig, spec: CorpusSpec) -> PreparedBuild:
    """The corpus, tokenizer and cache key of a build's settings under the current code."""
    corpus, tokenizer = corpus_and_tokenizer(seed, spec)
    inputs = trained_laguna_key_inputs(seed, config, spec, corpus, tokenizer.backend_tokenizer.to_str())
    return PreparedBuild(corpus, tokenizer, inputs, key_of(inputs))


def build_trained_laguna(
    out: Path,
    *,
    seed: int = 0,
    config: TrainingConfig = TrainingConfig(),
    spec: CorpusSpec = CorpusSpec(),
    progress: Progress = None,
    device: str = "cpu",
) -> TrainingResult:
    """Generate the corpus, train, and write the checkpoint with its training report into ``out``
    (on ``device``: any other than the CPU gives other bytes than the cached CPU build)."""
    if progress is not None:
        progress(0, config.steps, "generating the corpus")
    prepared = prepare_build(seed, config, spec)
    extra = {**prepared.extra_report(spec, device), "device": device}
    return train_laguna(out, prepared.corpus.train, prepared.corpus.heldout, seed=seed, config=config, progress=progress, extra_report=extra,
                        device=device, tokenizer=prepared.tokenizer)


def cached_trained_laguna(
    *, seed: int = 0, config: TrainingConfig = TrainingConfig(), spec: CorpusSpec = CorpusSpec(), progress: Progress = None
) -> Path:
    """The trained checkpoint for these settings, from the cache or built into it."""
    prepared = prepare_build(seed, config, spec)
    model_dir = cache_root() / prepared.key / MODEL_SUBDIR
    if (model_dir / training.REPORT_FILE).is_file():
        return model_dir
    try:
        train_laguna(model_dir, prepared.corpus.train, prepared.corpus.heldout, seed=seed, config=config, progress=progress,
                     extra_report=prepared.extra_report(spec, "cpu"), tokenizer=prepared.tokenizer)
    except (ConfigError, OSError):
        # The output is renamed into place only when complete; if a concurrent build of the same
        # key won the race, its directory is the same model and is the answer.
        if not (model_dir / training.REPORT_FILE).is_file():
            raise
    return model_dir


def copy_cached_trained_laguna(
    out: Path, *, seed: int = 0, config: TrainingConfig = TrainingConfig(), spec: CorpusSpec = CorpusSpec(), progress: Progress = None
) -> TrainingResult:
    """``out`` as a copy of the cached build for these settings (built into the cache first if missing)."""
    import shutil

    from fp4forge.checkpoint.atomic import atomic_output_dir, ensure_fresh_output
    from fp4forge.testbed.card import testbed_card

    ensure_fresh_output(Path(out))  # before a build that may take minutes
    cached = cached_trained_laguna(seed=seed, config=config, spec=spec, progress=progress)
    with atomic_output_dir(Path(out)) as staging:
        for item in sorted(cached.iterdir()):
            shutil.copy2(item, staging / item.name)
        (staging / "README.md").write_text(testbed_card(), encoding="utf-8")  # its license, for the export's card
    return TrainingResult(Path(out), json.loads((Path(out) / training.REPORT_FILE).read_text()))
