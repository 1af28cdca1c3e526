"""Finding the MPI launcher and building its command line, per MPI flavour.

The command line is built by a pure function (:func:`build_mpi_command`) from an
options object, so a multi-host request can be checked without starting anything.
"""
import enum
import logging
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from typing import List, Mapping, Optional, Sequence

from hvdlite import build_record
from hvdlite.runner import openmpi
from hvdlite.runner.hosts import HostSlots

logger = logging.getLogger("hvdlite")

# Environment that must not be forwarded by name to Open MPI ranks: per-shell or
# per-process values, and the launcher's own variables of a surrounding MPI job.
_NO_FORWARD_PREFIXES = ("OMPI_", "PMIX_", "PMI_", "PRTE_", "HYDRA_", "HYDI_", "BASH_FUNC_",
                        "SLURM_")
_NO_FORWARD = frozenset({"_", "PWD", "OLDPWD", "SHLVL", "HOSTNAME", "PS1", "PS2", "TERMCAP",
                         "LS_COLORS", "SSH_AUTH_SOCK", "SSH_CLIENT", "SSH_CONNECTION",
                         "SSH_TTY", "DISPLAY", "XAUTHORITY", "TMUX", "TMUX_PANE"})
_ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class MpiFlavor(enum.Enum):
    """Command-line dialects of MPI launchers."""

    HYDRA = "hydra"      # MPICH, Intel MPI, MVAPICH: -n, -hosts, -genvall, -genv
    OPENMPI = "openmpi"  # Open MPI's mpirun: -np, -H, -x


class MpiNotFoundError(RuntimeError):
    """No mpiexec could be found."""


@dataclass(frozen=True)
class MpiLauncher:
    """An mpiexec executable and what it is."""

    path: str
    flavor: MpiFlavor
    version_text: str = ""

    @property
    def implementation(self) -> str:
        """A one-line description, e.g. ``MPICH (hydra) 5.0.2``."""
        return describe_version(self.flavor, self.version_text)


@dataclass(frozen=True)
class MpiCommandOptions:
    """Everything :func:`build_mpi_command` needs.

    Attributes:
        launcher: the mpiexec to run.
        num_ranks: ranks to start.
        rank_command: argv each rank runs (the rank wrapper and the user's command).
        hosts: hosts and slots, or None to run every rank on this machine.
        set_env: variables given these values on every rank (HVDLITE_* knobs).
        forward_env: names of variables to pass through explicitly (Open MPI, which
            forwards nothing by default to remote hosts); hydra forwards everything.
        extra_args: user's --mpi-args, already split.
        run_as_root: add Open MPI's --allow-run-as-root (see openmpi.run_as_root).
        remote_start: an executable mpiexec calls like rsh (``[options] HOST COMMAND``)
            to start processes on other hosts, instead of its own ssh; None for ssh.
        network_interface: the interface MPI's own traffic should use, or None.
    """

    launcher: MpiLauncher
    num_ranks: int
    rank_command: Sequence[str]
    hosts: Optional[Sequence[HostSlots]] = None
    set_env: Mapping[str, str] = field(default_factory=dict)
    forward_env: Sequence[str] = ()
    extra_args: Sequence[str] = ()
    run_as_root: bool = False
    remote_start: Optional[str] = None
    network_interface: Optional[str] = None


def _executable(path: str) -> bool:
    return os.path.isfile(path) and os.access(path, os.X_OK)


