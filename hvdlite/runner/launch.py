"""hvdliterun: start a data-parallel job through MPI.

    hvdliterun -np 4 python train.py --epochs 3
    hvdliterun -np 4 -H host1:2,host2:2 python train.py
    python -m hvdlite.runner --check-build

The launcher parses its flags, turns the tuning flags into HVDLITE_* variables, builds
the mpiexec command for the MPI hvdlite was built with, and supervises the job (see
supervisor.py): tagged output, and the whole job ended when one rank fails or when the
launcher is interrupted.
"""
import argparse
import fcntl
import logging
import math
import os
import shlex
import socket
import struct
import sys
from typing import Dict, List, Optional, Sequence

from hvdlite import build_record
from hvdlite.runner import elastic_driver
from hvdlite.runner import elastic_settings
from hvdlite.runner import hosts as hostlib
from hvdlite.runner import mpi_command
from hvdlite.runner import openmpi
from hvdlite.runner import schedulers
from hvdlite.runner import wire
from hvdlite.runner.check_build import check_build
from hvdlite.runner.job import (DEFAULT_START_TIMEOUT_S, LaunchConfig, new_supervisor,
                                supervise_job)
from hvdlite.runner.supervisor import JobSupervisor
from hvdlite.runner.version import package_version

logger = logging.getLogger("hvdlite")

PROG = "hvdliterun"


