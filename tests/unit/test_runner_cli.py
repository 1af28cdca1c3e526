"""hvdliterun without running a job: parsing, host lists, mpiexec argv, bad input."""
import ast
import os
import signal
import subprocess
import sys

import pytest

import hvdlite.runner as runner_package
from hvdlite import build_record
from hvdlite.runner import (hosts, job, launch, mpi_command, openmpi, rank_wrapper, supervisor,
                            wire)
from hvdlite.runner.hosts import HostSlots, HostSpecError
from hvdlite.runner.mpi_command import MpiFlavor, MpiLauncher
from hvdlite.runner.testing import launcher_command, launcher_env, parse_tagged_output

HYDRA = MpiLauncher("/opt/mpich/bin/mpiexec", MpiFlavor.HYDRA, "HYDRA build details:\n"
                    "    Version:                                 5.0.2\n")
OPENMPI = MpiLauncher("/opt/ompi/bin/mpirun", MpiFlavor.OPENMPI,
                      "mpirun (Open MPI) 4.1.5\n\nReport bugs to http://www.open-mpi.org/")


def run_cli(*args, timeout=60):
    """Runs ``python -m hvdlite.runner ARGS``; kills its process group on timeout."""
    proc = subprocess.Popen(launcher_command() + list(args), env=launcher_env(),
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"hvdliterun {' '.join(args)} did not finish in {timeout} s:\n{out}\n{err}")
    return proc.returncode, out, err


def config(*args):
    return launch.parse_command_line(list(args))


# -- host lists ------------------------------------------------------------------------

def test_host_string_with_slots():
    assert hosts.parse_host_string("host1:2,host2:4") == [HostSlots("host1", 2),
                                                           HostSlots("host2", 4)]


def test_host_string_defaults_to_one_slot_and_accepts_ipv6():
    assert hosts.parse_host_string("a, 10.0.0.2:3,[fe80::1]:2") == [
        HostSlots("a", 1), HostSlots("10.0.0.2", 3), HostSlots("fe80::1", 2)]


@pytest.mark.parametrize("spec", ["", "host1:2,,host2:2", "host1:", "host1:x", "host1:0",
                                  "host1:-1", ":2", "host1:2:3", "host;rm -rf:2",
                                  "a b:2", "-oProxyCommand=x:1", "h1:2,h1:2"])
def test_malformed_host_strings_are_refused(spec):
    with pytest.raises(HostSpecError):
        hosts.parse_host_string(spec)


def test_hostfile_text():
    text = "# cluster\nnode1 slots=2\n\nnode2   slots=3  # fast one\nnode3\n"
    assert hosts.parse_hostfile_text(text) == [HostSlots("node1", 2), HostSlots("node2", 3),
                                               HostSlots("node3", 1)]


@pytest.mark.parametrize("text", ["node1 slots=two\n", "node1 cores=2\n", "node1 2\n",
                                  "# only a comment\n", "node1 slots=0\n"])
def test_malformed_hostfiles_are_refused(text):
    with pytest.raises(HostSpecError):
        hosts.parse_hostfile_text(text, source="hf")


def test_hostfile_error_names_file_and_line():
    with pytest.raises(HostSpecError, match=r"hf:2"):
        hosts.parse_hostfile_text("ok slots=1\nbad slots=x\n", source="hf")


def test_local_hosts():
    assert hosts.all_local([HostSlots("localhost", 2), HostSlots("127.0.0.1", 1)])
    assert not hosts.all_local([HostSlots("localhost", 2), HostSlots("node-elsewhere", 1)])


# -- argument parsing ------------------------------------------------------------------

def test_command_keeps_its_own_flags():
    cfg = config("-np", "4", "python", "train.py", "--epochs", "3", "-np", "9")
    assert cfg.num_ranks == 4
    assert cfg.command == ["python", "train.py", "--epochs", "3", "-np", "9"]


def test_double_dash_before_command():
    assert config("-np", "2", "--", "python", "-c", "pass").command == ["python", "-c", "pass"]


def test_np_defaults_to_total_slots():
    assert config("-H", "a:2,b:3", "prog").num_ranks == 5


