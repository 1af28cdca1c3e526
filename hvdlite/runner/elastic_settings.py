"""The elastic flags of hvdliterun, validated (``--min-np``, ``--max-np``, discovery).

The launcher's parser and the elastic driver both read these settings; the driver
itself is elastic_driver.py.
"""
import argparse
from dataclasses import dataclass
from typing import Optional, Tuple

DEFAULT_ELASTIC_TIMEOUT_S = 600.0
DISCOVERY_INTERVAL_S = 1.0


class ElasticUsageError(ValueError):
    """Bad elastic flags (the launcher reports it as a usage error)."""


@dataclass
class ElasticSettings:
    """The elastic flags, validated."""

    min_np: int
    max_np: int
    discovery_script: Optional[str] = None
    elastic_timeout: float = DEFAULT_ELASTIC_TIMEOUT_S
    reset_limit: Optional[int] = None
    cooldown_range: Optional[Tuple[float, float]] = None
    discovery_interval: float = DISCOVERY_INTERVAL_S


def add_arguments(parser: argparse.ArgumentParser):
    """Registers the elastic flags on hvdliterun's parser."""
    group = parser.add_argument_group(
        "elastic (a lost rank costs a rollback to the last commit, not the job)")
    group.add_argument("--min-np", type=int, metavar="N",
                       help="go on while at least N ranks remain (enables elastic mode)")
    group.add_argument("--max-np", type=int, metavar="N",
                       help="grow to at most N ranks as hosts are added (enables elastic mode)")
    group.add_argument("--host-discovery-script", metavar="SCRIPT",
                       help="prints the available hosts, one 'host:slots' per line; run "
                            "every second")
    group.add_argument("--elastic-timeout", type=float, default=DEFAULT_ELASTIC_TIMEOUT_S,
                       metavar="S", help="seconds to wait for --min-np slots before giving up "
                                         f"(default {DEFAULT_ELASTIC_TIMEOUT_S:g})")
    group.add_argument("--reset-limit", type=int, metavar="K",
                       help="end the job instead of a reset past K resets")
    group.add_argument("--blacklist-cooldown-range", type=float, nargs=2,
                       metavar=("MIN", "MAX"),
                       help="a failed slot or lost host comes back after a random "
                            "MIN..MAX seconds (default: never)")


def settings_from_args(args: argparse.Namespace) -> Optional[ElasticSettings]:
    """Returns the elastic settings, or None when the job is not elastic.

    Raises:
        ElasticUsageError: inconsistent values; the message names the flag.
    """
    elastic = args.min_np is not None or args.max_np is not None or \
        args.host_discovery_script is not None
    if not elastic:
        return None
    if args.host_discovery_script is not None and (args.hosts or args.hostfile):
        raise ElasticUsageError("--host-discovery-script and -H/--hostfile exclude each other")
    num = args.num_proc
    min_np = args.min_np if args.min_np is not None else num
    max_np = args.max_np if args.max_np is not None else num
    if min_np is None or max_np is None:
        raise ElasticUsageError("elastic mode needs -np, or --min-np and --max-np")
    if min_np < 1:
        raise ElasticUsageError(f"--min-np must be at least 1, got {min_np}")
    if max_np < min_np:
        raise ElasticUsageError(f"--max-np {max_np} is less than --min-np {min_np}")
    if num is not None and not min_np <= num <= max_np:
        raise ElasticUsageError(f"-np {num} is outside --min-np {min_np} .. --max-np {max_np}")
    if args.elastic_timeout <= 0:
        raise ElasticUsageError(f"--elastic-timeout must be > 0, got {args.elastic_timeout:g}")
    if args.reset_limit is not None and args.reset_limit < 0:
        raise ElasticUsageError(f"--reset-limit must be >= 0, got {args.reset_limit}")
    cooldown = args.blacklist_cooldown_range
    if cooldown is not None and not 0 <= cooldown[0] <= cooldown[1]:
        raise ElasticUsageError("--blacklist-cooldown-range needs 0 <= MIN <= MAX, got "
                                f"{cooldown[0]:g} {cooldown[1]:g}")
    return ElasticSettings(min_np=min_np, max_np=max_np,
                           discovery_script=args.host_discovery_script,
                           elastic_timeout=args.elastic_timeout, reset_limit=args.reset_limit,
                           cooldown_range=tuple(cooldown) if cooldown else None)
