#!/usr/bin/env python3
"""A test cluster on this machine: N hosts as network namespaces (needs root).

    scripts/cluster.py run --hosts 2 --rate 1gbit -- hvdliterun -np 4 -H h1:2,h2:2 python x.py
    scripts/cluster.py up --hosts 3 --rate 100mbit      # prints the cluster's name
    scripts/cluster.py run --cluster hvdlc123x1 --host h2 -- hostname
    scripts/cluster.py list
    scripts/cluster.py down hvdlc123x1
    scripts/cluster.py cleanup                          # clusters of dead creators

``run`` without ``--cluster`` builds a cluster, runs the command in its first host and
tears the cluster down when the command ends; the command's exit status is returned.
Commands run with the cluster's MPI environment (TCP over the shaped links) and
``HVDLITE_REMOTE_SHELL`` set, so ``hvdliterun -H h1:2,h2:2`` reaches the other hosts.
``up`` leaves a small holder process that owns the cluster until ``down``.
See hvdlite/runner/netns_cluster.py for the layout.
"""
import argparse
import os
import signal
import subprocess
import sys
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

from hvdlite.runner import netns_cluster  # noqa: E402
from hvdlite.runner.netns_cluster import NetnsCluster  # noqa: E402


def _add_shape_args(parser):
    parser.add_argument("--hosts", type=int, default=2, help="number of hosts (default 2)")
    parser.add_argument("--rate", default=None, help="link rate, e.g. 1gbit, 100mbit")
    parser.add_argument("--delay-ms", type=float, default=0.0,
                        help="one-way delay per link end (needs the kernel's netem)")
    parser.add_argument("--loss", type=float, default=0.0, help="packet loss per link end, %%")


def _build(args):
    return NetnsCluster(args.hosts, rate=args.rate, delay_ms=args.delay_ms,
                        loss_percent=args.loss)


def _describe(cluster):
    shape = cluster.shape
    lines = [f"cluster {cluster.prefix}: subnet {cluster.subnet}, rate {shape.rate or 'unlimited'},"
             f" delay {shape.delay_ms} ms, loss {shape.loss_percent} %"]
    lines += [f"  {h.name}  {h.address}  netns {h.netns}" for h in cluster.hosts]
    return "\n".join(lines)


def _job_env(cluster):
    env = cluster.mpi_env()
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO_ROOT, env.get("PYTHONPATH")) if p)
    return env


def cmd_run(args):
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        sys.exit("cluster.py run: give a command after --")
    if args.cluster:
        cluster = NetnsCluster.attach(args.cluster)
        return subprocess.call(cluster.command(args.host or "h1", command), env=_job_env(cluster))
    with _build(args) as cluster:
        if args.verbose:
            print(_describe(cluster), file=sys.stderr, flush=True)
        return subprocess.call(cluster.command(args.host or cluster.hosts[0].name, command),
                               env=_job_env(cluster))


def cmd_hold(args):
    """The holder behind ``up``: owns the cluster until SIGTERM (``down``)."""
    stop = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP}
    signal.pthread_sigmask(signal.SIG_BLOCK, stop)  # taken by sigwait, not by handlers
    with _build(args) as cluster:
        print(cluster.prefix, flush=True)
        print(_describe(cluster), flush=True)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)  # ends `up`'s read: it waits for our stdout to close
        os.close(devnull)
        signal.sigwait(stop)
    return 0


def cmd_up(args):
    holder = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "_hold", "--hosts", str(args.hosts),
         "--delay-ms", str(args.delay_ms), "--loss", str(args.loss)]
        + (["--rate", args.rate] if args.rate else []),
        stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, start_new_session=True)
    text = holder.stdout.read()
    if not text.strip():
        return holder.wait() or 1
    print(text, end="")
    return 0


def cmd_down(args):
    for state in netns_cluster.list_clusters():
        if state["prefix"] == args.prefix:
            if state["alive"]:
                os.kill(state["pid"], signal.SIGTERM)
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline and any(
                        c["prefix"] == args.prefix for c in netns_cluster.list_clusters()):
                    time.sleep(0.1)
            netns_cluster.cleanup_stale()
            return 0
    sys.exit(f"cluster.py down: no cluster {args.prefix!r} (see cluster.py list)")


def cmd_list(_args):
    for state in netns_cluster.list_clusters():
        status = "running" if state["alive"] else "stale (creator gone; cluster.py cleanup)"
        print(f"{state['prefix']}  creator pid {state['pid']}  {status}  "
              f"{' '.join(state['netns'])}")
    return 0


def cmd_cleanup(_args):
    for name in netns_cluster.cleanup_stale():
        print("removed", name)
    return 0


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="action", required=True)
    run = sub.add_parser("run", help="run a command in a host (of a new or running cluster)")
    _add_shape_args(run)
    run.add_argument("--cluster", help="a running cluster (from up) instead of a new one")
    run.add_argument("--host", help="the host to run in (default: the first)")
    run.add_argument("-v", "--verbose", action="store_true", help="describe the new cluster")
    run.add_argument("command", nargs=argparse.REMAINDER)
    up = sub.add_parser("up", help="build a cluster that stays until down")
    _add_shape_args(up)
    hold = sub.add_parser("_hold")
    _add_shape_args(hold)
    down = sub.add_parser("down", help="tear down a cluster made by up")
    down.add_argument("prefix")
    sub.add_parser("list", help="clusters on this machine")
    sub.add_parser("cleanup", help="remove clusters whose creator died")
    args = parser.parse_args()
    reason = netns_cluster.unavailable_reason()
    if reason and args.action not in ("list",):
        sys.exit(f"cluster.py: {reason}")
    handler = {"run": cmd_run, "up": cmd_up, "_hold": cmd_hold, "down": cmd_down,
               "list": cmd_list, "cleanup": cmd_cleanup}[args.action]
    return handler(args)


if __name__ == "__main__":
    sys.exit(main())
