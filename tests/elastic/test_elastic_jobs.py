"""Elastic jobs through hvdliterun: ranks die at chosen points, hosts are added, the job
falls below --min-np; PyTorch (scripts/train_elastic.py) and Keras/TensorFlow
(scripts/train_keras_elastic.py). What a reset must keep is checked by history.check (see
there): the new world starts from the last commit bit for bit (weights and optimizer
state), no committed step is repeated or skipped, and each epoch's samples are trained
once.
"""
import dataclasses
import os
import re
import stat
import sys
import time

import pytest

import needs

import history
from harness import describe, run_job
from hvdlite.runner.testing import pid_alive

pytestmark = [pytest.mark.timeout(240), pytest.mark.usefixtures("native")]

SCRIPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts")
SCRIPT = os.path.join(SCRIPTS, "train_elastic.py")
KERAS_SCRIPT = os.path.join(SCRIPTS, "train_keras_elastic.py")
SAMPLES, EPOCHS = 36, 2


def _train(tmp_path, np, launcher_args, kills=(), extra=(), timeout=150, script=SCRIPT):
    log_dir = tmp_path / "logs"
    log_dir.mkdir()
    args = [str(log_dir), "--samples", SAMPLES, "--epochs", EPOCHS, *extra]
    for kill in kills:
        args += ["--kill", kill]
    env = {"TF_CPP_MIN_LOG_LEVEL": "2"} if script == KERAS_SCRIPT else None
    result = run_job(np, script, timeout=timeout, args=args, launcher_args=launcher_args,
                     env=env)
    return result, log_dir


def _assert_finished(result, log_dir, sizes):
    assert result.returncode == 0, describe(result)
    summary = history.check(log_dir, SAMPLES, EPOCHS)
    assert summary["worlds"] == sizes, (summary["worlds"], describe(result))
    final = {d["digest"] for d in summary["done"]}
    assert len(summary["done"]) == sizes[-1] and len(final) == 1, summary["done"]
    return summary


@pytest.mark.parametrize("where", ["backward", "allreduce", "commit"])
def test_a_rank_killed_mid_step_costs_one_rollback_3_to_2(tmp_path, where):
    # In one of the three the job also uses a process set (checked below).
    extra = ["--process-set", "evens"] if where == "backward" else []
    result, log_dir = _train(tmp_path, 3, ["--min-np", "2", "--max-np", "3"],
                             kills=[f"0:2:5:{where}"], extra=extra)
    summary = _assert_finished(result, log_dir, [3, 2])
    # The reset callbacks ran once, in the new world, with its size.
    assert summary["starts"][1]["resets"] == [2]
    assert "world 1: 2 rank(s)" in result.stderr and "rank 2 on localhost" in result.stderr
    if extra:
        _assert_process_sets_made_for_each_world(log_dir)


def test_a_death_the_launcher_hears_of_late_still_costs_its_slot_3_to_2(tmp_path):
    # The survivors' shared-memory waits see the victim's process end while its wrapper
    # (stopped for 3 s, as one starved of CPU) has not reported it yet. Had they left for
    # the reset at once, mpiexec would have ended the wrapper before it reported, and the
    # next world would have had 3 ranks "after hosts were added".
    result, log_dir = _train(tmp_path, 3, ["--min-np", "2", "--max-np", "3"],
                             kills=["0:2:5:allreduce"], extra=["--wrapper-stall", "3"])
    _assert_finished(result, log_dir, [3, 2])
    # The race itself: the survivors saw the death before the launcher told them.
    assert "ended during a shared-memory collective" in result.stderr, describe(result)
    assert "world 1: 2 rank(s) on localhost:2 after rank 2 on localhost was killed by " \
           "signal 9" in result.stderr, describe(result)


def _assert_process_sets_made_for_each_world(log_dir):
    """Elastic with process sets: the script's set of the world's even ranks is made again
    in the new world ([0, 2] at 3 ranks, [0] at 2), and its sums are right in both."""
    worlds = history.load(log_dir)
    for gen, want in ((0, [0, 2]), (1, [0])):
        for rank, records in worlds[gen].items():
            start = [r for r in records if r["ev"] == "start"][0]
            assert start["pset"] == want, (gen, rank, start)
            sums = {r["pset_sum"] for r in records if r["ev"] == "trained"}
            assert sums == ({sum(want)} if rank in want else {None}), (gen, rank, sums)


