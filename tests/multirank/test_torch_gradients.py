"""The autograd gradients of hvdlite.torch's collectives, as Horovod defines them, on 2
and 3 real ranks (``torch_scripts/gradients.py``): allreduce (with scale factors),
grouped_allreduce, allgather (uneven, with an empty rank), broadcast from every root,
reducescatter (Sum, Average, uneven rows), alltoall (with and without splits), for
float32 and float64 in 1 to 3 dimensions, each against a formula from rank and size.
"""
import os

import pytest

import needs

from harness import assert_checks_pass

needs.import_or_skip("torch")
pytestmark = pytest.mark.timeout(300)

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "torch_scripts",
                      "gradients.py")


@pytest.mark.parametrize("np", [2, 3])
def test_gradients_are_horovods(native, np):
    assert_checks_pass(np, SCRIPT, min_checks=85)
