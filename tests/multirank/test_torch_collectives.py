"""hvdlite.torch collectives on 2 and 3 real ranks, against values every rank recomputes.

One job per rank count runs ``torch_scripts/collectives.py``: every op and dtype, in
place / out of place / async, grouped allreduce, allgather with uneven and empty rows,
alltoall with splits, reducescatter, objects, join, barrier and compressed allreduce
(the gradients are in test_torch_gradients.py).
"""
import os

import pytest

import needs

from harness import assert_ok, describe, run_job

needs.import_or_skip("torch")
pytestmark = pytest.mark.timeout(300)

SCRIPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "torch_scripts")


def failures_of(result, np):
    """Every rank's reported failures (asserting each rank reported)."""
    reported = {}
    for rank in range(np):
        body = result.result(rank)
        assert body["checks"] > 200, describe(result)
        if body["failures"]:
            reported[rank] = body["failures"]
    return reported


@pytest.mark.parametrize("np", [2, 3])
def test_every_collective_matches_recomputed_values(native, np):
    result = assert_ok(run_job(np, os.path.join(SCRIPTS, "collectives.py"), timeout=240))
    assert failures_of(result, np) == {}
