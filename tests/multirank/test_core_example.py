"""The numpy demo in examples/ runs as a real job and agrees with numpy's mean."""
import os

import pytest

import harness

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("native")]

DEMO = os.path.join(harness.REPO_ROOT, "examples", "numpy_allreduce_demo.py")


@pytest.mark.parametrize("np_", (2, 3))
def test_numpy_demo(np_):
    job = harness.assert_ok(harness.run_job(np_, DEMO, timeout=90))
    printed = "\n".join(job.rank_stdout.get(0, []))
    assert f"{np_} ranks" in printed, printed
    assert "OK: every rank's result equals numpy's mean" in printed, printed
    # Only rank 0 prints.
    assert not any(job.rank_stdout.get(r) for r in range(1, np_)), job.rank_stdout
