"""Open MPI's mpirun: its flag spellings, and when it may run as root.

Open MPI spells the launcher's requests its own way (``-np``, ``-H host:slots``, ``-x``
to pass a variable) and forwards no environment to remote hosts unless named. It also
refuses to start as root unless told so, by ``--allow-run-as-root`` or by
``OMPI_ALLOW_RUN_AS_ROOT=1`` with ``OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1``; hvdliterun
passes the flag only when the user said one of those, never on its own.

Open MPI's AVX reduction component (``op avx``) saturates an 8- or 16-bit integer sum
that overflows, where its plain loop (and MPICH, and numpy) wraps around; which elements
it reduces depends on the buffer's length, so a fused buffer gave other results than the
same tensors one by one. Ranks started by hvdliterun leave it out (``OMPI_MCA_op=^avx``)
unless the user chose the op components (OMPI_MCA_op, or ``--mca op`` in --mpi-args).
"""
import os
from typing import Dict, List, Mapping, Optional, Sequence

# Both set to 1: Open MPI's own way of saying that running as root is intended.
ROOT_ENV = ("OMPI_ALLOW_RUN_AS_ROOT", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM")

ROOT_REFUSAL = (
    "running as root: Open MPI's mpirun refuses that unless told it is intended; pass "
    "--allow-run-as-root to hvdliterun, or set OMPI_ALLOW_RUN_AS_ROOT=1 and "
    "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1")


def is_root() -> bool:
    """Whether this process runs as root (effective uid 0)."""
    return hasattr(os, "geteuid") and os.geteuid() == 0


def root_allowed_by_env(env: Mapping[str, str]) -> bool:
    """Whether the environment holds Open MPI's two run-as-root variables set to 1."""
    return all(env.get(name) == "1" for name in ROOT_ENV)


def run_as_root(flag: bool, env: Mapping[str, str], root: Optional[bool] = None) -> bool:
    """Whether mpirun gets ``--allow-run-as-root``.

    Args:
        flag: hvdliterun's --allow-run-as-root was given.
        env: the launcher's environment.
        root: whether we run as root; None asks the OS.

    Returns:
        True only as root, and only when the flag or both variables say so.
    """
    root = is_root() if root is None else root
    return root and (flag or root_allowed_by_env(env))


def rank_env(env: Mapping[str, str], mpi_args: Sequence[str]) -> Dict[str, str]:
    """Variables hvdliterun sets on Open MPI ranks (see the module docstring).

    Args:
        env: the ranks' environment.
        mpi_args: the user's --mpi-args.

    Returns:
        Name -> value; empty when the user chose the op components.
    """
    args = list(mpi_args)
    chosen = "OMPI_MCA_op" in env or any(
        flag in ("--mca", "-mca", "--omca") and args[i + 1:i + 2] == ["op"]
        for i, flag in enumerate(args))
    return {} if chosen else {"OMPI_MCA_op": "^avx"}


def command_arguments(options, host_list: str) -> List[str]:
    """mpirun's arguments before the extra args and the rank command.

    Args:
        options: the launcher's ``MpiCommandOptions``.
        host_list: ``host1:2,host2:2`` for ``options.hosts``.

    Returns:
        The arguments, in mpirun's spellings.
    """
    argv = ["-np", str(options.num_ranks)]
    if options.hosts:
        argv += ["-H", host_list]
    else:
        # Every rank on this machine, however many cores it has: the user asked for
        # -np ranks, and Open MPI would otherwise refuse more ranks than cores.
        argv += ["--oversubscribe"]
    # The core binds nothing itself; Open MPI's default core binding would squeeze
    # a rank's framework threads onto one core.
    argv += ["--bind-to", "none", "--map-by", "slot"]
    if options.run_as_root:
        argv += ["--allow-run-as-root"]
    if options.remote_start:
        argv += ["--mca", "plm_rsh_agent", options.remote_start]
    if options.network_interface:
        argv += ["--mca", "btl_tcp_if_include", options.network_interface,
                 "--mca", "oob_tcp_if_include", options.network_interface]
    # -x NAME passes the launcher's value, -x NAME=VALUE a value of our own: Open MPI
    # forwards nothing to remote hosts that is not named.
    for name in options.forward_env:
        if name not in options.set_env:
            argv += ["-x", name]
    for name, value in options.set_env.items():
        argv += ["-x", f"{name}={value}"]
    return argv