class UsageError(ValueError):
    """Bad command-line input: reported with exit code 2."""


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors point at --help and exit with code 2."""

    def error(self, message):
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}\n"
                     f"Run '{self.prog} --help' for the full list of options.\n")


def build_parser() -> argparse.ArgumentParser:
    """Returns the hvdliterun argument parser."""
    parser = _Parser(
        prog=PROG, allow_abbrev=False,
        usage=f"{PROG} [options] -np N command [args ...]",
        description="Start a distributed hvdlite job: run COMMAND on N ranks through MPI. "
                    "Each output line is prefixed with its rank, e.g. [1]<stdout>:.",
        epilog="Examples:\n  hvdliterun -np 4 python train.py --epochs 3\n"
               "  hvdliterun -np 4 -H host1:2,host2:2 python train.py\n"
               "  hvdliterun --check-build",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-np", "--num-proc", dest="num_proc", type=int, metavar="N",
                        help="number of ranks (default: the total slots of -H/--hostfile)")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("-H", "--hosts", dest="hosts", metavar="HOST:SLOTS[,...]",
                       help="hosts and their slots, e.g. host1:2,host2:2 (default: this "
                            "machine only)")
    where.add_argument("--hostfile", dest="hostfile", metavar="FILE",
                       help="file with one 'host slots=N' line per host")
    tuning = parser.add_argument_group("tuning (each sets an HVDLITE_* variable on every rank)")
    tuning.add_argument("--timeline-filename", metavar="FILE",
                        help="write a Chrome-trace timeline (HVDLITE_TIMELINE)")
    tuning.add_argument("--fusion-threshold-mb", type=float, metavar="MB",
                        help="fusion buffer size in MiB (HVDLITE_FUSION_THRESHOLD, in bytes)")
    tuning.add_argument("--cycle-time-ms", type=float, metavar="MS",
                        help="background cycle time in ms (HVDLITE_CYCLE_TIME)")
    tuning.add_argument("--cache-capacity", type=int, metavar="N",
                        help="response cache entries, 0 disables (HVDLITE_CACHE_CAPACITY)")
    tuning.add_argument("--stall-check-time", type=float, metavar="S",
                        help="seconds before a stalled tensor is reported "
                             "(HVDLITE_STALL_CHECK_TIME)")
    tuning.add_argument("--bind-to", choices=["none", "core"],
                        help="core: bind each rank's threads to its share of the host's "
                             "cores, as MPI's --bind-to core (HVDLITE_BIND_TO)")
    tuning.add_argument("--autotune", action="store_true",
                        help="tune fusion threshold, cycle time and the shared-memory chunk "
                             "online (HVDLITE_AUTOTUNE=1)")
    tuning.add_argument("--autotune-log-file", metavar="FILE",
                        help="CSV of autotune's trials, written by rank 0 "
                             "(HVDLITE_AUTOTUNE_LOG)")
    launch = parser.add_argument_group("launch")
    launch.add_argument("--output-filename", metavar="DIR",
                        help="also write each rank's output to DIR/rank.<rank>.log")
    launch.add_argument("--start-timeout", type=float, default=DEFAULT_START_TIMEOUT_S,
                        metavar="S", help="seconds for every rank to start "
                                          f"(default {DEFAULT_START_TIMEOUT_S:g})")
    launch.add_argument("--mpi-args", default="", metavar="\"ARGS\"",
                        help="extra arguments for mpiexec, as one quoted string")
    launch.add_argument("--allow-run-as-root", action="store_true",
                        help="let Open MPI's mpirun start ranks as root (it refuses "
                             "otherwise; OMPI_ALLOW_RUN_AS_ROOT=1 with "
                             "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 says the same)")
    launch.add_argument("--verbose", action="store_true",
                        help="log the launcher's decisions and the mpiexec command; tag "
                             "output lines with the rank's host too ([1@host]<stdout>:)")
    remote = parser.add_argument_group("many hosts")
    remote.add_argument("-p", "--ssh-port", type=int, metavar="PORT",
                        help="ssh port on the hosts")
    remote.add_argument("-i", "--ssh-identity-file", metavar="FILE",
                        help="ssh private key file")
    remote.add_argument("--remote-shell", metavar="\"CMD\"",
                        help="start processes on other hosts with CMD instead of ssh, called "
                             "as 'CMD HOST COMMAND' ({host} in CMD marks where the host "
                             "goes), e.g. 'docker exec {host} sh -c'; default "
                             "$HVDLITE_REMOTE_SHELL, else ssh")
    remote.add_argument("--network-interface", "--network-interfaces",
                        dest="network_interface", metavar="NIC",
                        help="network interface for MPI and for ranks calling back to the "
                             "launcher, e.g. eth0")
    elastic_settings.add_arguments(parser)
    info = parser.add_argument_group("information")
    info.add_argument("--check-build", action="store_true",
                      help="show frameworks, MPI, NCCL/CUDA and the native library, and exit")
    info.add_argument("--version", action="version", version=f"{PROG} (hvdlite) "
                                                             f"{package_version()}")
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="the program to run on every rank, and its arguments")
    return parser


def _number(value: float) -> str:
    # 5.0 -> "5" so that integer-parsing readers accept the value; 0.5 stays "0.5".
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def tuning_env(args: argparse.Namespace) -> Dict[str, str]:
    """Turns the tuning flags into HVDLITE_* variables.

    Args:
        args: parsed arguments.

    Returns:
        Variable -> value for each flag that was given.

    Raises:
        UsageError: a negative, zero (where meaningless) or non-finite value.
    """
    env = {}

    def check(name, value, minimum, inclusive=True):
        if not math.isfinite(value) or value < minimum or (not inclusive and value == minimum):
            bound = f">= {minimum:g}" if inclusive else f"> {minimum:g}"
            raise UsageError(f"{name} must be a number {bound}, got {value:g}")

    if args.timeline_filename is not None:
        if not args.timeline_filename.strip():
            raise UsageError("--timeline-filename must not be empty")
        env["HVDLITE_TIMELINE"] = args.timeline_filename
    if args.fusion_threshold_mb is not None:
        check("--fusion-threshold-mb", args.fusion_threshold_mb, 0)
        env["HVDLITE_FUSION_THRESHOLD"] = str(int(args.fusion_threshold_mb * 1024 * 1024))
    if args.cycle_time_ms is not None:
        check("--cycle-time-ms", args.cycle_time_ms, 0, inclusive=False)
        env["HVDLITE_CYCLE_TIME"] = _number(args.cycle_time_ms)
    if args.cache_capacity is not None:
        check("--cache-capacity", args.cache_capacity, 0)
        env["HVDLITE_CACHE_CAPACITY"] = str(args.cache_capacity)
    if args.stall_check_time is not None:
        check("--stall-check-time", args.stall_check_time, 0)
        env["HVDLITE_STALL_CHECK_TIME"] = _number(args.stall_check_time)
    if args.bind_to is not None:
        env["HVDLITE_BIND_TO"] = args.bind_to
    if args.autotune:
        env["HVDLITE_AUTOTUNE"] = "1"
    if args.autotune_log_file is not None:
        if not args.autotune_log_file.strip():
            raise UsageError("--autotune-log-file must not be empty")
        env["HVDLITE_AUTOTUNE_LOG"] = args.autotune_log_file
    return env


def remote_shell_command(args: argparse.Namespace) -> Optional[str]:
    """The command that starts processes on other hosts (None: mpiexec's default).

    ``--remote-shell``, else an ssh command like Horovod's from ``--ssh-port``/
    ``--ssh-identity-file`` (no password prompts, new host keys accepted, a connect
    timeout of ``--start-timeout``), else ``$HVDLITE_REMOTE_SHELL``.

    Raises:
        UsageError: both --remote-shell and ssh flags, a bad port, or an unreadable key.
    """
    ssh_flags = args.ssh_port is not None or args.ssh_identity_file is not None
    if args.remote_shell is not None:
        if ssh_flags:
            raise UsageError("--remote-shell replaces ssh: --ssh-port/--ssh-identity-file "
                             "cannot go with it (put them in the remote shell command)")
        try:
            words = shlex.split(args.remote_shell)
        except ValueError as exc:
            raise UsageError(f"--remote-shell: cannot split {args.remote_shell!r}: "
                             f"{exc}") from exc
        if not words:
            raise UsageError("--remote-shell must not be empty")
        return args.remote_shell
    if not ssh_flags:
        return os.environ.get("HVDLITE_REMOTE_SHELL") or None
    words = ["ssh", "-o", "PasswordAuthentication=no", "-o", "StrictHostKeyChecking=no",
             "-o", f"ConnectTimeout={max(1, int(args.start_timeout))}"]
    if args.ssh_port is not None:
        if not 0 < args.ssh_port < 65536:
            raise UsageError(f"--ssh-port must be 1-65535, got {args.ssh_port}")
        words += ["-p", str(args.ssh_port)]
    if args.ssh_identity_file is not None:
        if not os.path.isfile(args.ssh_identity_file):
            raise UsageError(f"--ssh-identity-file: no such file {args.ssh_identity_file!r}")
        words += ["-i", os.path.abspath(args.ssh_identity_file)]
    return shlex.join(words)


def config_from_args(args: argparse.Namespace) -> LaunchConfig:
    """Validates parsed arguments into a :class:`LaunchConfig`.

    Args:
        args: what :func:`build_parser` parsed.

    Returns:
        The request.

    Raises:
        UsageError: any inconsistency; the message says which flag and why.
    """
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    hosts, allocation = None, None
    try:
        if args.hosts is not None:
            hosts = hostlib.parse_host_string(args.hosts)
        elif args.hostfile is not None:
            hosts = hostlib.parse_hostfile(args.hostfile)
        else:
            allocation = schedulers.allocation(os.environ)
            hosts = allocation.hosts if allocation else None
    except hostlib.HostSpecError as exc:
        raise UsageError(str(exc)) from exc
    env = tuning_env(args)
    try:
        elastic = elastic_settings.settings_from_args(args)
    except elastic_settings.ElasticUsageError as exc:
        raise UsageError(str(exc)) from exc
    if not math.isfinite(args.start_timeout) or args.start_timeout <= 0:
        raise UsageError(f"--start-timeout must be a number > 0, got {args.start_timeout:g}")
    try:
        mpi_args = shlex.split(args.mpi_args)
    except ValueError as exc:
        raise UsageError(f"--mpi-args: cannot split {args.mpi_args!r}: {exc}") from exc
    config = LaunchConfig(num_ranks=0, command=command, hosts=hosts, tuning_env=env,
                          output_dir=args.output_filename, start_timeout=args.start_timeout,
                          mpi_args=mpi_args, verbose=args.verbose,
                          check_build=args.check_build,
                          allow_run_as_root=args.allow_run_as_root,
                          remote_shell=remote_shell_command(args) or
                          (allocation.remote_shell if allocation else None),
                          network_interface=args.network_interface, elastic=elastic)
    if args.check_build:
        return config
    if not command:
        raise UsageError("no command given: put the program to run after the options, "
                         f"e.g. '{PROG} -np 2 python train.py'")
    if args.num_proc is None and elastic is not None:
        # The first world takes what there is, up to --max-np.
        config.num_ranks = min(elastic.max_np, hostlib.total_slots(hosts)) if hosts \
            else elastic.max_np
    elif args.num_proc is None:
        if hosts is None:
            raise UsageError("-np is required (or give -H/--hostfile to use all their slots)")
        config.num_ranks = hostlib.total_slots(hosts)
    else:
        config.num_ranks = args.num_proc
    if config.num_ranks < 1:
        raise UsageError(f"-np must be at least 1, got {config.num_ranks}")
    if hosts is not None and config.num_ranks > hostlib.total_slots(hosts):
        given = ",".join(f"{h.host}:{h.slots}" for h in hosts)
        where = f" by {allocation.source} (-H overrides it)" if allocation else ""
        raise UsageError(f"-np {config.num_ranks} is more than the {hostlib.total_slots(hosts)} "
                         f"slots given{where} ({given})")
    if allocation and config.verbose:
        print(f"{PROG}: hosts from {allocation.source}: "
              + ",".join(f"{h.host}:{h.slots}" for h in hosts)
              + (f"; remote shell {config.remote_shell!r}" if config.remote_shell else ""),
              file=sys.stderr, flush=True)
    return config


def _glue_mpi_args(argv: Sequence[str], parser: argparse.ArgumentParser) -> List[str]:
    """Writes ``--mpi-args VALUE`` as ``--mpi-args=VALUE`` among the launcher's options.

    argparse takes a separate value that starts with '-' (``--mpi-args -genvnone``) for
    an option and fails; the glued form is unambiguous. Scanning stops where the user's
    command starts, so the command's own arguments are never touched.
    """
    # Flags (store_true, --help, --version) have nargs == 0; every other option takes
    # exactly one value.
    takes_value = {option for action in parser._actions
                   if action.option_strings and action.nargs != 0
                   for option in action.option_strings}
    out, i = [], 0
    argv = list(argv)
    while i < len(argv):
        token = argv[i]
        if token == "--mpi-args" and i + 1 < len(argv):
            out.append("--mpi-args=" + argv[i + 1])
            i += 2
        elif token in takes_value:
            out += argv[i:i + 2]
            i += 2
        elif token.startswith("-") and token != "--":
            out.append(token)
            i += 1
        else:
            return out + argv[i:]
    return out


def parse_command_line(argv: Sequence[str]) -> LaunchConfig:
    """Parses and validates hvdliterun's arguments.

    Args:
        argv: the arguments, without the program name.

    Returns:
        The validated request.

    Raises:
        SystemExit: with code 2 and a message on stderr for any bad input (and code 0
            for --help and --version).
    """
    parser = build_parser()
    args = parser.parse_args(_glue_mpi_args(argv, parser))
    try:
        return config_from_args(args)
    except UsageError as exc:
        parser.error(str(exc))
        raise  # unreachable: error() exits


def interface_address(name: str) -> str:
    """The IPv4 address of network interface ``name``.

    Raises:
        UsageError: no such interface, or it has no IPv4 address.
    """
    siocgifaddr = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            packed = fcntl.ioctl(sock.fileno(), siocgifaddr,
                                 struct.pack("256s", name.encode()[:15]))
        except OSError as exc:
            raise UsageError(f"--network-interface {name}: no IPv4 address on this host "
                             f"({exc.strerror})") from exc
    return socket.inet_ntoa(packed[20:24])


def launcher_address(hosts: Sequence[hostlib.HostSlots], interface: Optional[str],
                     env: Dict[str, str]) -> str:
    """The address ranks on other hosts call the launcher back at.

    ``HVDLITE_LAUNCHER_HOST`` if set; else the address of ``--network-interface``; else
    the local address the kernel would use towards the first remote host (so a name
    that resolves differently elsewhere, or to 127.0.1.1, does not matter); else the
    fully qualified host name.
    """
    if env.get("HVDLITE_LAUNCHER_HOST"):
        return env["HVDLITE_LAUNCHER_HOST"]
    if interface:
        return interface_address(interface)
    for entry in hosts:
        if hostlib.is_local_host(entry.host):
            continue
        try:
            family, _, _, _, addr = socket.getaddrinfo(entry.host, 9, type=socket.SOCK_DGRAM)[0]
            with socket.socket(family, socket.SOCK_DGRAM) as probe:
                probe.connect(addr[:2])  # no packet is sent: only the route is chosen
                return probe.getsockname()[0]
        except OSError:
            continue
    return socket.getfqdn()


def _setup_logging(verbose: bool):
    if not any(getattr(h, "_hvdliterun", False) for h in logger.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(f"{PROG}: %(levelname)s: %(message)s"))
        handler._hvdliterun = True
        logger.addHandler(handler)
    logger.setLevel(logging.DEBUG if verbose else logging.WARNING)
    logger.propagate = False


def run(config: LaunchConfig) -> int:
    """Runs a validated request.

    Args:
        config: the request.

    Returns:
        The launcher's exit code: 0, the failed rank's code (128+N for signal N),
        128+N when the launcher got signal N, or 1 for a launch problem.
    """
    if config.check_build:
        return check_build()
    try:
        mpiexec = mpi_command.find_mpiexec()
    except mpi_command.MpiNotFoundError as exc:
        sys.stderr.write(f"{PROG}: {exc}\n")
        return 1
    launcher = mpi_command.probe_launcher(mpiexec)
    logger.debug("MPI launcher: %s (%s)", launcher.path, launcher.implementation)
    refusal = mpi_command.launcher_mismatch(build_record.read_if_readable(), launcher)
    if (refusal is None and launcher.flavor is mpi_command.MpiFlavor.OPENMPI
            and openmpi.is_root()
            and not openmpi.run_as_root(config.allow_run_as_root, os.environ)):
        refusal = openmpi.ROOT_REFUSAL
    if refusal:
        sys.stderr.write(f"{PROG}: {refusal}\n")
        return 1

    local = config.hosts is None or hostlib.all_local(config.hosts)
    if local:
        bind, advertise = "127.0.0.1", "127.0.0.1"
    else:
        try:
            advertise = launcher_address(config.hosts, config.network_interface, os.environ)
        except UsageError as exc:
            sys.stderr.write(f"{PROG}: {exc}\n")
            return 2
        bind = advertise if config.network_interface else "0.0.0.0"
        logger.debug("ranks call the launcher back at %s", advertise)
    try:
        peer_timeout = wire.peer_timeout(os.environ)
    except ValueError as exc:
        sys.stderr.write(f"{PROG}: {exc}\n")
        return 2
    if config.elastic is not None:
        return elastic_driver.run(config, launcher, bind, advertise, peer_timeout)
    supervisor = new_supervisor(config, bind, advertise, JobSupervisor, peer_timeout)
    return supervise_job(config, launcher, supervisor).exit_code


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Console entry point of ``hvdliterun`` and ``python -m hvdlite.runner``.

    Args:
        argv: arguments without the program name; defaults to ``sys.argv[1:]``.

    Returns:
        The exit code (see :func:`run`); bad input exits with 2 via SystemExit.
    """
    config = parse_command_line(sys.argv[1:] if argv is None else argv)
    _setup_logging(config.verbose)
    return run(config)


if __name__ == "__main__":
    sys.exit(main())
