"""Horovod's TensorFlow semantics on 2 and 3 real ranks (``tf_scripts/parity.py``).

Every block runs in a TF1 graph (Session.run, TF's thread pool, no automatic control
dependencies) and eagerly, as Horovod's suite runs its tests: a fused step of many
allreduces, the gradients of allgather / broadcast / alltoall / reducescatter as
Horovod defines them, tf.IndexedSlices alone and mixed with dense tensors in one
grouped allreduce, a tape with dense and IndexedSlices gradients, alltoall without
splits on uneven ranks, grouped allgather / reducescatter, broadcast_, the rank/size
tensors, BroadcastGlobalVariablesHook, and mismatches raised as the tf.errors classes Horovod raises (after which
the job goes on). Values are recomputed with numpy from rank and size. A hang is a
timeout with every rank's output.
"""
import pytest

import needs

from harness import describe, shared_checks

pytestmark = [
    needs.needs("tensorflow", needs.installed("tensorflow"), "tensorflow is not installed"),
    pytest.mark.timeout(400),
]

BLOCKS = ["fused_allreduce", "allgather_grad", "broadcast_grad", "sparse",
          "mixed_gradients", "alltoall_even_split", "alltoall_grad",
          "grouped_gather_scatter", "reducescatter_grad", "mismatch", "broadcast_",
          "process_tensors", "global_variables", "incremental_graph"]


# parity.py runs in harness.shared_checks's job of its rank count, beside the other
# checking scripts of tf_scripts/ (TensorFlow is imported once per rank count).
@pytest.fixture(scope="module", params=[2, 3], ids=["np2", "np3"])
def np_(request, native):
    return request.param


@pytest.fixture
def parity_job(np_):
    return shared_checks("tf_scripts", np_, "parity.py")


@pytest.mark.parametrize("mode", ["graph", "eager"])
@pytest.mark.parametrize("block", BLOCKS)
def test_horovod_semantics(parity_job, mode, block):
    bodies, result = parity_job
    failures = [f"--- rank {rank}\n{body['failures'][f'{mode}.{block}']}"
                for rank, body in enumerate(bodies)
                if f"{mode}.{block}" in body["failures"]]
    assert not failures, "\n".join(failures)


def test_every_block_ran_on_every_rank(parity_job):
    bodies, result = parity_job
    for body in bodies:
        assert body["checks"] == 2 * len(BLOCKS), describe(result)


def test_sync_batch_norm_equals_one_batch_norm_over_all_ranks(np_):
    bodies, _ = shared_checks("tf_scripts", np_, "sync_batch_norm.py")
    for body in bodies:
        assert body["checks"] == 8 and body["failures"] == {}, body["failures"]
