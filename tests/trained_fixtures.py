"""The trained tiny Laguna as a session fixture: the testbed fp4forge ships, verified by sha256.

``fp4forge.testbed.shipped`` holds one build of ``fp4forge testbed trained-laguna`` (its recipe,
seed, cache key and host in the manifest), so every machine tests the same bytes and no test
session trains. Import the fixture where it is needed
(``from tests.trained_fixtures import trained_laguna  # noqa: F401``). The build itself stays
tested at a small size (tests/test_trained_testbed.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def trained_laguna() -> Path:
    from fp4forge.lab.trained.training import REPORT_FILE
    from fp4forge.testbed.shipped import shipped_testbed

    path = shipped_testbed().path  # raises ShippedTestbedError unless every file matches its hash
    report = json.loads((path / REPORT_FILE).read_text())
    # A shipped directory that is not a trained model would make every test that uses it meaningless.
    assert report["heldout_perplexity"] < report["untrained_heldout_perplexity"] / 10, report["heldout_perplexity"]
    return path
