"""The trained tiny Laguna as a session fixture: built once per content hash, then reused.

``cached_trained_laguna`` keys the build by the generator and training code, the corpus, the
tokenizer, the settings, the seed and the library versions, under
``$FP4FORGE_TRAINED_TESTBED_CACHE_DIR/trained-laguna/<key>/model`` (default: the user's fp4forge
cache, ``~/.cache/fp4forge``, not the test session's temporary one). The first
build trains for up to about ten minutes on a 2-core CPU; every later session finds it. Import the
fixture where it is needed (``from tests.trained_fixtures import trained_laguna  # noqa: F401``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def trained_laguna() -> Path:
    from fp4forge.lab.trained.build import cached_trained_laguna
    from fp4forge.lab.trained.training import REPORT_FILE

    session_cache = os.environ.get("FP4FORGE_CACHE_DIR")
    os.environ["FP4FORGE_CACHE_DIR"] = os.environ.get("FP4FORGE_TRAINED_TESTBED_CACHE_DIR") or str(Path.home() / ".cache" / "fp4forge")
    try:
        path = cached_trained_laguna()
    finally:
        if session_cache is None:
            del os.environ["FP4FORGE_CACHE_DIR"]
        else:
            os.environ["FP4FORGE_CACHE_DIR"] = session_cache
    report = json.loads((path / REPORT_FILE).read_text())
    # A cached directory that is not a trained model would make every test that uses it meaningless.
    assert report["heldout_perplexity"] < report["untrained_heldout_perplexity"] / 10, report["heldout_perplexity"]
    return path
