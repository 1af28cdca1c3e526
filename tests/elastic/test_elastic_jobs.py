"""Elastic jobs through hvdliterun: ranks die at chosen points, hosts are added, the job
falls below --min-np. What a reset must keep is checked by history.check (see there):
the new world starts from the last commit bit for bit, no committed step is repeated or
skipped, and the ElasticSampler covers each epoch once.
"""
import os
import re
import stat
import time

import pytest

import history
from harness import describe, run_job
from hvdlite.runner.testing import pid_alive

pytestmark = [pytest.mark.timeout(240), pytest.mark.usefixtures("native")]

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts",
                      "train_elastic.py")
SAMPLES, EPOCHS = 36, 2


def _train(tmp_path, np, launcher_args, kills=(), extra=(), timeout=150):
    log_dir = tmp_path / "logs"
    log_dir.mkdir()
    args = [str(log_dir), "--samples", SAMPLES, "--epochs", EPOCHS, *extra]
    for kill in kills:
        args += ["--kill", kill]
    result = run_job(np, SCRIPT, timeout=timeout, args=args, launcher_args=launcher_args)
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
    result, log_dir = _train(tmp_path, 3, ["--min-np", "2", "--max-np", "3"],
                             kills=[f"0:2:5:{where}"])
    summary = _assert_finished(result, log_dir, [3, 2])
    # The reset callbacks ran once, in the new world, with its size.
    assert summary["starts"][1]["resets"] == [2]
    assert "world 1: 2 rank(s)" in result.stderr and "rank 2 on localhost" in result.stderr


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
