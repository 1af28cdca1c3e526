"""hvdlite.tensorflow on 2 real ranks, against values every rank recomputes.

One job runs ``tf_scripts/collectives.py`` (TF's import costs seconds per rank, so the
checks share it): every op eagerly and inside tf.function (allreduce with each op and
dtype, integer Average, bool Min/Max, fp16/bf16, scaling, fp16 compression,
IndexedSlices, grouped allreduce, allgather with uneven rows, broadcast, alltoall with
splits, reducescatter with uneven rows, barrier, join), broadcast_variables and the
object helpers, the gradients of allreduce / grouped allreduce / allgather /
broadcast, DistributedGradientTape training for 10 steps (batch B on each rank equals
one process with batch 2B, dense and IndexedSlices gradients), and a shape mismatch
that must raise on every rank, eagerly and in a graph.
"""
import pytest

import needs

from harness import describe, shared_checks

pytestmark = [
    needs.needs("tensorflow", needs.installed("tensorflow"), "tensorflow is not installed"),
    pytest.mark.timeout(300),
]

NP = 2


@pytest.fixture(scope="module")
def collectives_job(native):
    # In harness.shared_checks's job of 2 ranks, beside the other checking scripts of
    # tf_scripts/ (TensorFlow is imported once).
    bodies, result = shared_checks("tf_scripts", NP, "collectives.py")
    for body in bodies:
        assert body["checks"] >= 70, describe(result)
    return bodies


def _failures(bodies, prefix):
    """Failed checks whose names start with ``prefix``, as readable text ('' if none)."""
    lines = []
    for rank, body in enumerate(bodies):
        for key, detail in sorted(body["failures"].items()):
            if key.startswith(prefix):
                lines.append(f"--- rank {rank}: {key}\n{detail}")
    return "\n".join(lines)


@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_every_op_matches_recomputed_values(collectives_job, mode):
    assert _failures(collectives_job, f"{mode}.ops") == ""
    assert _failures(collectives_job, f"{mode}.allreduce") == ""
    assert _failures(collectives_job, f"{mode}.grouped") == ""
    assert _failures(collectives_job, f"{mode}.all") == ""
    assert _failures(collectives_job, f"{mode}.broadcast") == ""
    assert _failures(collectives_job, f"{mode}.reducescatter") == ""
    assert _failures(collectives_job, f"{mode}.join") == ""


@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_gradients_of_differentiable_ops(collectives_job, mode):
    assert _failures(collectives_job, f"{mode}.grad") == ""


@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_gradient_tape_training_equals_one_process_with_the_whole_batch(collectives_job,
                                                                        mode):
    assert _failures(collectives_job, f"{mode}.tape") == ""


def test_broadcast_variables_and_objects(collectives_job):
    assert _failures(collectives_job, "broadcast_variables") == ""
    assert _failures(collectives_job, "variables_objects") == ""
    assert _failures(collectives_job, "broadcast_object") == ""
    assert _failures(collectives_job, "allgather_object") == ""


def test_mismatch_raises_on_every_rank(collectives_job):
    assert _failures(collectives_job, "mismatch") == ""
    for body in collectives_job:
        assert "shape" in body["values"]["eager_message"]


def test_no_check_failed(collectives_job):
    assert _failures(collectives_job, "") == ""
