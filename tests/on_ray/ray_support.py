"""What the Ray tests share: the workers' PYTHONPATH, and the checks that nothing
of a Ray cluster is left behind.

Workers import the tests' helpers (ray_bodies.py) and this checkout's hvdlite through
PYTHONPATH, which Ray's worker processes inherit from the process that started them.
"""
import os
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(os.path.dirname(HERE))
# Ray's own start is the slow part on 2 cores: small clusters, no dashboard, no stats.
RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_DISABLE_DOCKER_CPU_WARNING": "1",
           "OMP_NUM_THREADS": "1"}


def worker_pythonpath():
    """PYTHONPATH for Ray's workers: this checkout, the tests' helpers and the examples
    first."""
    parts = [REPO_ROOT, HERE, os.path.join(REPO_ROOT, "examples")] + [p for p in os.environ.get("PYTHONPATH", "").split(":") if p]
    return ":".join(dict.fromkeys(parts))


def descendants(pid):
    """Every live process below ``pid`` (read from /proc)."""
    children = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2:].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def command_line(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "?"


def assert_all_gone(pids, within_s=20.0, what="Ray processes"):
    """Waits up to ``within_s`` for ``pids`` to end; fails naming those left."""
    deadline = time.monotonic() + within_s
    left = [p for p in pids if alive(p)]
    while left and time.monotonic() < deadline:
        time.sleep(0.25)
        left = [p for p in left if alive(p)]
    assert not left, f"{what} left behind: " + "; ".join(
        f"{p}: {command_line(p)[:120]}" for p in left)


def rank_processes():
    """Live processes of this checkout's handoff.py (a rank's process under mpiexec)."""
    marker = os.path.join(REPO_ROOT, "hvdlite", "ray", "handoff.py")
    return [int(e) for e in os.listdir("/proc")
            if e.isdigit() and marker in command_line(int(e)) and alive(int(e))]


def train_logs_tail(lines=40):
    """The last ``lines`` of each of Ray Train's logs (controller and workers) of this
    Ray session, newest file last: what a hung ``fit`` was doing."""
    import glob

    import ray

    try:
        logs = ray._private.worker.global_worker.node.get_logs_dir_path()
    except AttributeError:
        logs = "/tmp/ray/session_latest/logs"
    parts = []
    for path in sorted(glob.glob(os.path.join(logs, "train", "*.log")), key=os.path.getmtime):
        try:
            with open(path, errors="replace") as f:
                tail = f.readlines()[-lines:]
        except OSError:
            continue
        parts.append(f"== {os.path.basename(path)}\n" + "".join(tail))
    return "\n".join(parts) or f"(no Ray Train log under {logs}/train)"


def fit_within(trainer, within_s):
    """``trainer.fit()``, failing the test with Ray Train's logs if it has not returned
    within ``within_s`` seconds (a hang named, rather than the test's timeout)."""
    import threading

    import pytest

    outcome = {}

    def fit():
        try:
            outcome["result"] = trainer.fit()
        except BaseException as exc:  # re-raised in the test's thread
            outcome["error"] = exc

    from ray.util import placement_group_table

    groups_before = set(placement_group_table())
    thread = threading.Thread(target=fit, name="ray-train-fit", daemon=True)
    thread.start()
    thread.join(within_s)
    if thread.is_alive():
        logs = train_logs_tail()
        ended = end_train_run(groups_before)
        thread.join(30)  # fit raises once its controller is gone
        pytest.fail(f"Ray Train's fit has not returned within {within_s:g} s (its run was "
                    f"ended: {len(ended)} process(es) killed); its logs end:\n" + logs)
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]


# The titles Ray gives the processes of a Ray Train run's controller and workers.
TRAIN_TITLES = ("ray::TrainController", "ray::RayTrainWorker")


def train_run_processes():
    """Live processes of a Ray Train run under this process's Ray cluster."""
    return [p for p in descendants(os.getpid())
            if command_line(p).startswith(TRAIN_TITLES) and alive(p)]


def end_train_run(groups_before, within_s=30.0, quiet_s=3.0):
    """Ends a Ray Train run that is still going, so that the module's cluster gets its
    CPUs back for the tests after it: SIGKILLs its controller and workers until none has
    been seen for ``quiet_s`` (a worker still starting when the controller is killed takes
    its title later: on a loaded machine a run's workers can take longer than the bound to
    start), for at most ``within_s``; then removes the placement groups made since
    ``groups_before`` (ids; a group outlives the controller that made it: it is the
    driver's). Ray Train's controller takes no order from outside the thread that runs
    ``fit``. Returns the pids killed."""
    import signal

    from ray._raylet import PlacementGroupID
    from ray.util import placement_group_table
    from ray.util.placement_group import PlacementGroup, remove_placement_group

    killed = []
    deadline = time.monotonic() + within_s
    quiet_since = time.monotonic()
    while time.monotonic() < deadline:
        found = train_run_processes()
        if found:
            quiet_since = time.monotonic()
        elif time.monotonic() - quiet_since >= quiet_s:
            break
        for pid in found:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            if pid not in killed:
                killed.append(pid)
        time.sleep(0.25)
    for group, info in placement_group_table().items():
        if group not in groups_before and info["state"] != "REMOVED":
            remove_placement_group(PlacementGroup(PlacementGroupID.from_hex(group)))
    return killed