def test_tuning_flags_become_environment():
    cfg = config("-np", "2", "--timeline-filename", "/tmp/tl.json",
                 "--fusion-threshold-mb", "32", "--cycle-time-ms", "2.5",
                 "--cache-capacity", "0", "--stall-check-time", "60", "prog")
    assert cfg.tuning_env == {
        "HVDLITE_TIMELINE": "/tmp/tl.json",
        "HVDLITE_FUSION_THRESHOLD": str(32 * 1024 * 1024),
        "HVDLITE_CYCLE_TIME": "2.5",
        "HVDLITE_CACHE_CAPACITY": "0",
        "HVDLITE_STALL_CHECK_TIME": "60",
    }


def test_autotune_flags_become_environment():
    cfg = config("-np", "2", "--autotune", "--autotune-log-file", "/tmp/at.csv", "prog")
    assert cfg.tuning_env == {"HVDLITE_AUTOTUNE": "1", "HVDLITE_AUTOTUNE_LOG": "/tmp/at.csv"}


def test_no_tuning_flags_sets_nothing():
    assert config("-np", "1", "prog").tuning_env == {}


def test_mpi_args_are_shell_split():
    cfg = config("-np", "2", "--mpi-args", "-bind-to core -env A 'x y'", "prog")
    assert cfg.mpi_args == ["-bind-to", "core", "-env", "A", "x y"]


def test_mpi_args_may_start_with_a_dash():
    cfg = config("-np", "2", "--mpi-args", "-genvnone", "prog", "--mpi-args", "x")
    assert cfg.mpi_args == ["-genvnone"]
    assert cfg.command == ["prog", "--mpi-args", "x"]


