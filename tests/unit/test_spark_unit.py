"""hvdlite.spark's parts that need no Spark: the task service with its remote shell
(task_shell.py, run as hvdliterun would run it), and the placement of ranks on tasks."""
import json
import os
import secrets
import subprocess
import sys
import time

import pytest

import needs

needs.import_or_skip("pyspark", "spark")   # hvdlite.spark's package imports it

from hvdlite.spark import service as spark_service  # noqa: E402
from hvdlite.spark.driver import Placement, _launcher_argv  # noqa: E402
from hvdlite.spark.service import TaskInfo, TaskService  # noqa: E402

TASK_SHELL = os.path.join(os.path.dirname(os.path.abspath(spark_service.__file__)),
                          "task_shell.py")


@pytest.fixture
def task_service(tmp_path):
    key = secrets.token_bytes(32)
    service = TaskService(key)
    tasks = tmp_path / "tasks.json"
    tasks.write_text(json.dumps({"hostA": ["127.0.0.1", service.port],
                                 "hostB": ["127.0.0.1", 1]}))
    env = dict(os.environ, HVDLITE_SPARK_KEY=key.hex())
    yield service, str(tasks), env
    service.close()


def shell(tasks, host, command):
    return [sys.executable, "-I", TASK_SHELL, "--tasks", tasks, host, command]


def test_a_command_runs_in_the_task_with_its_output_and_status(task_service):
    _, tasks, env = task_service
    done = subprocess.run(shell(tasks, "hostA", "echo out; echo err >&2; exit 3"),
                          env=env, capture_output=True, text=True, timeout=30)
    assert (done.returncode, done.stdout, done.stderr) == (3, "out\n", "err\n")


def test_an_unreachable_task_exits_255_naming_the_host(task_service):
    _, tasks, env = task_service
    for host in ("hostB", "hostC"):   # nothing listens; not in the file
        done = subprocess.run(shell(tasks, host, "true"), env=env, capture_output=True,
                              text=True, timeout=30)
        assert done.returncode == 255, done
        assert f"no Spark task on host {host}" in done.stderr


def test_a_wrong_key_is_refused(task_service):
    _, tasks, env = task_service
    env = dict(env, HVDLITE_SPARK_KEY=secrets.token_bytes(32).hex())
    done = subprocess.run(shell(tasks, "hostA", "echo ran"), env=env,
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 255 and "ran" not in done.stdout, done


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except OSError:
        return False


def _wait_for_pid(path):
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().strip():
            return int(path.read_text())
        time.sleep(0.1)
    raise AssertionError("the command did not start")


def _wait_gone(pid, what):
    deadline = time.monotonic() + 20
    while _alive(pid):
        assert time.monotonic() < deadline, f"the command outlived {what}"
        time.sleep(0.1)


def test_the_command_ends_when_the_caller_hangs_up(task_service, tmp_path):
    _, tasks, env = task_service
    pidfile = tmp_path / "pid"
    caller = subprocess.Popen(shell(tasks, "hostA", f"echo $$ > {pidfile}; exec sleep 300"),
                          env=env)
    pid = _wait_for_pid(pidfile)
    caller.kill()
    caller.wait()
    _wait_gone(pid, "its caller")


def test_the_command_ends_when_the_task_ends(task_service, tmp_path):
    service, tasks, env = task_service
    pidfile = tmp_path / "pid"
    caller = subprocess.Popen(shell(tasks, "hostA", f"echo $$ > {pidfile}; exec sleep 300"),
                          env=env, stderr=subprocess.DEVNULL)
    pid = _wait_for_pid(pidfile)
    service.close()
    _wait_gone(pid, "its task")
    assert caller.wait(20) != 0


def test_ranks_fill_hosts_in_the_order_of_their_first_task():
    def task(index, host):
        return TaskInfo(index, host, f"10.0.0.{ord(host[-1])}", 5000 + index, 100 + index,
                        None)

    placement = Placement.of([task(0, "hB"), task(1, "hA"), task(2, "hB"), task(3, "hA"),
                              task(4, "hC")])
    assert placement.host_list() == "10.0.0.66:2,10.0.0.65:2,10.0.0.67:1"
    assert [t.index for t in placement.rank_tasks] == [0, 2, 1, 3, 4]
    assert placement.starters == {"10.0.0.66": ("10.0.0.66", 5000),
                                  "10.0.0.65": ("10.0.0.65", 5001),
                                  "10.0.0.67": ("10.0.0.67", 5004)}


def test_the_launcher_gets_hvdliteruns_flags_for_runs_arguments():
    placement = Placement.of([TaskInfo(0, "hA", "10.0.0.1", 5000, 100, None),
                              TaskInfo(1, "hB", "10.0.0.2", 5001, 101, None)])
    argv = _launcher_argv(placement, 2, "/tmp/tasks.json", 30.0, "-genv X 1", 2,
                          ["eth1", "eth2"])
    head = argv[:argv.index("--")] if "--" in argv else argv
    assert argv[1:5] == ["-m", "hvdlite.runner", "-np", "2"]
    assert head[head.index("-H") + 1] == "10.0.0.1:1,10.0.0.2:1"
    assert head[head.index("--start-timeout") + 1] == "30"
    assert head[head.index("--network-interface") + 1] == "eth1,eth2"
    assert head[head.index("--mpi-args") + 1] == "-genv X 1"
    assert "--verbose" in head
    shell = head[head.index("--remote-shell") + 1]
    assert shell.endswith("--tasks /tmp/tasks.json {host}") and "task_shell.py" in shell
    assert argv[-2:] == ["-m", "hvdlite.spark"]
    quiet = _launcher_argv(placement, 2, "/tmp/tasks.json", 30.0, None, 1, None)
    assert not {"--verbose", "--network-interface", "--mpi-args"} & set(quiet)
