"""What every folder of the suite shares: hvdlite and the job harness importable, and the
``native`` fixture of the folders that run real jobs.

* unit/: one process (an MPI singleton); its conftest.py has an in-process ``native``
* multirank/: real N-rank jobs through hvdliterun, run by multirank/harness.py
* faults/: fault, load and bad-input cases (issue 9): jobs through the harness, and the
  protocol cases on the test-only entry points of testing.h in this process
* elastic/: elastic jobs through hvdliterun's elastic driver (issue 17)
* cluster/: jobs on a namespace cluster (issue 16), run by cluster/cluster_harness.py

Every case has a timeout (pytest-timeout) on top of the job's own. A test that cannot
run here skips with its reason, or fails where CI requires its area (needs.py,
HVDLITE_REQUIRE).
"""
import os
import sys

import pytest

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(TESTS_DIR)
sys.path.insert(0, os.path.join(TESTS_DIR, "multirank"))
sys.path.insert(0, TESTS_DIR)
try:
    import hvdlite  # noqa: F401
except ImportError:
    sys.path.insert(0, REPO_ROOT)

import harness  # noqa: E402
import needs  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line("markers", "hvdlite_needs(area, available, reason): skip, "
                            "or fail under HVDLITE_REQUIRE, when the area is unavailable")
    needs.required_areas()  # an unknown area in the switch stops the run here


def pytest_runtest_setup(item):
    for mark in item.iter_markers("hvdlite_needs"):
        if not mark.kwargs["available"]:
            needs.need(mark.kwargs["area"], mark.kwargs["reason"])


@pytest.fixture(scope="session")
def native():
    """Skips the test unless the native library loads (checked in a child process)."""
    harness.require_native()
