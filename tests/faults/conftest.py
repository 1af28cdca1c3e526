"""Fixtures for the fault, load and bad-input suite (issue 9).

Multi-rank cases run real jobs through hvdliterun with tests/multirank/harness.py;
the protocol cases call the test-only native entry points of testing.h in this
process. Every case has a timeout (pytest-timeout) on top of the job's own.
"""
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