def test_hostfile_flag(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("n1 slots=2\nn2 slots=2\n")
    cfg = config("-np", "3", "--hostfile", str(hostfile), "prog")
    assert cfg.hosts == [HostSlots("n1", 2), HostSlots("n2", 2)]
    assert cfg.num_ranks == 3


# -- mpiexec command lines -------------------------------------------------------------

def _job_argv(launcher, *args, env=None):
    cfg = config(*args)
    return job.build_job_command(cfg, launcher, env or {"PATH": "/usr/bin"},
                                 python="/venv/bin/python", run_as_root=False)


def _wrapper(*command):
    return ["/venv/bin/python", "-I", os.path.abspath(rank_wrapper.__file__), "--", *command]


def test_hydra_multi_host_command_line():
    argv = _job_argv(HYDRA, "-np", "4", "-H", "node1:2,node2:2", "--cycle-time-ms", "5",
                     "--mpi-args", "-launcher ssh", "python", "train.py", "--epochs", "3")
    assert argv == ["/opt/mpich/bin/mpiexec", "-n", "4", "-hosts", "node1:2,node2:2",
                    "-genvall", "-genv", "HVDLITE_CYCLE_TIME", "5", "-launcher", "ssh",
                    *_wrapper("python", "train.py", "--epochs", "3")]


def test_openmpi_multi_host_command_line():
    argv = _job_argv(OPENMPI, "-np", "3", "-H", "node1:2,node2:1", "--cache-capacity", "64",
                     "python", "train.py",
                     env={"PATH": "/usr/bin", "PYTHONPATH": "/src", "OMPI_COMM_WORLD_RANK": "0",
                          "PWD": "/x", "BASH_FUNC_f%%": "() {}"})
    assert argv == ["/opt/ompi/bin/mpirun", "-np", "3", "-H", "node1:2,node2:1",
                    "--bind-to", "none", "--map-by", "slot",
                    "-x", "PATH", "-x", "PYTHONPATH", "-x", "HVDLITE_CACHE_CAPACITY=64",
                    "-x", "OMPI_MCA_op=^avx", *_wrapper("python", "train.py")]


def test_openmpi_ranks_leave_out_the_saturating_avx_op_unless_the_user_chose():
    argv = _job_argv(OPENMPI, "-np", "2", "prog")
    assert argv[argv.index("OMPI_MCA_op=^avx") - 1] == "-x"
    for args, env in ((["--mpi-args", "--mca op avx"], None),
                      ([], {"PATH": "/usr/bin", "OMPI_MCA_op": "avx"})):
        argv = _job_argv(OPENMPI, *args, "-np", "2", "prog", env=env)
        assert not any(a.startswith("OMPI_MCA_op=") for a in argv), argv
    assert not any("OMPI_MCA_op" in a for a in _job_argv(HYDRA, "-np", "2", "prog"))


def test_openmpi_single_host_oversubscribes_and_allows_root():
    options = mpi_command.MpiCommandOptions(launcher=OPENMPI, num_ranks=2,
                                            rank_command=["prog"], run_as_root=True)
    argv = mpi_command.build_mpi_command(options)
    assert argv[:4] == ["/opt/ompi/bin/mpirun", "-np", "2", "--oversubscribe"]
    assert "--allow-run-as-root" in argv and "-H" not in argv


@pytest.mark.parametrize("root,flag,env,allowed", [
    (False, True, {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}, False),
    (True, False, {}, False),
    (True, False, {"OMPI_ALLOW_RUN_AS_ROOT": "1"}, False),
    (True, False, {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "0"}, False),
    (True, True, {}, True),
    (True, False, {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}, True),
])
def test_openmpi_runs_as_root_only_as_root_and_when_told(monkeypatch, root, flag, env, allowed):
    assert openmpi.run_as_root(flag, env, root=root) is allowed
    monkeypatch.setattr(openmpi, "is_root", lambda: root)
    args = ["--allow-run-as-root"] if flag else []
    argv = job.build_job_command(config(*args, "-np", "2", "prog"), OPENMPI,
                                 {"PATH": "/usr/bin", **env}, python="/venv/bin/python")
    assert ("--allow-run-as-root" in argv) is allowed
    # Hydra has no such flag: the request changes nothing in its command line.
    hydra = job.build_job_command(config(*args, "-np", "2", "prog"), HYDRA,
                                  {"PATH": "/usr/bin", **env}, python="/venv/bin/python")
    assert "--allow-run-as-root" not in hydra


def test_a_launcher_of_another_implementation_than_the_build_is_named():
    ompi_build = {"mpi_implementation": "Open MPI", "mpi_version": "5.0.11",
                  "mpi_prefix": "/opt/ompi"}
    mpich_build = {"mpi_implementation": "MPICH", "mpi_version": "5.0.2"}
    message = mpi_command.launcher_mismatch(ompi_build, HYDRA)
    assert "built against Open MPI 5.0.11" in message and "MPICH (hydra) 5.0.2" in message
    assert HYDRA.path in message and "/opt/ompi/bin/mpiexec" in message
    message = mpi_command.launcher_mismatch(mpich_build, OPENMPI)
    assert "built against MPICH 5.0.2" in message and "Open MPI 4.1.5" in message
    assert mpi_command.launcher_mismatch(ompi_build, OPENMPI) is None
    assert mpi_command.launcher_mismatch(mpich_build, HYDRA) is None
    # Nothing recorded (an older build) or a launcher that said nothing: no verdict.
    assert mpi_command.launcher_mismatch({}, HYDRA) is None
    assert mpi_command.launcher_mismatch(ompi_build, MpiLauncher("/x", MpiFlavor.HYDRA)) is None


def test_hydra_single_host_has_no_host_list():
    argv = _job_argv(HYDRA, "-np", "2", "prog")
    assert argv[:4] == ["/opt/mpich/bin/mpiexec", "-n", "2", "-genvall"]
    assert "-hosts" not in argv


def test_flavour_detection():
    assert mpi_command.flavor_from_version_text(OPENMPI.version_text) is MpiFlavor.OPENMPI
    assert mpi_command.flavor_from_version_text("prterun (Open MPI) 5.0.3") is MpiFlavor.OPENMPI
    assert mpi_command.flavor_from_version_text(HYDRA.version_text) is MpiFlavor.HYDRA
    assert HYDRA.implementation == "MPICH (hydra) 5.0.2"
    assert OPENMPI.implementation == "Open MPI 4.1.5"


def test_mpiexec_search_order(tmp_path):
    system = tmp_path / "sys"
    (system / "bin").mkdir(parents=True)
    env = {"HVDLITE_MPI_DIR": str(system), "PATH": ""}
    order = mpi_command.candidate_mpiexecs(env, {"mpi_source": "wheel", "mpi_prefix": None})
    assert order[0] == str(system / "bin" / "mpiexec")
    assert os.path.join(sys.prefix, "bin", "mpiexec") in order
    built = mpi_command.candidate_mpiexecs(
        {"PATH": ""}, {"mpi_source": "system", "mpi_prefix": "/opt/ompi"})
    assert built[0] == "/opt/ompi/bin/mpiexec"
    assert os.path.join(sys.prefix, "bin", "mpiexec") not in built
    explicit = mpi_command.candidate_mpiexecs({"HVDLITE_MPIEXEC": "/x/mpirun"}, {})
    assert explicit[0] == "/x/mpirun"


def test_find_mpiexec_explains_what_it_tried(tmp_path):
    with pytest.raises(mpi_command.MpiNotFoundError, match="HVDLITE_MPIEXEC"):
        mpi_command.find_mpiexec({"HVDLITE_MPIEXEC": str(tmp_path / "nope")}, {})


def test_forwarded_environment_leaves_out_shell_and_mpi_variables():
    names = mpi_command.forwardable_env_names(
        {"HOME": "/root", "HVDLITE_X": "1", "PMI_RANK": "0", "_": "/bin/sh", "A-B": "1"})
    assert names == ["HOME", "HVDLITE_X"]


# -- the wire and the rank environment -------------------------------------------------

def test_frames_round_trip_in_pieces():
    stream = (wire.encode_frame(wire.MSG_STDOUT, b"a\nb\n")
              + wire.encode_frame(wire.MSG_KILL))
    reader = wire.FrameReader()
    frames = []
    for i in range(len(stream)):
        frames += reader.feed(stream[i:i + 1])
    assert frames == [(b"O", b"a\nb\n"), (b"K", b"")]


def test_rank_info_from_each_mpi():
    hydra = {"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}
    ompi = {"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "8",
            "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}
    assert rank_wrapper.rank_info(hydra) == {"rank": 3, "size": 4, "local_rank": 1,
                                             "local_size": 2}
    assert rank_wrapper.rank_info(ompi) == {"rank": 2, "size": 8, "local_rank": 0,
                                            "local_size": 4}
    assert rank_wrapper.rank_info({})["rank"] == 0


def test_return_codes_are_described():
    assert supervisor.describe_returncode(3) == "exited with code 3"
    assert supervisor.describe_returncode(-9) == "was killed by signal 9 (SIGKILL)"
    assert supervisor.exit_code_for(-15) == 143
    assert supervisor.exit_code_for(3) == 3


def test_parse_tagged_output():
    text = "[0]<stdout>:a\n[1]<stdout>:b: c\nhvdliterun: note\n[0]<stdout>:\n"
    assert parse_tagged_output(text) == {(0, "stdout"): ["a", ""], (1, "stdout"): ["b: c"]}


# -- bad input through the real entry point: exit code 2 and a clear message -----------

@pytest.mark.parametrize("args, message", [
    (["-np", "2", "-H", "host1:2,,host2", "prog"], "empty entry"),
    (["-np", "2", "-H", "host1:zero", "prog"], "not a positive integer"),
    (["-np", "2", "-H", "bad host:2", "prog"], "not a valid host name"),
    (["-np", "5", "-H", "localhost:2,otherhost:2", "prog"], "more than the 4 slots"),
    (["-np", "2"], "no command given"),
    ([], "no command given"),
    (["-np", "2", "--no-such-flag", "prog"], "unrecognized arguments: --no-such-flag"),
    (["-np", "0", "prog"], "-np must be at least 1"),
    (["-np", "two", "prog"], "invalid int value"),
    (["prog"], "-np is required"),
    (["-np", "2", "--cycle-time-ms", "0", "prog"], "--cycle-time-ms must be"),
    (["-np", "2", "--fusion-threshold-mb", "-1", "prog"], "--fusion-threshold-mb must be"),
    (["-np", "2", "--start-timeout", "0", "prog"], "--start-timeout must be"),
    (["-np", "2", "--mpi-args", "'unclosed", "prog"], "--mpi-args"),
    (["-np", "2", "-H", "a:1", "--hostfile", "f", "prog"], "not allowed with argument"),
    (["-np", "2", "--hostfile", "/nonexistent/hostfile", "prog"], "cannot read hostfile"),
])
def test_bad_input_exits_2(args, message):
    code, out, err = run_cli(*args)
    assert code == 2, (out, err)
    assert message in err
    assert "hvdliterun: error:" in err


def test_malformed_hostfile_exits_2(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("node1 slots=2\nnode2 slots=many\n")
    code, _, err = run_cli("-np", "2", "--hostfile", str(hostfile), "prog")
    assert code == 2
    assert f"{hostfile}:2" in err


def test_version_and_help():
    code, out, _ = run_cli("--version")
    assert code == 0 and out.startswith("hvdliterun (hvdlite) ")
    code, out, _ = run_cli("--help")
    assert code == 0 and "--fusion-threshold-mb" in out and "--check-build" in out


def test_check_build_reports_everything():
    code, out, err = run_cli("--check-build", timeout=120)
    assert code == 0, err
    for section in ("hvdlite ", "Native library:", "Frameworks:", "torch", "tensorflow",
                    "keras", "MPI:", "implementation:", "NCCL", "CUDA runtime"):
        assert section in out
    native = os.path.join(os.path.dirname(os.path.dirname(rank_wrapper.__file__)),
                          "libhvdlite.so")
    assert native in out
    if not os.path.exists(native):
        assert "MISSING" in out
        return
    # The implementation is the one the loaded library names, and it is the build's.
    info = build_record.read_if_readable()
    mpi = out.split("\nMPI:\n", 1)[1]
    loaded = mpi.split("[X] libmpi:", 1)[1].splitlines()[0].strip()
    assert os.path.basename(loaded) == info["mpi_soname"], out
    named = mpi.split("implementation:", 1)[1].splitlines()[0]
    assert info["mpi_implementation"] in named and info["mpi_version"] in named, out
    assert "MISMATCH" not in out


def test_runner_imports_without_native_library():
    # hvdlite.runner must not load libhvdlite.so: --check-build reports it missing, and
    # the launcher runs before the core is built.
    code = ("import sys, hvdlite.runner.launch, hvdlite.runner.check_build; "
            "assert 'hvdlite._native' not in sys.modules, sorted(sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], env=launcher_env(), timeout=60,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_rank_wrapper_runs_by_path_on_the_standard_library_alone():
    # Each rank starts the wrapper by path with -I (job.rank_command): it loads wire.py
    # by path and imports nothing of the hvdlite package (nor its native library).
    code = ("import runpy, sys; ns = runpy.run_path(sys.argv[1], run_name='wrapper'); "
            "assert not [m for m in sys.modules if m.split('.')[0] == 'hvdlite'], "
            "sorted(sys.modules); "
            "assert ns['wire'].MSG_HELLO == b'H' and ns['wire'].__file__ == sys.argv[2]")
    result = subprocess.run([sys.executable, "-I", "-c", code,
                             os.path.abspath(rank_wrapper.__file__),
                             os.path.abspath(wire.__file__)],
                            env=launcher_env(), timeout=60, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    # Both files run in a bare interpreter: standard-library imports only.
    for module in (rank_wrapper, wire):
        with open(module.__file__, encoding="utf-8") as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top == "hvdlite":
                    # Only the package's own import of the protocol, never run by path.
                    assert module is rank_wrapper and name == "hvdlite.runner", name
                else:
                    assert top in sys.stdlib_module_names, (module.__file__, name)


def _runner_order():
    """The runner's modules as hvdlite/runner/__init__.py lists them, lowest first."""
    return [line.split("* ", 1)[1].split(".py", 1)[0]
            for line in runner_package.__doc__.splitlines() if line.startswith("* ")]


def test_runner_modules_import_only_modules_below_them():
    order = _runner_order()
    folder = os.path.dirname(launch.__file__)
    assert sorted(order) == sorted(name[:-3] for name in os.listdir(folder)
                                   if name.endswith(".py") and name != "__init__.py")
    for index, module in enumerate(order):
        with open(os.path.join(folder, module + ".py"), encoding="utf-8") as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "hvdlite.runner":
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                    "hvdlite.runner."):
                targets = [node.module.split(".")[2]]
            elif isinstance(node, ast.Import):
                targets = [alias.name.split(".")[2] for alias in node.names
                           if alias.name.startswith("hvdlite.runner.")]
            else:
                continue
            for target in targets:
                assert order.index(target) < index, (f"{module}.py imports {target}, which "
                                                     "is not above it in runner/__init__.py")