def candidate_mpiexecs(env: Mapping[str, str], build_info: Mapping[str, object]) -> List[str]:
    """Lists mpiexec paths in order of preference (existing or not).

    1. ``HVDLITE_MPIEXEC``: an explicit launcher path.
    2. The MPI hvdlite was built against: ``<mpi_prefix>/bin`` of a system build.
    3. ``$HVDLITE_MPI_DIR/bin`` (a system MPI chosen by environment).
    4. The ``mpich`` wheel's hydra in ``<sys.prefix>/bin``.
    5. ``mpiexec`` / ``mpirun`` on PATH.

    Args:
        env: the environment to read.
        build_info: the parsed build info (see hvdlite/build_record.py).

    Returns:
        Paths, best first.
    """
    paths = []
    explicit = env.get("HVDLITE_MPIEXEC")
    if explicit:
        paths.append(explicit)
    prefixes = []
    if build_info.get("mpi_source") == "system" and build_info.get("mpi_prefix"):
        prefixes.append(str(build_info["mpi_prefix"]))
    if env.get("HVDLITE_MPI_DIR"):
        prefixes.append(env["HVDLITE_MPI_DIR"])
    if build_info.get("mpi_source") != "system":
        prefixes.append(sys.prefix)
    for prefix in prefixes:
        for name in ("mpiexec", "mpirun"):
            paths.append(os.path.join(prefix, "bin", name))
    for name in ("mpiexec", "mpirun"):
        found = shutil.which(name, path=env.get("PATH"))
        if found:
            paths.append(found)
    return paths


def find_mpiexec(env: Optional[Mapping[str, str]] = None,
                 build_info: Optional[Mapping[str, object]] = None) -> str:
    """Returns the mpiexec to use (see :func:`candidate_mpiexecs` for the order).

    Args:
        env: the environment to read; defaults to ``os.environ``.
        build_info: the parsed build info; read from the package when None.

    Returns:
        The path of an executable mpiexec.

    Raises:
        MpiNotFoundError: none of the candidates exists.
    """
    env = os.environ if env is None else env
    build_info = build_record.read_if_readable() if build_info is None else build_info
    tried = candidate_mpiexecs(env, build_info)
    explicit = env.get("HVDLITE_MPIEXEC")
    if explicit and not _executable(explicit):
        raise MpiNotFoundError(f"HVDLITE_MPIEXEC={explicit} is not an executable file")
    for path in tried:
        if _executable(path):
            return path
    raise MpiNotFoundError(
        "no mpiexec found (looked for " + ", ".join(dict.fromkeys(tried)) + "); install the "
        "'mpich' wheel (pip install mpich), set HVDLITE_MPI_DIR to an MPI installation, or "
        "set HVDLITE_MPIEXEC to the launcher's path")


def flavor_from_version_text(text: str) -> MpiFlavor:
    """Tells the launcher's dialect from its ``--version`` output.

    Args:
        text: what ``mpiexec --version`` printed.

    Returns:
        OPENMPI for Open MPI (and its OpenRTE/PRRTE launchers), HYDRA otherwise.
    """
    if re.search(r"Open MPI|OpenRTE|Open RTE|prte|PRRTE", text, re.IGNORECASE):
        return MpiFlavor.OPENMPI
    return MpiFlavor.HYDRA


def describe_version(flavor: MpiFlavor, text: str) -> str:
    """A one-line MPI implementation and version from ``--version`` output.

    Args:
        flavor: the launcher's dialect.
        text: what ``mpiexec --version`` printed.

    Returns:
        E.g. ``Open MPI 4.1.5`` or ``MPICH (hydra) 5.0.2``.
    """
    if flavor is MpiFlavor.OPENMPI:
        match = re.search(r"\(Open MPI\)\s*(\S+)", text) or re.search(r"(\d+\.\d+\S*)", text)
        return "Open MPI " + (match.group(1) if match else "(unknown version)")
    name = "MPICH (hydra)"
    if "Intel" in text:
        name = "Intel MPI (hydra)"
    elif "MVAPICH" in text.upper():
        name = "MVAPICH (hydra)"
    match = re.search(r"Version:\s*(\S+)", text) or re.search(r"(\d+\.\d+\S*)", text)
    return name + " " + (match.group(1) if match else "(unknown version)")


