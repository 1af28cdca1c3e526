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
import logging
import math
import os
import shlex
import socket
import sys
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

from hvdlite.runner import elastic_driver
from hvdlite.runner import hosts as hostlib
from hvdlite.runner import mpi_command
from hvdlite.runner import rank_wrapper

logger = logging.getLogger("hvdlite")

PROG = "hvdliterun"
DEFAULT_START_TIMEOUT_S = 60.0
_RANK_WRAPPER_PATH = os.path.abspath(rank_wrapper.__file__)


class UsageError(ValueError):
    """Bad command-line input: reported with exit code 2."""


def package_version() -> str:
    """hvdlite's version, without importing the package's native parts.

    Returns:
        The installed distribution's version, else the one in a source checkout's
        pyproject.toml, else ``unknown``.
    """
    try:
        from importlib import metadata
        return metadata.version("hvdlite")
    except Exception:  # noqa: BLE001 - not installed: fall back to the source tree
        pass
    pyproject = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))), "pyproject.toml")
    try:
        with open(pyproject, "r", encoding="utf-8") as f:
            for line in f:
                if line.startswith("version"):
                    return line.split("=", 1)[1].strip().strip('"\'')
    except OSError:
        pass
    return "unknown"


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
    launch = parser.add_argument_group("launch")
    launch.add_argument("--output-filename", metavar="DIR",
                        help="also write each rank's output to DIR/rank.<rank>.log")
    launch.add_argument("--start-timeout", type=float, default=DEFAULT_START_TIMEOUT_S,
                        metavar="S", help="seconds for every rank to start "
                                          f"(default {DEFAULT_START_TIMEOUT_S:g})")
    launch.add_argument("--mpi-args", default="", metavar="\"ARGS\"",
                        help="extra arguments for mpiexec, as one quoted string")
    launch.add_argument("--verbose", action="store_true",
                        help="log the launcher's decisions and the mpiexec command")
    elastic_driver.add_arguments(parser)
    info = parser.add_argument_group("information")
    info.add_argument("--check-build", action="store_true",
                      help="show frameworks, MPI, NCCL/CUDA and the native library, and exit")
    info.add_argument("--version", action="version", version=f"{PROG} (hvdlite) "
                                                             f"{package_version()}")
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="the program to run on every rank, and its arguments")
    return parser


@dataclass
class LaunchConfig:
    """A validated hvdliterun request."""

    num_ranks: int
    command: List[str]
    hosts: Optional[List[hostlib.HostSlots]] = None
    tuning_env: Dict[str, str] = field(default_factory=dict)
    output_dir: Optional[str] = None
    start_timeout: float = DEFAULT_START_TIMEOUT_S
    mpi_args: List[str] = field(default_factory=list)
    verbose: bool = False
    check_build: bool = False
    elastic: Optional[elastic_driver.ElasticSettings] = None


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
    return env


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
    hosts = None
    try:
        if args.hosts is not None:
            hosts = hostlib.parse_host_string(args.hosts)
        elif args.hostfile is not None:
            hosts = hostlib.parse_hostfile(args.hostfile)
    except hostlib.HostSpecError as exc:
        raise UsageError(str(exc)) from exc
    env = tuning_env(args)
    try:
        elastic = elastic_driver.settings_from_args(args)
    except elastic_driver.ElasticUsageError as exc:
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
                          check_build=args.check_build, elastic=elastic)
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
        raise UsageError(f"-np {config.num_ranks} is more than the {hostlib.total_slots(hosts)} "
                         f"slots given ({given})")
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


def rank_command(command: Sequence[str], python: str = sys.executable) -> List[str]:
    """The argv each rank runs: the rank wrapper (by path, stdlib only) and the command.

    Args:
        command: the user's command.
        python: the interpreter for the wrapper (the same path must exist on every host).

    Returns:
        The argument vector.
    """
    # -I: the wrapper needs nothing from PYTHONPATH or site customisations.
    return [python, "-I", _RANK_WRAPPER_PATH, "--", *command]


def build_job_command(config: LaunchConfig, launcher: mpi_command.MpiLauncher,
                      env: Dict[str, str], python: str = sys.executable,
                      run_as_root: Optional[bool] = None) -> List[str]:
    """The full mpiexec argv for a request (pure: nothing is started).

    Args:
        config: the validated request.
        launcher: the mpiexec to use.
        env: the environment the ranks will get (names are forwarded for Open MPI).
        python: the interpreter that runs the rank wrapper.
        run_as_root: add Open MPI's --allow-run-as-root; defaults to whether we are root.

    Returns:
        The argument vector.
    """
    if run_as_root is None:
        run_as_root = hasattr(os, "geteuid") and os.geteuid() == 0
    hosts = config.hosts
    options = mpi_command.MpiCommandOptions(
        launcher=launcher, num_ranks=config.num_ranks,
        rank_command=rank_command(config.command, python), hosts=hosts,
        set_env=dict(config.tuning_env),
        forward_env=mpi_command.forwardable_env_names(env),
        extra_args=config.mpi_args, run_as_root=run_as_root)
    return mpi_command.build_mpi_command(options)


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
        from hvdlite.runner.check_build import check_build
        return check_build()
    from hvdlite.runner.supervisor import JobSupervisor
    try:
        mpiexec = mpi_command.find_mpiexec()
    except mpi_command.MpiNotFoundError as exc:
        sys.stderr.write(f"{PROG}: {exc}\n")
        return 1
    launcher = mpi_command.probe_launcher(mpiexec)
    logger.debug("MPI launcher: %s (%s)", launcher.path, launcher.implementation)

    local = config.hosts is None or hostlib.all_local(config.hosts)
    if local:
        bind, advertise = "127.0.0.1", "127.0.0.1"
    else:
        # Ranks on other hosts connect back to this one by name; HVDLITE_LAUNCHER_HOST
        # picks the address when the host name does not resolve on the others.
        bind = "0.0.0.0"
        advertise = os.environ.get("HVDLITE_LAUNCHER_HOST") or socket.getfqdn()
    if config.elastic is not None:
        return elastic_driver.run(config, launcher, bind, advertise)
    supervisor = JobSupervisor(config.num_ranks, config.start_timeout, config.output_dir,
                               bind_host=bind, advertise_host=advertise)
    env = dict(os.environ)
    env.update(config.tuning_env)
    env.update(supervisor.rank_env())
    argv = build_job_command(config, launcher, env)
    logger.debug("running: %s", shlex.join(argv))
    return supervisor.run(argv, env).exit_code


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
