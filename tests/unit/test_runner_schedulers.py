"""hvdliterun under a scheduler: Slurm's compressed host lists and task counts, the
hostfile formats an MPI operator's launcher pod mounts, which source wins, and the
errors that name the variable; and init()'s refusal of a world of one where the launcher
started several (srun without --mpi=pmi2). (tests/cluster/test_cluster_launcher.py
starts jobs this way with stand-ins, tests/cluster/test_cluster_slurm.py under a real
Slurm.)"""
import pytest

from hvdlite.runner import hosts, launch, schedulers
from hvdlite.runtime import launcher_mismatch


@pytest.mark.parametrize("expression,names", [
    ("node1", ["node1"]),
    ("a[01-03,7],b", ["a01", "a02", "a03", "a7", "b"]),
    ("gpu[8-10]", ["gpu8", "gpu9", "gpu10"]),
    ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
    ("h[1-2]-ib,login", ["h1-ib", "h2-ib", "login"]),
    ("x[007]", ["x007"]),
])
def test_slurm_node_lists_expand_in_order_keeping_the_padding(expression, names):
    assert schedulers.expand_nodelist(expression) == names


@pytest.mark.parametrize("expression,words", [
    ("a[1-3", "'[' without ']'"), ("a]1", "']' without '['"), ("a[3-1]", "goes down"),
    ("a[x-2]", "bad range"),
])
def test_bad_node_lists_are_named(expression, words):
    with pytest.raises(hosts.HostSpecError, match=r"SLURM_JOB_NODELIST.*" + words.replace("[", r"\[")
                       .replace("]", r"\]")):
        schedulers.expand_nodelist(expression)


def test_tasks_per_node_expand():
    assert schedulers.expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert schedulers.expand_tasks_per_node("4") == [4]
    with pytest.raises(hosts.HostSpecError, match="SLURM_TASKS_PER_NODE"):
        schedulers.expand_tasks_per_node("2(3)")


def test_a_slurm_allocation_gives_hosts_slots_and_srun():
    got = schedulers.allocation({"SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "c[1-3]",
                                 "SLURM_TASKS_PER_NODE": "2(x2),1"})
    assert got.source == "Slurm job 42"
    assert got.hosts == [hosts.HostSlots("c1", 2), hosts.HostSlots("c2", 2),
                         hosts.HostSlots("c3", 1)]
    assert got.remote_shell.startswith("srun ") and "{host}" in got.remote_shell
    with pytest.raises(hosts.HostSpecError, match="gives 1 nodes.*3"):
        schedulers.allocation({"SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "c[1-3]",
                               "SLURM_TASKS_PER_NODE": "2"})


@pytest.mark.parametrize("variable,text", [
    ("OMPI_MCA_orte_default_hostfile", "w-0.w slots=2\nw-1.w slots=2\n"),
    ("HYDRA_HOST_FILE", "w-0.w:2\nw-1.w:2\n"),
])
def test_an_mpijob_hostfile_in_either_format_and_its_agent(tmp_path, variable, text):
    path = tmp_path / "hostfile"
    path.write_text(text)
    got = schedulers.allocation({variable: str(path), "OMPI_MCA_plm_rsh_agent": "/etc/mpi/kubexec.sh"})
    assert got.hosts == [hosts.HostSlots("w-0.w", 2), hosts.HostSlots("w-1.w", 2)]
    assert got.remote_shell == "/etc/mpi/kubexec.sh" and variable in got.source
    assert schedulers.allocation({variable: str(path)}).remote_shell is None  # ssh


def test_no_scheduler_no_allocation():
    assert schedulers.allocation({"PATH": "/bin"}) is None


def test_a_mixed_hostfile_line_is_refused_naming_the_line(tmp_path):
    with pytest.raises(hosts.HostSpecError, match=r"hf:2: expected 'host:N' or 'host slots=N'"):
        hosts.parse_hostfile_text("a:1\nb:2 slots=3\n", source="hf")


def _config(monkeypatch, env, *args):
    for name in ("SLURM_JOB_ID", "SLURM_JOBID", "SLURM_JOB_NODELIST", "SLURM_NODELIST",
                 "SLURM_TASKS_PER_NODE", "HVDLITE_REMOTE_SHELL", "HYDRA_HOST_FILE",
                 "OMPI_MCA_orte_default_hostfile", "OMPI_MCA_hostfile", "I_MPI_HYDRA_HOST_FILE",
                 "OMPI_MCA_plm_rsh_agent", "HYDRA_LAUNCHER_EXEC"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return launch.parse_command_line(list(args) + ["python", "x.py"])


def test_hvdliterun_takes_slurms_hosts_and_srun_unless_told_otherwise(monkeypatch, capsys):
    slurm = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_TASKS_PER_NODE": "2(x2)"}
    cfg = _config(monkeypatch, slurm)
    assert cfg.num_ranks == 4 and cfg.hosts == [hosts.HostSlots("n1", 2), hosts.HostSlots("n2", 2)]
    assert cfg.remote_shell == schedulers.SRUN_REMOTE_SHELL
    # -H and --remote-shell win; so does HVDLITE_REMOTE_SHELL.
    cfg = _config(monkeypatch, slurm, "-H", "localhost:3", "--remote-shell", "rsh")
    assert cfg.hosts == [hosts.HostSlots("localhost", 3)] and cfg.remote_shell == "rsh"
    cfg = _config(monkeypatch, {**slurm, "HVDLITE_REMOTE_SHELL": "my-rsh"}, "-np", "2")
    assert cfg.remote_shell == "my-rsh" and cfg.num_ranks == 2
    with pytest.raises(SystemExit):
        _config(monkeypatch, slurm, "-np", "5")
    assert "more than the 4 slots given by Slurm job 7 (-H overrides it)" in capsys.readouterr().err


def test_outside_any_scheduler_nothing_changes(monkeypatch):
    cfg = _config(monkeypatch, {}, "-np", "3")
    assert cfg.hosts is None and cfg.remote_shell is None and cfg.num_ranks == 3


@pytest.mark.parametrize("environ,variable", [
    ({"SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "4", "SLURM_NTASKS": "4"},
     "SLURM_STEP_NUM_TASKS=4"),
    ({"OMPI_COMM_WORLD_SIZE": "2"}, "OMPI_COMM_WORLD_SIZE=2"),
    ({"PMI_SIZE": "3"}, "PMI_SIZE=3"),
])
def test_a_world_of_one_where_the_launcher_started_several_is_named(environ, variable):
    message = launcher_mismatch(environ, 1)
    assert message and variable in message, message
    if "SLURM_STEP_ID" in environ:
        assert "srun --mpi=pmi2" in message
    assert launcher_mismatch(environ, int(variable.split("=")[1])) is None


@pytest.mark.parametrize("environ", [
    {},
    # a batch script (no job step) of an allocation of 4 tasks running one process
    {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4", "SLURM_PROCID": "0"},
    # srun's one-task steps (hvdliterun's remote ranks)
    {"SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "1", "SLURM_NTASKS": "4"},
    # hvdliterun's ranks: the launcher's word is final
    {"HVDLITE_RANK": "0", "PMI_SIZE": "4"},
])
def test_a_real_one_process_job_is_not_refused(environ):
    assert launcher_mismatch(environ, 1) is None