def probe_launcher(path: str, timeout: float = 20.0) -> MpiLauncher:
    """Runs ``path --version`` to learn the launcher's flavour and version.

    Args:
        path: the mpiexec executable.
        timeout: seconds to wait for it.

    Returns:
        The launcher; HYDRA flavour with empty version text when the probe fails.
    """
    try:
        result = subprocess.run([path, "--version"], stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                timeout=timeout, check=False)
        text = result.stdout.decode("utf-8", "replace")
    except (OSError, subprocess.TimeoutExpired) as exc:
        logger.warning("could not run %s --version: %s; assuming MPICH hydra flags", path, exc)
        text = ""
    return MpiLauncher(path=path, flavor=flavor_from_version_text(text), version_text=text)


def forwardable_env_names(env: Mapping[str, str]) -> List[str]:
    """Names of the variables worth forwarding by name to every rank.

    Args:
        env: the launcher's environment.

    Returns:
        Sorted names, without per-shell values and other MPI jobs' variables.
    """
    return sorted(name for name in env
                  if _ENV_NAME_RE.match(name) and name not in _NO_FORWARD
                  and not name.startswith(_NO_FORWARD_PREFIXES))


def format_host_list(hosts: Sequence[HostSlots]) -> str:
    """``host1:2,host2:2``, with IPv6 literals in brackets."""
    return ",".join((f"[{h.host}]" if ":" in h.host else h.host) + f":{h.slots}"
                    for h in hosts)


def build_mpi_command(options: MpiCommandOptions) -> List[str]:
    """Builds the mpiexec argv that starts ``options.rank_command`` on every rank.

    Args:
        options: see :class:`MpiCommandOptions`.

    Returns:
        The argument vector (never a shell string).

    Raises:
        ValueError: num_ranks below 1 or an empty rank command.
    """
    if options.num_ranks < 1:
        raise ValueError("num_ranks must be at least 1")
    if not options.rank_command:
        raise ValueError("rank_command is empty")
    launcher = options.launcher
    argv = [launcher.path]
    if launcher.flavor is MpiFlavor.OPENMPI:
        argv += openmpi.command_arguments(options, format_host_list(options.hosts or ()))
    else:
        argv += ["-n", str(options.num_ranks)]
        if options.hosts:
            argv += ["-hosts", format_host_list(options.hosts)]
        if options.remote_start:
            argv += ["-launcher", "rsh", "-launcher-exec", options.remote_start]
        if options.network_interface:
            argv += ["-iface", options.network_interface]
        # Hydra forwards the environment to local and remote proxies alike.
        argv += ["-genvall"]
        for name, value in options.set_env.items():
            argv += ["-genv", name, value]
    argv += list(options.extra_args)
    argv += list(options.rank_command)
    return argv


# The launcher dialect of each implementation the build records (setup.py, from mpi.h).
_BUILD_FLAVORS = {"Open MPI": MpiFlavor.OPENMPI, "MPICH": MpiFlavor.HYDRA,
                  "Intel MPI": MpiFlavor.HYDRA, "MVAPICH": MpiFlavor.HYDRA}


def launcher_mismatch(build_info: Mapping[str, object], launcher: MpiLauncher) -> Optional[str]:
    """Says why a launcher cannot start ranks of this build, or None when it can.

    Ranks started by another implementation's launcher do not find each other: each
    would run alone as rank 0 of 1.

    Args:
        build_info: the parsed build info (see hvdlite/build_record.py).
        launcher: the probed launcher.

    Returns:
        A message naming both implementations, or None (also when either is unknown).
    """
    built = build_info.get("mpi_implementation")
    expected = _BUILD_FLAVORS.get(str(built))
    if expected is None or not launcher.version_text or launcher.flavor is expected:
        return None
    version = build_info.get("mpi_version") or ""
    prefix = build_info.get("mpi_prefix")
    hint = f" ({prefix}/bin/mpiexec)" if prefix else ""
    return (f"hvdlite was built against {built} {version}, but the MPI launcher found, "
            f"{launcher.path}, is {launcher.implementation}: ranks it starts would not find "
            f"each other. Set HVDLITE_MPIEXEC to {built}'s launcher{hint}, or rebuild "
            "hvdlite against this MPI")
