"""hvdlite.torch collectives on 2 and 3 real ranks, against values every rank recomputes.

One job per rank count runs ``torch_scripts/collectives.py``: every op and dtype, in
place / out of place / async, grouped allreduce, allgather with uneven and empty rows,
alltoall with splits, reducescatter, objects, join, barrier and compressed allreduce
(the gradients are in test_torch_gradients.py).
"""
import pytest

import needs

from harness import describe, shared_checks

needs.import_or_skip("torch")
pytestmark = pytest.mark.timeout(300)

# The script runs in harness.shared_checks's job, beside the other checking scripts of
# torch_scripts/ (torch is imported once per rank count for the four modules).


def failures_of(bodies, result):
    """Every rank's reported failures (asserting each rank made its checks)."""
    reported = {}
    for rank, body in enumerate(bodies):
        assert body["checks"] > 200, describe(result)
        if body["failures"]:
            reported[rank] = body["failures"]
    return reported


@pytest.mark.parametrize("np", [2, 3])
def test_every_collective_matches_recomputed_values(native, np):
    bodies, result = shared_checks("torch_scripts", np, "collectives.py")
    assert failures_of(bodies, result) == {}
