"""DistributedOptimizer and the state helpers on real ranks (``torch_scripts/training.py``).

Sections (one job runs several, to keep the process start-ups few):

* equivalence: 20 steps on N ranks with batch B each give the parameters of one process
  on the concatenated batch N*B: SGD with momentum and weight decay, Adam, both with
  backward_passes_per_step=2, groups (a number and explicit lists),
  gradient_predivide_factor, clipping through synchronize() + skip_synchronize();
  Compression.fp16 / bf16 stay close.
* optimizer_state: broadcast_optimizer_state leaves identical state and hyper-parameters
  on every rank (Adam, SGD; roots 0 and N-1; a rank without state yet), a fresh root
  leaves every optimizer fresh with zero gradients (SparseAdam's sparse) where a
  parameter requires one and None where it is frozen, and a DistributedOptimizer
  works too.
* unused: a parameter used on rank 0 only, and one used nowhere, do not hang step().
* overlap: gradient hooks enqueue during backward and collectives run before the last
  gradient is ready.
* mismatch: ranks with different models fail on every rank (no hang), and the core goes on.
"""
import os

import pytest

import needs

from harness import assert_ok, describe, run_job

needs.import_or_skip("torch")
pytestmark = pytest.mark.timeout(400)

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "torch_scripts",
                      "training.py")


def run_sections(np, sections, timeout=300):
    result = assert_ok(run_job(np, SCRIPT, args=[",".join(sections)], timeout=timeout))
    bodies = [result.result(rank) for rank in range(np)]
    failures = {rank: b["failures"] for rank, b in enumerate(bodies) if b["failures"]}
    assert failures == {}, f"{failures}\n{describe(result)}"
    return bodies


def test_two_ranks_train_like_one_process(native):
    bodies = run_sections(2, ["equivalence", "optimizer_state", "unused", "overlap",
                              "mismatch"])
    info = bodies[0]["info"]
    # Exact configurations agree to float32 rounding; compressed ones stay close.
    for label in ("sgd_momentum", "adam", "sgd_passes2", "adam_passes2", "sgd_groups2",
                  "adam_groups_lists", "sgd_predivide", "sgd_clip"):
        assert info[label] < 2e-5, (label, info[label])
    assert info["adam_fp16"] < 5e-3
    # Plain SGD (scale-sensitive) on the paths above that Adam alone covered.
    assert info["sgd_plain"] < 2e-5 and info["sgd_plain_groups_lists"] < 2e-5, info
    assert info["sgd_plain_fp16"] < 1e-3 and info["sgd_plain_bf16"] < 5e-3, info
    overlap = info["overlap"]
    assert overlap["order"][0].startswith("5.")  # last layer's gradient is ready first
    assert overlap["first_hook_ms"] < overlap["backward_ms"]
    assert overlap["collectives_at_last_hook"] > overlap["collectives_at_first_hook"]
    for body in bodies:
        assert "MismatchError" in body["info"]["mismatch_error"]
        assert "rank 0 had shape" in body["info"]["mismatch_error"]


def test_three_ranks(native):
    bodies = run_sections(3, ["equivalence", "optimizer_state", "unused", "mismatch"])
    for body in bodies:
        assert "MismatchError" in body["info"]["mismatch_error"]
    assert bodies[0]["info"]["sgd_momentum"] < 2e-5
