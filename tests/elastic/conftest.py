"""The elastic suite (issue 17): real jobs through hvdliterun's elastic driver, run with
tests/multirank/harness.py, each under a timeout. The cluster case is in
tests/cluster/test_cluster_elastic.py."""
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(os.path.dirname(HERE), "multirank"), HERE]

import harness  # noqa: E402

# Skips a test unless the native library loads.
native = pytest.fixture(scope="session", name="native")(harness.require_native)
