"""PyTorch Lightning on HvdliteStrategy: real jobs of 2 and 3 ranks through hvdliterun
(``lightning_scripts/lightning_training.py``), checked against one process that trains
with a plain torch loop on the whole batch (``lightning_common.reference``: no Lightning,
no hvdlite).

One job per rank count runs everything (Lightning's import is the slow part):

* fit: the weights, SGD's momentum buffers and the scheduled learning rate equal the
  reference's; each rank saw its DistributedSampler share of every epoch;
  ``self.log(..., sync_dist=True)`` gives the mean over ranks on every rank;
* checkpoints: rank 0 wrote each one, the other ranks none, and Lightning loads the
  last one in a single process (no hvdlite) with the reference's weights;
* validate, test, predict after fit: the logged losses equal the reference's on the
  whole set, predictions of every rank together cover the set once;
* the strategy's all_gather, broadcast, barrier, reduce and reduce_boolean_decision;
* a second fit with accumulate_grad_batches=2 equals the reference on a doubled batch.

And examples/lightning_digits.py learns on 2 ranks (rank 0 alone prints and checkpoints).
"""
import os
import re
import subprocess
import sys

import pytest

import needs
from harness import REPO_ROOT, assert_ok, describe, job_env, run_job

pytestmark = [pytest.mark.timeout(300),
              needs.needs("lightning", needs.installed("lightning", "torch"),
                          "lightning (and torch) not installed")]

SCRIPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lightning_scripts")
SCRIPT = os.path.join(SCRIPTS, "lightning_training.py")
TOLERANCE = 2e-5


@pytest.fixture(scope="module")
def common():
    sys.path.insert(0, SCRIPTS)
    try:
        import lightning_common
    finally:
        sys.path.remove(SCRIPTS)
    return lightning_common


def flat(net):
    return {name: t.detach().flatten().tolist() for name, t in net.state_dict().items()}


def assert_close(got, want, what):
    assert got.keys() == want.keys(), what
    for name in want:
        worst = max(abs(a - b) for a, b in zip(got[name], want[name]))
        assert len(got[name]) == len(want[name]) and worst < TOLERANCE, (what, name, worst)


def run_and_check(np, common, tmp_path):
    import torch

    ckpt_dir = str(tmp_path / "ckpt")
    result = assert_ok(run_job(np, SCRIPT, args=[ckpt_dir], timeout=200))
    bodies = [result.result(rank) for rank in range(np)]
    net, optimizer, last_loss = common.reference(np, accumulate=1)
    momentum = {name: optimizer.state[p]["momentum_buffer"].flatten().tolist()
                for name, p in net.named_parameters()}
    n = common.train_size(np, 1)
    for rank, body in enumerate(bodies):
        what = f"rank {rank}\n{describe(result)}"
        assert body["strategy"] == "HvdliteStrategy" and body["ranks"] == [rank, rank, np]
        assert body["sampler"] == "DistributedSampler" and body["distributed_optimizer"]
        assert body["optimizer"] == "SGD", what
        assert body["seen"] == [i for epoch in range(common.EPOCHS)
                                for i in common.epoch_order(n, epoch)[rank::np]], what
        assert_close(body["weights"], flat(net), what)
        assert_close(body["momentum"], momentum, what)
        assert body["lr"] == pytest.approx(optimizer.param_groups[0]["lr"])
        assert body["logged"]["rank_value"] == pytest.approx((np - 1) / 2), what
        assert body["logged"]["train_loss"] == pytest.approx(last_loss, abs=TOLERANCE)

        xv, yv = common.make_data(common.VAL_SIZE_PER_RANK * np, seed=2)
        with torch.no_grad():
            val_loss = torch.nn.functional.mse_loss(net(xv), yv).item()
        assert body["validate"][0]["val_loss"] == pytest.approx(val_loss, abs=TOLERANCE)
        assert body["test"][0]["test_loss"] == pytest.approx(val_loss, abs=TOLERANCE)
        assert body["test"][0]["test_rank_max"] == np - 1

        assert body["all_gather"] == [[r, 10 * r] for r in range(np)]
        assert body["all_gather_scalar"] == [float(r) for r in range(np)]
        assert body["broadcast"] == {"from": np - 1}
        assert body["any"] is True and body["all"] is False
        assert body["sum"] == np * (np + 1) // 2
        assert body["int_mean"] == (np * (np + 1) // 2) // np
        mean_rank = sum(range(np)) / np
        assert body["repeated_means"] == pytest.approx([mean_rank * s for s in range(10)])
        assert body["repeated_hits"] >= 9, body["repeated_hits"]  # a negotiation each before

        # Rank 0 writes every checkpoint, the others none.
        expected = [os.path.join(ckpt_dir, f"epoch={e}.ckpt") for e in range(common.EPOCHS)]
        assert body["saved"] == (expected if rank == 0 else []), what
        assert body["best"] == expected[-1]

    # Predictions: every sample once over the ranks, the reference's values.
    xp, _ = common.make_data(common.PREDICT_SIZE, seed=3)
    with torch.no_grad():
        want = net(xp).flatten().tolist()
    got = sorted(pair for body in bodies for pair in body["predict"])
    assert [i for i, _ in got] == list(range(common.PREDICT_SIZE))
    assert max(abs(v - want[i]) for i, v in got) < TOLERANCE
    assert sorted(os.listdir(ckpt_dir)) == [f"epoch={e}.ckpt" for e in range(common.EPOCHS)]

    # accumulate_grad_batches=2 is one process on the doubled batch.
    accumulated, _, _ = common.reference(np, accumulate=2)
    for body in bodies:
        assert_close(body["accumulated_weights"], flat(accumulated), "accumulated")
        assert body["accumulated_steps"] == common.EPOCHS * common.STEPS
    return expected[-1], net, momentum


def test_two_ranks(native, common, tmp_path):
    last, net, momentum = run_and_check(2, common, tmp_path)
    # Lightning loads rank 0's checkpoint in one plain process (no launcher, no hvdlite).
    loaded = subprocess.run([sys.executable, SCRIPT, "--load", last], env=job_env(),
                            capture_output=True, text=True, timeout=120)
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    line = [ln for ln in loaded.stdout.splitlines() if ln.startswith("HVDLITE_RESULT ")][-1]
    import json

    body = json.loads(line.split(" ", 1)[1])
    assert body["epoch"] == common.EPOCHS - 1
    assert body["global_step"] == common.EPOCHS * common.STEPS
    assert_close(body["weights"], flat(net), "loaded checkpoint")
    assert_close(dict(enumerate(body["momentum"])), dict(enumerate(momentum.values())),
                 "loaded momentum")


def test_three_ranks(native, common, tmp_path):
    run_and_check(3, common, tmp_path)


def test_digits_example_learns(native, tmp_path):
    needs.import_or_skip("sklearn")
    example = os.path.join(REPO_ROOT, "examples", "lightning_digits.py")
    result = assert_ok(run_job(2, example, args=["--epochs", "6", "--root-dir", str(tmp_path)],
                               timeout=200))
    lines = [line for line in result.rank_stdout.get(0, []) if "test accuracy" in line]
    assert len(lines) == 1, describe(result)
    accuracy = float(re.search(r"test accuracy ([\d.]+)%", lines[0]).group(1))
    assert accuracy >= 90.0, lines
    assert not any("test accuracy" in line for line in result.rank_stdout.get(1, []))
    best = re.search(r"best checkpoint (\S+)", lines[0]).group(1)
    assert os.path.exists(best) and best.startswith(str(tmp_path))
