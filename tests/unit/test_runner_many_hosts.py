"""hvdliterun's many-host flags without running a job: the remote shell command, the
mpiexec argv it makes, remote_start.py's argument handling, rank placement."""
import os
import subprocess
import sys

import pytest

from hvdlite.runner import hosts, job, launch, remote_start
from hvdlite.runner.mpi_command import MpiFlavor, MpiLauncher

HYDRA = MpiLauncher("/opt/mpich/bin/mpiexec", MpiFlavor.HYDRA, "Version: 5.0.2\n")
OPENMPI = MpiLauncher("/opt/ompi/bin/mpirun", MpiFlavor.OPENMPI, "mpirun (Open MPI) 4.1.5\n")


def config(*args):
    return launch.parse_command_line(list(args))


def test_ssh_flags_make_an_ssh_command(tmp_path, monkeypatch):
    monkeypatch.delenv("HVDLITE_REMOTE_SHELL", raising=False)
    key = tmp_path / "id"
    key.write_text("k")
    cfg = config("-np", "2", "-H", "a:1,b:1", "--ssh-port", "2222", "--ssh-identity-file",
                 str(key), "--start-timeout", "15", "python", "x.py")
    words = cfg.remote_shell.split()
    assert words[0] == "ssh"
    assert words[words.index("-p") + 1] == "2222"
    assert words[words.index("-i") + 1] == str(key)
    assert "ConnectTimeout=15" in words


def test_no_flags_no_remote_shell_unless_the_variable_says(monkeypatch):
    monkeypatch.delenv("HVDLITE_REMOTE_SHELL", raising=False)
    assert config("-np", "2", "python", "x.py").remote_shell is None
    monkeypatch.setenv("HVDLITE_REMOTE_SHELL", "rsh -l me")
    assert config("-np", "2", "python", "x.py").remote_shell == "rsh -l me"
    assert config("-np", "2", "--remote-shell", "docker exec {host} sh -c", "python",
                  "x.py").remote_shell == "docker exec {host} sh -c"


@pytest.mark.parametrize("args,message", [
    (["--remote-shell", "rsh", "--ssh-port", "22"], "cannot go with it"),
    (["--remote-shell", "  "], "must not be empty"),
    (["--ssh-port", "70000"], "1-65535"),
    (["--ssh-identity-file", "/nonexistent/key"], "no such file"),
])
def test_bad_remote_flags_are_refused(args, message, capsys):
    with pytest.raises(SystemExit) as info:
        config("-np", "2", *args, "python", "x.py")
    assert info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("launcher,expected", [
    (HYDRA, ["-launcher", "rsh", "-launcher-exec", "/tmp/rs", "-iface", "eth1"]),
    (OPENMPI, ["--mca", "plm_rsh_agent", "/tmp/rs", "--mca", "btl_tcp_if_include", "eth1",
               "--mca", "oob_tcp_if_include", "eth1"]),
])
def test_mpiexec_gets_the_remote_start_and_interface(launcher, expected):
    cfg = config("-np", "4", "-H", "a:2,b:2", "--network-interface", "eth1", "python", "x.py")
    argv = job.build_job_command(cfg, launcher, {}, python="/py", run_as_root=False,
                                    remote_start="/tmp/rs")
    joined = " ".join(argv)
    assert " ".join(expected) in joined, argv
    assert joined.index(" ".join(expected)) < joined.index("rank_wrapper.py")


def test_remote_start_script_runs_the_shell_with_host_and_joined_command(tmp_path):
    log = tmp_path / "log"
    fake = tmp_path / "fake-ssh"
    fake.write_text(f"#!/bin/sh\nfor a in \"$@\"; do echo \"<$a>\"; done > {log}\n")
    fake.chmod(0o755)
    script = job.write_remote_start_script(str(tmp_path), f"{fake} -p 2", sys.executable)
    # hydra's rsh launcher: HOST then the proxy command's words.
    subprocess.run([script, "node7", "/bin/proxy", "--port", "h:1"], check=True, timeout=30)
    assert log.read_text().split() == ["<-p>", "<2>", "<node7>", "</bin/proxy", "--port",
                                       "h:1>"]


def test_remote_start_names_an_unreachable_host(tmp_path):
    fake = tmp_path / "no-route"
    fake.write_text("#!/bin/sh\necho 'ssh: connect: No route to host' >&2\nexit 255\n")
    fake.chmod(0o755)
    out = subprocess.run([sys.executable, remote_start.__file__, "--shell", str(fake), "--",
                          "-x", "node9", "cmd"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 255
    assert remote_start.UNREACHABLE_PREFIX + "node9: " in out.stderr


def test_remote_argv_places_the_host():
    assert remote_start.remote_argv("ssh -p 22", "n1", ["a", "b"]) == ["ssh", "-p", "22", "n1",
                                                                      "a b"]
    assert remote_start.remote_argv("docker exec {host} sh -c", "c1", ["ls", "-l"]) == [
        "docker", "exec", "c1", "sh", "-c", "ls -l"]
    assert remote_start.split_caller_args(["-x", "-p", "22", "n1", "cmd"]) == ("n1", ["cmd"])
    with pytest.raises(ValueError):
        remote_start.split_caller_args(["-x", "n1"])


def test_ranks_fill_hosts_in_order():
    placed = hosts.rank_hosts([hosts.HostSlots("a", 3), hosts.HostSlots("b", 1)], 4)
    assert placed == ["a", "a", "a", "b"]
    assert hosts.rank_hosts([hosts.HostSlots("a", 2), hosts.HostSlots("b", 2)], 3) == [
        "a", "a", "b"]


def test_interface_address_of_loopback_and_a_missing_interface():
    assert launch.interface_address("lo") == "127.0.0.1"
    with pytest.raises(launch.UsageError, match="nosuchnic0"):
        launch.interface_address("nosuchnic0")


def test_a_silent_host_is_reported_with_all_its_ranks_that_missed_beats():
    # A cut link silences a host's ranks at once, but their last beats were up to an
    # interval apart: when the first passes the peer timeout, its host's others that
    # missed beats go in the same report; a rank of another host a beat late does not.
    from hvdlite.runner import supervisor, wire

    sup = object.__new__(supervisor.JobSupervisor)
    sup.peer_timeout, sup.result = 6.0, None
    now = 1000.0
    last_heard = {0: now - 0.3, 1: now - 2.5, 2: now - 5.6, 3: now - 6.4}
    sup.ranks = {r: supervisor.RankState(r, host="h1" if r < 2 else "h2") for r in last_heard}
    sup.connections = []
    for r, heard in last_heard.items():
        conn = object.__new__(supervisor._Connection)
        conn.rank, conn.exited, conn.last_heard = r, False, heard
        sup.connections.append(conn)
    sent, failed = [], []
    sup._send = lambda conn, kind: sent.append((conn.rank, kind))
    sup._fail = lambda code, message, lost=(), reason="": failed.append((message, list(lost)))
    sup._keep_alive(now)
    assert sorted(r for r, _ in sent) == [0, 1, 2, 3]
    assert all(kind == wire.MSG_HEARTBEAT for _, kind in sent)
    assert len(failed) == 1, failed
    message, lost = failed[0]
    assert lost == [2, 3], failed
    assert message.startswith("lost ranks 2, 3 on host h2: no word from them for 6 s"), message

    # Nothing is reported while no rank is past the timeout.
    failed.clear()
    for conn in sup.connections:
        conn.last_heard = max(conn.last_heard, now - 5.9)
    sup._keep_alive(now)
    assert failed == []
