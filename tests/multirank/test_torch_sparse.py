"""Sparse gradients on 2 and 3 real ranks (``torch_scripts/sparse.py``):
``sparse_allreduce_async`` (Sum, Average; repeated and shared indices, empty ranks)
against the dense sum of every rank's tensor, and ``Embedding(sparse=True)`` trained
through DistributedOptimizer (SparseAdam; sparse_as_dense; Adagrad with a dense layer in
the same group; uneven batches with op=Sum, a rank without rows in one step) against
one process trained on the concatenated batch; each of those also with plain SGD, whose
step scales with the gradient (a sum where the average is due fails it; SparseAdam and
Adagrad barely notice).
"""
import pytest

import needs

from harness import assert_shared_checks_pass

needs.import_or_skip("torch")
pytestmark = pytest.mark.timeout(300)

# The script runs in harness.shared_checks's job, beside the other checking scripts of
# torch_scripts/ (torch is imported once per rank count for the four modules).


@pytest.mark.parametrize("np", [2, 3])
def test_sparse_gradients_train_like_one_process(native, np):
    bodies = assert_shared_checks_pass("torch_scripts", np, "sparse.py", min_checks=48)
    assert all(len(body["info"]) == 10 for body in bodies)