def test_a_rank_killed_during_the_handover_3_to_2_to_1(tmp_path):
    # World 1's rank 1 dies while world 0's last commit is being handed over to world 1.
    result, log_dir = _train(tmp_path, 3, ["--min-np", "1", "--max-np", "3"],
                             kills=["0:2:4:allreduce", "1:1:0:handover"])
    # World 1 (2 ranks) began nothing; world 2 starts from world 0's last commit.
    summary = _assert_finished(result, log_dir, [3, 1])
    assert "world 1: 2 rank(s)" in result.stderr and "world 2: 1 rank(s)" in result.stderr
    assert sorted(summary["starts"]) == [0, 2]


def _discovery_script(tmp_path, hosts):
    hosts_file = tmp_path / "hosts.txt"
    hosts_file.write_text(hosts + "\n")
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\ncat {hosts_file}\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return str(script), str(hosts_file)


def test_a_host_added_by_the_discovery_script_joins_at_the_next_commit_2_to_3(tmp_path):
    script, hosts_file = _discovery_script(tmp_path, "localhost:2")
    result, log_dir = _train(tmp_path, 2, ["--min-np", "2", "--max-np", "3",
                                           "--host-discovery-script", script],
                             extra=["--grow-file", hosts_file, "--grow-at", "4"])
    summary = _assert_finished(result, log_dir, [2, 3])
    # Nobody died: world 0 left at the first commit after the host list grew.
    assert summary["starts"][1]["step"] == 4, summary["starts"][1]
    assert "after hosts were added" in result.stderr, describe(result)


def _rank_pids(log_dir):
    pids = []
    for records in history.load(log_dir).values():
        for rank_records in records.values():
            pids += [r["pid"] for r in rank_records if "pid" in r]
    return pids


def test_below_min_np_ends_the_job_with_a_clear_error_and_no_process_left(tmp_path):
    script, _ = _discovery_script(tmp_path, "localhost:2")
    started = time.monotonic()
    result, log_dir = _train(tmp_path, 2, ["--min-np", "2", "--max-np", "2",
                                           "--host-discovery-script", script,
                                           "--elastic-timeout", "3"],
                             kills=["0:1:3:backward"])
    assert result.returncode != 0, describe(result)
    assert re.search(r"only 1 usable slot\(s\) .*fewer than --min-np 2, for 3 s "
                     r"\(--elastic-timeout\)", result.stderr), describe(result)
    assert time.monotonic() - started < 120
    pids = _rank_pids(log_dir)
    assert len(pids) == 2, pids
    deadline = time.monotonic() + 10
    while any(pid_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids if pid_alive(p)], describe(result)


def test_past_the_reset_limit_the_job_ends(tmp_path):
    result, _ = _train(tmp_path, 3, ["--min-np", "1", "--max-np", "3", "--reset-limit", "1"],
                       kills=["0:2:3:backward", "1:1:5:backward"])
    assert result.returncode not in (0, None), describe(result)
    assert "--reset-limit" in result.stderr and "1 reset(s)" in result.stderr, describe(result)
    assert "world 2" not in result.stderr, describe(result)


