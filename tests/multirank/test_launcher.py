"""hvdliterun running real 2-rank jobs.

The rank scripts here use the standard library only (no hvdlite core), so these tests
run before the native library is built. Ranks write their pids to files, so that "no
process is left behind" is checked by pid, not by name.
"""
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from hvdlite import build_record
from hvdlite.runner import mpi_command, openmpi
from hvdlite.runner.testing import (launcher_command, launcher_env, parse_tagged_output,
                                    pid_alive, run_launcher)

pytestmark = pytest.mark.timeout(300)

NP = 2
PY = sys.executable


def write_script(tmp_path, body, name="rank_script.py"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


# Prelude for scripts that record their pid (and a grandchild's) under PID_DIR.
PIDS = """
    import os, subprocess, sys, time
    RANK = int(os.environ["HVDLITE_RANK"])
    PID_DIR = sys.argv[1]
    def record(tag, pid):
        tmp = os.path.join(PID_DIR, f"{tag}.{RANK}.tmp")
        with open(tmp, "w") as f:
            f.write(str(pid))
        os.rename(tmp, os.path.join(PID_DIR, f"{tag}.{RANK}"))
    # A grandchild: the job's end must reach the ranks' children too.
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    record("child", child.pid)
    record("rank", os.getpid())
"""


def recorded_pids(pid_dir):
    pids = {}
    for name in os.listdir(pid_dir):
        if not name.endswith(".tmp"):
            with open(os.path.join(pid_dir, name)) as f:
                pids[name] = int(f.read())
    return pids


def wait_for_pid_files(pid_dir, count, proc, timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pids = recorded_pids(pid_dir)
        if len(pids) >= count:
            return pids
        if proc is not None and proc.poll() is not None:
            break
        time.sleep(0.1)
    pytest.fail(f"ranks did not record {count} pids within {timeout} s: "
                f"{recorded_pids(pid_dir)}")


def assert_all_gone(pids, within=10.0):
    """Every recorded process ends within ``within`` s of the launcher's exit."""
    deadline = time.monotonic() + within
    alive = {}
    while time.monotonic() < deadline:
        alive = {name: pid for name, pid in pids.items() if pid_alive(pid)}
        if not alive:
            return
        time.sleep(0.1)
    for pid in alive.values():  # don't leak them into the next test
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    pytest.fail(f"processes left behind after the launcher exited: {alive}")


class Launcher:
    """A launcher started in the background, for tests that signal it mid-job."""

    def __init__(self, args, env=None):
        self.proc = subprocess.Popen(launcher_command() + list(args), env=launcher_env(env),
                                     stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True,
                                     start_new_session=True)

    def finish(self, timeout):
        try:
            out, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            out, err = self.proc.communicate()
            pytest.fail(f"launcher did not exit within {timeout} s\n{out}\n{err}")
        return self.proc.returncode, out, err

    def kill(self):
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def start_recording_job(tmp_path, body):
    """Starts a job of NP ranks running PIDS + ``body`` in the background; returns the
    Launcher and the pids once every rank and its grandchild recorded theirs."""
    script = write_script(tmp_path, PIDS + body)
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    launcher = Launcher(["-np", str(NP), PY, script, str(pid_dir)])
    try:
        return launcher, wait_for_pid_files(pid_dir, 2 * NP, launcher.proc)
    except BaseException:
        launcher.kill()
        raise


def test_two_ranks_tagged_output(tmp_path):
    script = write_script(tmp_path, """
        import os, sys
        rank = os.environ["HVDLITE_RANK"]
        print("hello from rank", rank)
        print("warning from rank", rank, file=sys.stderr)
        sys.stdout.write("last line without newline " + rank)
    """)
    job = run_launcher(["-np", str(NP), PY, script], timeout=120).check()
    for rank in range(NP):
        assert job.lines(rank) == [f"hello from rank {rank}",
                                   f"last line without newline {rank}"], job.describe()
        assert job.lines(rank, "stderr") == [f"warning from rank {rank}"], job.describe()
    # Every output line carries a tag; nothing else is printed on success.
    assert all(line.startswith(("[0]<stdout>:", "[1]<stdout>:"))
               for line in job.stdout.splitlines()), job.describe()


def test_lines_are_never_interleaved(tmp_path):
    script = write_script(tmp_path, """
        import os, sys
        rank = os.environ["HVDLITE_RANK"]
        for i in range(3000):
            # Unbuffered, in pieces, so lines reach the pipe split at odd places.
            sys.stdout.write(f"rank {rank} line {i} " + "x" * 300)
            sys.stdout.flush()
            sys.stdout.write(" end\\n")
            sys.stdout.flush()
    """)
    job = run_launcher(["-np", str(NP), PY, script], timeout=180).check()
    lines = parse_tagged_output(job.stdout)
    for rank in range(NP):
        expected = [f"rank {rank} line {i} " + "x" * 300 + " end" for i in range(3000)]
        assert lines[(rank, "stdout")] == expected
    assert len(job.stdout.splitlines()) == NP * 3000


def test_failed_rank_ends_the_job_with_its_exit_code(tmp_path):
    script = write_script(tmp_path, PIDS + """
    if RANK == 1:
        while len([n for n in os.listdir(PID_DIR) if not n.endswith(".tmp")]) < 4:
            time.sleep(0.05)
        print("rank 1 failing", flush=True)
        sys.exit(3)
    time.sleep(300)
    """)
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    start = time.monotonic()
    job = run_launcher(["-np", str(NP), PY, script, str(pid_dir)], timeout=120)
    elapsed = time.monotonic() - start
    job.check(3)
    assert "rank 1" in job.stderr and "exited with code 3" in job.stderr, job.describe()
    assert elapsed < 60, f"the surviving rank was not ended promptly ({elapsed:.1f} s)"
    pids = recorded_pids(pid_dir)
    assert len(pids) == 2 * NP, pids
    assert_all_gone(pids)


def test_rank_killed_by_signal_is_reported(tmp_path):
    script = write_script(tmp_path, """
        import os, signal, time
        if os.environ["HVDLITE_RANK"] == "0":
            time.sleep(0.5)
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(300)
    """)
    job = run_launcher(["-np", str(NP), PY, script], timeout=120)
    job.check(128 + signal.SIGKILL)
    assert "rank 0" in job.stderr and "killed by signal 9 (SIGKILL)" in job.stderr


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_to_launcher_ends_every_rank(tmp_path, sig, code):
    # Rank 1 ignores SIGTERM: the job's end must still reach it (SIGKILL after a grace).
    launcher, pids = start_recording_job(tmp_path, """
    if RANK == 1:
        signal_module = __import__("signal")
        signal_module.signal(signal_module.SIGTERM, signal_module.SIG_IGN)
    print("sleeping", flush=True)
    time.sleep(300)
    """)
    try:
        start = time.monotonic()
        launcher.proc.send_signal(sig)
        returncode, out, err = launcher.finish(timeout=60)
        elapsed = time.monotonic() - start
    finally:
        launcher.kill()
    assert returncode == code, (out, err)
    assert f"received {signal.Signals(sig).name}" in err
    assert elapsed < 20, f"ending the job took {elapsed:.1f} s"
    assert_all_gone(pids)


def test_killed_launcher_leaves_nothing_behind(tmp_path):
    launcher, pids = start_recording_job(tmp_path, """
    time.sleep(300)
    """)
    try:
        # SIGKILL to the launcher alone: the wrappers notice its connection drop.
        launcher.proc.kill()
        launcher.finish(timeout=30)
    finally:
        launcher.kill()
    assert_all_gone(pids, within=15)


def test_environment_and_tuning_flags_reach_every_rank(tmp_path):
    script = write_script(tmp_path, """
        import json, os
        keys = [k for k in os.environ if k.startswith(("HVDLITE_", "PMI_", "OMPI_"))]
        print("ENV " + json.dumps({k: os.environ[k] for k in keys + ["FROM_TEST"]}))
    """)
    timeline = str(tmp_path / "timeline.json")
    job = run_launcher(["-np", str(NP), "--timeline-filename", timeline,
                        "--fusion-threshold-mb", "2", "--cycle-time-ms", "3.5",
                        "--cache-capacity", "7", "--stall-check-time", "9",
                        PY, script], env={"FROM_TEST": "some value with spaces"},
                       timeout=120).check()
    for rank in range(NP):
        (line,) = job.lines(rank)
        env = json.loads(line[len("ENV "):])
        assert env["FROM_TEST"] == "some value with spaces"
        assert env["HVDLITE_TIMELINE"] == timeline
        assert env["HVDLITE_FUSION_THRESHOLD"] == str(2 * 1024 * 1024)
        assert env["HVDLITE_CYCLE_TIME"] == "3.5"
        assert env["HVDLITE_CACHE_CAPACITY"] == "7"
        assert env["HVDLITE_STALL_CHECK_TIME"] == "9"
        assert env["HVDLITE_RANK"] == str(rank)
        assert env["HVDLITE_SIZE"] == str(NP)
        assert env["HVDLITE_LOCAL_RANK"] == str(rank)
        assert env["HVDLITE_LOCAL_SIZE"] == str(NP)
        # The MPI's own rank variables are there for the core's MPI_Init ...
        assert env.get("PMI_RANK", env.get("OMPI_COMM_WORLD_RANK")) == str(rank)
        # ... and the launcher's control secret is not.
        assert "HVDLITE_LAUNCHER_TOKEN" not in env and "HVDLITE_LAUNCHER_ADDR" not in env


def test_host_list_localhost(tmp_path):
    script = write_script(tmp_path, """
        import os
        print("rank", os.environ["HVDLITE_RANK"], "of", os.environ["HVDLITE_SIZE"])
    """)
    job = run_launcher(["-H", "localhost:2", "--verbose", PY, script], timeout=120).check()
    for rank in range(NP):
        assert job.lines(rank) == [f"rank {rank} of {NP}"]
    # --verbose shows the mpiexec command: the host list went to mpiexec.
    assert "localhost:2" in job.stderr and "running:" in job.stderr


def test_output_filename_writes_one_log_per_rank(tmp_path):
    script = write_script(tmp_path, """
        import os, sys
        print("out", os.environ["HVDLITE_RANK"])
        print("err", os.environ["HVDLITE_RANK"], file=sys.stderr)
    """)
    logs = tmp_path / "logs"
    job = run_launcher(["-np", str(NP), "--output-filename", str(logs), PY, script],
                       timeout=120).check()
    for rank in range(NP):
        text = (logs / f"rank.{rank}.log").read_text()
        assert sorted(text.splitlines()) == [f"err {rank}", f"out {rank}"]
        assert job.lines(rank) == [f"out {rank}"]  # still on the console too


def test_command_is_an_argument_vector(tmp_path):
    script = write_script(tmp_path, """
        import json, sys
        print(json.dumps(sys.argv[1:]))
    """)
    tricky = ["a b", "$HOME", "'quoted'", ";", "--epochs", "3"]
    job = run_launcher(["-np", str(NP), PY, script, *tricky], timeout=120).check()
    for rank in range(NP):
        assert json.loads(job.lines(rank)[0]) == tricky


def test_missing_program_fails_clearly():
    job = run_launcher(["-np", str(NP), "hvdlite-no-such-program"], timeout=120)
    job.check(127)
    assert "cannot run 'hvdlite-no-such-program'" in job.stderr
    assert "exited with code 127" in job.stderr


def test_start_timeout_ends_a_job_that_never_starts(tmp_path):
    # An "mpiexec" that never starts any rank: the launcher gives up after
    # --start-timeout and ends it (checked by pid). It names itself as the build's MPI.
    fake = tmp_path / "fake-mpiexec"
    pid_file = tmp_path / "fake.pid"
    version = ("mpirun (Open MPI) fake"
               if build_record.read_if_readable().get("mpi_implementation") == "Open MPI"
               else "HYDRA build details: Version: fake")
    fake.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        if [ "$1" = "--version" ]; then echo "{version}"; exit 0; fi
        echo $$ > {pid_file}
        exec sleep 300
    """))
    fake.chmod(0o755)
    start = time.monotonic()
    job = run_launcher(["-np", str(NP), "--start-timeout", "2", PY, "-c", "pass"],
                       env={"HVDLITE_MPIEXEC": str(fake)}, timeout=120)
    assert time.monotonic() - start < 30
    job.check(1)
    assert "only 0 of 2 ranks started within 2 s" in job.stderr
    assert_all_gone({"fake mpiexec": int(pid_file.read_text())})


def test_mpiexec_refusing_its_arguments_is_reported():
    job = run_launcher(["-np", str(NP), "--mpi-args", "-no-such-mpiexec-flag", PY, "-c",
                        "pass"], timeout=120)
    assert job.returncode != 0, job.describe()
    assert "mpiexec exited with code" in job.stderr, job.describe()


def test_open_mpi_runs_as_root_only_when_told(tmp_path, monkeypatch):
    launcher = mpi_command.probe_launcher(mpi_command.find_mpiexec())
    if launcher.flavor is not mpi_command.MpiFlavor.OPENMPI or not openmpi.is_root():
        pytest.skip("Open MPI's refusal to run as root needs Open MPI and root "
                    f"(launcher: {launcher.implementation})")
    for name in openmpi.ROOT_ENV:
        monkeypatch.delenv(name, raising=False)
    script = write_script(tmp_path, "import os; print('rank', os.environ['HVDLITE_RANK'])")
    job = run_launcher(["-np", str(NP), PY, script], timeout=120)
    assert job.returncode == 1, job.stderr
    assert "--allow-run-as-root" in job.stderr and "OMPI_ALLOW_RUN_AS_ROOT=1" in job.stderr
    assert not job.lines(0) and not job.lines(1)
    for args, env in ((["--allow-run-as-root"], None),
                      ([], {name: "1" for name in openmpi.ROOT_ENV})):
        job = run_launcher([*args, "-np", str(NP), "--verbose", PY, script], timeout=120,
                           env=env).check()
        assert "--allow-run-as-root" in job.stderr  # the mpirun command --verbose logs
        assert [job.lines(r) for r in range(NP)] == [[f"rank {r}"] for r in range(NP)]
