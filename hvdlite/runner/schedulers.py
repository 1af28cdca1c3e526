"""Where a job's hosts come from when hvdliterun is given neither ``-H`` nor
``--hostfile``: the allocation of the scheduler it runs under.

- **Slurm** (``sbatch``/``salloc``; ``SLURM_JOB_ID`` is set): the hosts are
  ``SLURM_JOB_NODELIST`` (compressed, e.g. ``gpu[01-04,07],login2``) with
  ``SLURM_TASKS_PER_NODE`` slots each (e.g. ``4(x2),2``), and ranks on other nodes are
  started with ``srun`` inside the allocation (one task on that node, sharing its
  resources with the job step hvdliterun runs in).
- **A Kubernetes MPIJob** (the Kubeflow MPI operator's launcher pod): the hostfile the
  operator mounts, named by the variable it sets for the MPI it targets
  (``OMPI_MCA_orte_default_hostfile`` or ``OMPI_MCA_hostfile`` for Open MPI, lines
  ``host slots=N``; ``HYDRA_HOST_FILE`` or ``I_MPI_HYDRA_HOST_FILE`` for MPICH and Intel
  MPI, lines ``host:N``), and its remote agent when it names one
  (``OMPI_MCA_plm_rsh_agent``, ``HYDRA_LAUNCHER_EXEC``: e.g. its ``kubexec.sh``, called as
  ``AGENT POD COMMAND``); else ssh, which the operator's v2 pods run.

Everything here is pure: it reads the environment it is given and names the variable
behind any value it cannot understand.
"""
import re
from typing import List, Mapping, NamedTuple, Optional

from hvdlite.runner import hosts as hostlib

# srun as a remote shell: one task on the named node, inside the allocation, overlapping
# the job step hvdliterun itself runs in, and a shell to run the joined command.
SRUN_REMOTE_SHELL = "srun --nodes=1 --ntasks=1 --overlap --nodelist={host} /bin/sh -c"

_HOSTFILE_VARIABLES = ("OMPI_MCA_orte_default_hostfile", "OMPI_MCA_hostfile",
                       "HYDRA_HOST_FILE", "I_MPI_HYDRA_HOST_FILE")
_AGENT_VARIABLES = ("OMPI_MCA_plm_rsh_agent", "HYDRA_LAUNCHER_EXEC")


class Allocation(NamedTuple):
    """Hosts and how to reach them, as a scheduler gave them."""

    source: str                  # e.g. "Slurm job 42", for --verbose and errors
    hosts: List[hostlib.HostSlots]
    remote_shell: Optional[str]  # None: the default (ssh)


def expand_nodelist(expression: str) -> List[str]:
    """Expands a Slurm host list: ``a[01-03,7],b`` -> ``a01 a02 a03 a7 b``.

    Ranges keep their zero padding; several bracket groups in one name multiply
    (``r[1-2]n[1-2]`` -> ``r1n1 r1n2 r2n1 r2n2``).

    Raises:
        hostlib.HostSpecError: unbalanced brackets or a bad range.
    """
    names, depth, start = [], 0, 0
    for i, ch in enumerate(expression + ","):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise hostlib.HostSpecError(f"SLURM_JOB_NODELIST {expression!r}: ']' without '['")
        elif ch == "," and depth == 0:
            item = expression[start:i].strip()
            if item:
                names.extend(_expand_name(item, expression))
            start = i + 1
    if depth != 0:
        raise hostlib.HostSpecError(f"SLURM_JOB_NODELIST {expression!r}: '[' without ']'")
    return names


def _expand_name(item: str, expression: str) -> List[str]:
    match = re.search(r"\[([^\]]*)\]", item)
    if not match:
        return [item]
    head, tail = item[:match.start()], item[match.end():]
    out = []
    for part in match.group(1).split(","):
        low, sep, high = part.strip().partition("-")
        if not low.isdigit() or (sep and not high.isdigit()):
            raise hostlib.HostSpecError(
                f"SLURM_JOB_NODELIST {expression!r}: bad range {part.strip()!r}")
        if not sep:
            values = [low]
        else:
            if int(high) < int(low):
                raise hostlib.HostSpecError(
                    f"SLURM_JOB_NODELIST {expression!r}: range {part.strip()!r} goes down")
            values = [str(v).zfill(len(low)) for v in range(int(low), int(high) + 1)]
        for value in values:
            out.extend(_expand_name(head + value + tail, expression))
    return out


def expand_tasks_per_node(expression: str) -> List[int]:
    """Expands ``SLURM_TASKS_PER_NODE``: ``2(x3),1`` -> ``[2, 2, 2, 1]``.

    Raises:
        hostlib.HostSpecError: a malformed entry.
    """
    counts = []
    for part in expression.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not match or int(match.group(1)) < 1:
            raise hostlib.HostSpecError(
                f"SLURM_TASKS_PER_NODE {expression!r}: cannot read {part!r}")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def slurm_allocation(environ: Mapping[str, str]) -> Optional[Allocation]:
    """The Slurm allocation hvdliterun runs in, or None outside one.

    Slots per node come from ``SLURM_TASKS_PER_NODE`` (``--ntasks``/
    ``--ntasks-per-node`` of the allocation), else one per node.

    Raises:
        hostlib.HostSpecError: the variables disagree or cannot be read.
    """
    job = environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID")
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    if not job or not nodelist:
        return None
    names = expand_nodelist(nodelist)
    tasks = environ.get("SLURM_TASKS_PER_NODE")
    counts = expand_tasks_per_node(tasks) if tasks else [1] * len(names)
    if len(counts) != len(names):
        raise hostlib.HostSpecError(
            f"SLURM_TASKS_PER_NODE {tasks!r} gives {len(counts)} nodes, SLURM_JOB_NODELIST "
            f"{nodelist!r} {len(names)}")
    return Allocation(f"Slurm job {job}",
                      [hostlib.HostSlots(name, count) for name, count in zip(names, counts)],
                      SRUN_REMOTE_SHELL)


def mpijob_allocation(environ: Mapping[str, str]) -> Optional[Allocation]:
    """The hosts of an MPI operator's launcher pod (its mounted hostfile), or None.

    Raises:
        hostlib.HostSpecError: the named hostfile cannot be read or understood.
    """
    for variable in _HOSTFILE_VARIABLES:
        path = environ.get(variable)
        if path:
            try:
                found = hostlib.parse_hostfile(path)
            except hostlib.HostSpecError as exc:
                raise hostlib.HostSpecError(f"{variable}: {exc}") from exc
            agent = next((environ[v] for v in _AGENT_VARIABLES if environ.get(v)), None)
            return Allocation(f"the hostfile in ${variable}", found, agent)
    return None


def allocation(environ: Mapping[str, str]) -> Optional[Allocation]:
    """The scheduler's hosts, Slurm first, or None when hvdliterun runs under neither."""
    return slurm_allocation(environ) or mpijob_allocation(environ)