def test_below_min_np_then_a_host_joins_the_job_goes_on_from_the_last_commit(tmp_path):
    # Horovod's old and new workers could disagree here on whether to sync the state and
    # deadlock; every rank of a new world takes the same handover.
    # After the death the discovery script lists one slot too few for 3 s, then one more.
    note = tmp_path / "died"
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\nif [ -f {note} ] && [ $(( $(date +%s) - $(stat -c %Y {note}) "
                      f")) -ge 3 ]; then echo localhost:3; else echo localhost:2; fi\n")
    script.chmod(0o755)
    started = time.monotonic()
    result, log_dir = _train(tmp_path, 2, ["--min-np", "2", "--max-np", "2",
                                           "--host-discovery-script", str(script),
                                           "--elastic-timeout", "60"],
                             kills=["0:1:3:backward"], extra=["--death-note", str(note)])
    summary = _assert_finished(result, log_dir, [2, 2])
    waited = summary["starts"][1]["time"] - os.stat(note).st_mtime
    assert waited >= 2.0, f"world 1 started {waited:.1f} s after the death, below --min-np"
    assert time.monotonic() - started < 150


# -- a sharded optimizer -----------------------------------------------------------------

def _replay(log_dir, summary, weights):
    """The final weights of one process that trains the committed steps' whole batches
    (the ranks' mean losses averaged, as the ranks' averaged gradients), from world 0's
    first weights, with the script's model, data and Adam."""
    import torch
    import torch.nn.functional as F

    data = torch.randn(SAMPLES, 8, generator=torch.Generator().manual_seed(7))
    target = (data.sum(dim=1) > 0).long()
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    model.load_state_dict(torch.load(weights / "initial.pt"))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    batches = history.committed_batches(log_dir, summary)
    for per_rank in batches:
        optimizer.zero_grad()
        loss = sum(F.cross_entropy(model(data[i]), target[i]) for i in per_rank) / len(per_rank)
        loss.backward()
        optimizer.step()
    return model.state_dict(), len(batches)


def test_a_sharded_optimizer_rolls_back_and_reshards_3_to_2_to_3_bit_for_bit(tmp_path):
    # shard=2 (element-wise pieces: every rank's share changes with the world's size); a
    # rank killed with the gradients in flight (3 -> 2), then a slot added (2 -> 3). Stage 1,
    # and a death halfway through a commit, are in test_sharded_commit.py (one job costs
    # some 30-50 s here).
    import torch

    weights = tmp_path / "weights"
    weights.mkdir()
    script, hosts_file = _discovery_script(tmp_path, "localhost:3")
    # The killed rank's slot is out for good: a 4th slot in the list brings 3 back.
    extra = ["--shard", 2, "--weights", weights, "--grow-file", hosts_file, "--grow-at", 9,
             "--grow-world", 1, "--grow-hosts", "localhost:4"]
    result, log_dir = _train(tmp_path, 3, ["--min-np", "2", "--max-np", "3",
                                           "--host-discovery-script", script],
                             kills=["0:2:5:allreduce"], extra=extra)
    # history.check: each new world starts from the last commit's digest (the weights and
    # the whole optimizer state, consolidated), no committed step repeated or skipped.
    summary = _assert_finished(result, log_dir, [3, 2, 3])
    assert [summary["starts"][g]["step"] for g in (1, 2)] == [5, 9], summary["starts"]
    want, steps = _replay(log_dir, summary, weights)
    assert steps == summary["done"][0]["step"], (steps, summary["done"])
    got = torch.load(weights / "final.pt")
    for name, value in want.items():
        diff = (got[name] - value).abs().max().item()
        assert diff < 1e-5, f"{name}: the job's final weights differ from the replay's by {diff}"


# -- Keras and TensorFlow --------------------------------------------------------------

def needs_keras(test):
    return needs.needs("tensorflow", needs.installed("tensorflow"), "tensorflow not installed")(
        needs.needs("keras", needs.installed("keras"), "keras not installed")(test))


@needs_keras
@pytest.mark.parametrize("mode, kill", [
    ("fit", "0:2:4:allreduce"),   # model.fit with the callbacks, in epoch 0 (6 steps each)
    ("tape", "0:1:7:commit"),     # a GradientTape loop, halfway through writing a commit
])
def test_keras_a_rank_killed_mid_epoch_costs_one_rollback_3_to_2(tmp_path, mode, kill):
    result, log_dir = _train(tmp_path, 3, ["--min-np", "2", "--max-np", "3"], kills=[kill],
                             extra=["--mode", mode], script=KERAS_SCRIPT, timeout=200)
    summary = _assert_finished(result, log_dir, [3, 2])
    step = int(kill.split(":")[2])
    # fit: the commit before the step the victim never began; tape: the commit after
    # the step, which the victim died writing and the survivors wrote whole.
    assert summary["starts"][1]["step"] == (step if mode == "fit" else step + 1), \
        summary["starts"][1]
    assert summary["starts"][1]["resets"] == [2]
    if mode == "fit":  # world 1 resumed in the middle of epoch 0 and trained it to its end
        assert summary["starts"][1]["epoch"] == 0


@needs_keras
def test_keras_a_host_added_joins_without_hanging_in_the_state_broadcast_2_to_3(tmp_path):
    # Horovod's new workers could hang in the broadcast of the state while the old ones
    # skipped it; here every rank of a new world takes the handover alike.
    script, hosts_file = _discovery_script(tmp_path, "localhost:2")
    result, log_dir = _train(tmp_path, 2, ["--min-np", "2", "--max-np", "3",
                                           "--host-discovery-script", script],
                             extra=["--grow-file", hosts_file, "--grow-at", "3"],
                             script=KERAS_SCRIPT, timeout=200)
    summary = _assert_finished(result, log_dir, [2, 3])
    assert summary["starts"][1]["step"] == 3, summary["starts"][1]
    assert "after hosts were added" in result.stderr, describe(result)


# -- process sets ------------------------------------------------------------------------

def test_process_sets_of_fixed_ranks_that_a_smaller_world_lacks_end_the_job_with_advice(tmp_path):
    result, _ = _train(tmp_path, 3, ["--min-np", "2", "--max-np", "3"],
                       kills=["0:1:3:backward"], extra=["--process-set", "fixed"])
    assert result.returncode not in (0, None), describe(result)
    assert "rank 2 is out of range for 2 ranks" in result.stderr, describe(result)
    assert "world 1 of an elastic job has 2 ranks" in result.stderr, describe(result)
    assert "make process sets from hvdlite.size()" in result.stderr, describe(result)


def test_a_world_its_owner_ends_is_reset_from_the_last_commit_not_the_jobs_end(tmp_path):
    # hvdlite.ray ends a world whose Ray workers are gone while its ranks still run
    # (Supervisor.end, from another thread): the driver must start the next world from
    # the last commit, where a signal to the launcher ends the whole job.
    import threading

    from hvdlite.runner import elastic_driver, job, launch, mpi_command, wire

    log_dir = tmp_path / "logs"
    log_dir.mkdir()
    config = launch.parse_command_line(
        ["-np", "2", "--min-np", "2", "--max-np", "2", sys.executable, SCRIPT, str(log_dir),
         "--samples", str(SAMPLES), "--epochs", str(EPOCHS), "--step-sleep", "0.1"])
    launcher = mpi_command.probe_launcher(mpi_command.find_mpiexec())
    ended = []

    def end_once_committed(supervisor):
        # Two commits of training: saves after every rank's "start" record (entering the
        # world saves too, before "start": ending the world then left a rank without one).
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and not ended:
            saved_after_start = []
            for path in log_dir.glob("g0-r*.jsonl"):
                lines = path.read_text().splitlines()
                begun = [i for i, line in enumerate(lines) if '"ev": "start"' in line]
                if begun:
                    saved_after_start += [l for l in lines[begun[0]:] if '"ev": "saved"' in l]
                else:
                    saved_after_start = None
                    break
            if saved_after_start is not None and len(saved_after_start) >= 2 \
                    and len(list(log_dir.glob("g0-r*.jsonl"))) == 2:
                ended.append(len(saved_after_start))
                supervisor.end()
            time.sleep(0.1)

    def make_supervisor(size, hosts):
        world = dataclasses.replace(config, num_ranks=size, hosts=hosts)
        return job.new_supervisor(world, "127.0.0.1", "127.0.0.1",
                                  elastic_driver._WorldSupervisor,
                                  wire.DEFAULT_PEER_TIMEOUT_S)

    def launch_world(supervisor, hosts, size, extra_env):
        if not ended:
            threading.Thread(target=end_once_committed, args=(supervisor,),
                             daemon=True).start()
        world = dataclasses.replace(config, num_ranks=size, hosts=hosts)
        result = job.supervise_job(world, launcher, supervisor, extra_env)
        if supervisor.ended_by_owner:
            assert not supervisor.signalled
            assert "ended by the program that runs it" in result.message
        return result

    driver = elastic_driver.ElasticDriver(config, launch_world, make_supervisor)
    assert driver.run() == 0
    assert ended, "the world finished before its owner could end it"
    summary = history.check(log_dir, SAMPLES, EPOCHS)
    assert summary["worlds"] == [2, 2], summary
    assert len({d["digest"] for d in summary["done"]}) == 1
