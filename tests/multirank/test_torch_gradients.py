"""The autograd gradients of hvdlite.torch's collectives, as Horovod defines them, on 2
and 3 real ranks (``torch_scripts/gradients.py``): allreduce (with scale factors),
grouped_allreduce, allgather (uneven, with an empty rank), broadcast from every root,
reducescatter (Sum, Average, uneven rows), alltoall (with and without splits), for
float32 and float64 in 1 to 3 dimensions, each against a formula from rank and size.
"""
import pytest

import needs

from harness import assert_shared_checks_pass

needs.import_or_skip("torch")
pytestmark = pytest.mark.timeout(300)

# The script runs in harness.shared_checks's job, beside the other checking scripts of
# torch_scripts/ (torch is imported once per rank count for the four modules).


@pytest.mark.parametrize("np", [2, 3])
def test_gradients_are_horovods(native, np):
    assert_shared_checks_pass("torch_scripts", np, "gradients.py", min_checks=85)
