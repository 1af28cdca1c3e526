"""Ray clusters for the tests of hvdlite.ray (issue 30): one per module, always ended,
and nothing of it left behind (each module's teardown checks its processes are gone).
"""
import os

import pytest

import needs
from ray_support import (RAY_ENV, assert_all_gone, descendants, rank_processes,
                         worker_pythonpath)


@pytest.fixture(scope="module")
def ray_local():
    """A single-node Ray cluster in this process (6 logical CPUs), ended after the
    module with every process it started."""
    ray = needs.import_or_skip("ray")
    saved = {k: os.environ.get(k) for k in list(RAY_ENV) + ["PYTHONPATH"]}
    os.environ.update(RAY_ENV)
    os.environ["PYTHONPATH"] = worker_pythonpath()
    ray.init(num_cpus=6, include_dashboard=False, logging_level="warning",
             log_to_driver=True)
    try:
        yield ray
    finally:
        started = descendants(os.getpid())
        ray.shutdown()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        assert_all_gone(started)
        assert_all_gone(rank_processes(), 5, "rank processes")
