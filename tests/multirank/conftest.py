"""Fixtures for multi-rank tests; the jobs themselves are run by harness.py."""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
try:
    import hvdlite  # noqa: F401
except ImportError:
    sys.path.insert(0, REPO_ROOT)

import harness  # noqa: E402


@pytest.fixture(scope="session")
def native():
    """Skips the test unless the native library loads."""
    harness.require_native()


@pytest.fixture(scope="session")
def run_job():
    """``run_job(np, script, *, timeout=120, env=None, args=(), launcher_args=())``."""
    return harness.run_job


@pytest.fixture(scope="session")
def assert_ok():
    return harness.assert_ok
