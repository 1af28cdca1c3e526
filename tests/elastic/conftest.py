"""Fixtures for the elastic suite (issue 17): real jobs through hvdliterun's elastic
driver, run with tests/multirank/harness.py, each under a timeout."""
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(REPO_ROOT, "tests", "multirank"))
sys.path.insert(0, HERE)
try:
    import hvdlite  # noqa: F401
except ImportError:
    sys.path.insert(0, REPO_ROOT)

import harness  # noqa: E402


@pytest.fixture(scope="session")
def native():
    """Skips the test unless the native library loads."""
    harness.require_native()
