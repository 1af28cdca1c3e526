"""Collectives across hosts of a namespace cluster: hvdlite, flat MPI, and the link's limit.

    sudo .venv/bin/python benchmarks/cluster_allreduce.py              # 2 hosts x 2, 1gbit
    sudo .venv/bin/python benchmarks/cluster_allreduce.py --hosts 2 --ranks-per-host 2 \\
        --rate 1gbit --sizes-mib 1,4,16,64 --reps 7 --collectives allreduce,allgather,broadcast \\
        --json out.json

Builds a cluster (hvdlite/runner/netns_cluster.py: one network namespace per host, links
shaped with tc, MPI forced onto TCP), starts this file on every rank with hvdliterun
-H h1:R,h2:R,... and measures, repetition by repetition alternating the two systems (so
drifts of this shared machine's load hit both alike), for float32 buffers of each size S:

* allreduce (Sum) of S bytes: ``hvdlite.allreduce(out=...)`` against mpi4py's
  ``comm.Allreduce``; every host must send (and receive) at least 2(h-1)/h * S bytes
  over its one link;
* allgather of S bytes in all (S / ranks from each): ``hvdlite.allgather`` against
  ``comm.Allgather``; every host must receive the (h-1)/h * S bytes of the others;
* broadcast of S bytes from rank 0: ``hvdlite.broadcast`` against ``comm.Bcast``; every
  other host must receive S bytes.

The link limit is that many bytes * 8 / rate seconds: no algorithm beats it. A
repetition's time is the slowest rank's. Rank 0 prints medians and ranges, each
system's fraction of the link limit (limit / time: 1.0 is the wire's speed) and hvdlite
against MPI. Needs root (network namespaces).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIB = 1024 * 1024


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hosts", type=int, default=2)
    p.add_argument("--ranks-per-host", type=int, default=2)
    p.add_argument("--rate", default="1gbit", help="each host link's rate (tc syntax)")
    p.add_argument("--sizes-mib", default="1,4,16,64")
    p.add_argument("--reps", type=int, default=7, help="repetitions per system and size")
    p.add_argument("--collectives", default="allreduce",
                   help="comma-separated: allreduce, allgather, broadcast")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--json", help="also write the figures to this file")
    p.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args()


# Bytes the busiest host link must carry for a collective of S bytes over h hosts.
LINK_BYTES = {"allreduce": lambda s, h: 2 * (h - 1) / h * s,
              "allgather": lambda s, h: (h - 1) / h * s,
              "broadcast": lambda s, h: s}


def link_limit_s(collective, nbytes, hosts, rate_bps):
    """Seconds the busiest host link needs at least for ``collective`` of ``nbytes``."""
    return LINK_BYTES[collective](nbytes, hosts) * 8 / rate_bps


def drive(args):
    """Builds the cluster and runs the ranks through hvdliterun inside it."""
    sys.path.insert(0, REPO_ROOT)
    from hvdlite.runner.netns_cluster import NetnsCluster, unavailable_reason

    reason = unavailable_reason()
    if reason:
        sys.exit(f"cluster_allreduce.py: {reason}")
    hosts_spec = ",".join(f"h{i + 1}:{args.ranks_per_host}" for i in range(args.hosts))
    with NetnsCluster(args.hosts, rate=args.rate) as cluster:
        env = cluster.mpi_env()
        env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO_ROOT, env.get("PYTHONPATH")) if p)
        env["OMP_NUM_THREADS"] = "1"
        command = [sys.executable, "-m", "hvdlite.runner", "-H", hosts_spec,
                   sys.executable, os.path.abspath(__file__), "--rank", "--hosts",
                   str(args.hosts), "--rate", args.rate, "--sizes-mib", args.sizes_mib,
                   "--reps", str(args.reps), "--collectives", args.collectives] + (["--json", os.path.abspath(args.json)]
                                                if args.json else [])
        print(f"cluster {cluster.prefix}: {args.hosts} hosts x {args.ranks_per_host} ranks, "
              f"links {args.rate}; {' '.join(command[2:5])}", flush=True)
        proc = cluster.popen("h1", command, env=env)
        try:
            return proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            sys.exit(f"cluster_allreduce.py: timed out after {args.timeout:g} s")


def measure(args):
    """One rank's part: interleaved repetitions; rank 0 reports."""
    import numpy as np
    from mpi4py import MPI  # initializes MPI (THREAD_MULTIPLE); hvdlite.init() reuses it

    import hvdlite as hvd
    from hvdlite.runner.netns_cluster import rate_bits_per_second

    hvd.init()
    comm = MPI.COMM_WORLD
    rank, size = comm.rank, comm.size
    rate = rate_bits_per_second(args.rate)
    sizes = [int(float(s) * MIB) for s in args.sizes_mib.split(",")]

    def slowest(seconds):
        return comm.allreduce(seconds, op=MPI.MAX)

    def systems(collective, nbytes):
        """(hvdlite's call, MPI's call, check of both results) on buffers of nbytes."""
        if collective == "allreduce":
            x = np.full(nbytes // 4, rank + 1, np.float32)
            out_h, out_m = np.empty_like(x), np.empty_like(x)
            want = sum(range(1, size + 1))
            return (lambda name: hvd.allreduce(x, op=hvd.Sum, name=name, out=out_h),
                    lambda: comm.Allreduce(x, out_m, op=MPI.SUM),
                    lambda: out_h[-1] == want and out_m[-1] == want)
        if collective == "allgather":
            x = np.full(nbytes // 4 // size, rank + 1, np.float32)
            out_m = np.empty(x.size * size, np.float32)
            got = {}
            want = np.repeat(np.arange(1, size + 1, dtype=np.float32), x.size)
            return (lambda name: got.__setitem__("h", hvd.allgather(x, name=name)),
                    lambda: comm.Allgather(x, out_m),
                    lambda: np.array_equal(got["h"], want) and np.array_equal(out_m, want))
        x = np.full(nbytes // 4, 1.0 if rank == 0 else 0.0, np.float32)
        out_h, y = np.empty_like(x), x.copy()
        return (lambda name: hvd.broadcast(x, root_rank=0, name=name, out=out_h),
                lambda: comm.Bcast(y, root=0),
                lambda: out_h[-1] == 1.0 and y[-1] == 1.0)

    rows = []
    for collective in args.collectives.split(","):
        for nbytes in sizes:
            run_h, run_m, right = systems(collective, nbytes)
            run_h(f"warm.{collective}{nbytes}")  # negotiation, caches
            run_m()
            times = {"hvdlite": [], "mpi": []}
            for rep in range(args.reps):
                for system in (("hvdlite", "mpi") if rep % 2 == 0 else ("mpi", "hvdlite")):
                    comm.Barrier()
                    start = time.perf_counter()
                    if system == "hvdlite":
                        run_h(f"{collective}{nbytes}")
                    else:
                        run_m()
                    times[system].append(slowest(time.perf_counter() - start))
            assert right(), (collective, nbytes)
            limit = link_limit_s(collective, nbytes, args.hosts, rate)
            row = {"collective": collective, "bytes": nbytes, "limit_s": limit}
            for system, values in times.items():
                median = statistics.median(values)
                row[system] = {"median_s": median, "min_s": min(values), "max_s": max(values),
                               "of_link_limit": limit / median}
            row["hvdlite_vs_mpi"] = row["mpi"]["median_s"] / row["hvdlite"]["median_s"]
            rows.append(row)
    if rank == 0:
        print(f"\nfloat32, {args.hosts} hosts x {size // args.hosts} ranks, links {args.rate}, "
              f"{args.reps} interleaved reps, median [min-max] ms; 'of limit' = link limit / time")
        print(f"{'':>9} {'size':>7} {'limit ms':>9} {'hvdlite ms':>22} {'of limit':>8} "
              f"{'flat MPI ms':>22} {'of limit':>8} {'hvdlite/MPI speed':>17}")
        for row in rows:
            h, m = row["hvdlite"], row["mpi"]
            print(f"{row['collective']:>9} {row['bytes'] / MIB:>4g}MiB {row['limit_s'] * 1e3:>9.1f} "
                  f"{h['median_s'] * 1e3:>8.1f} [{h['min_s'] * 1e3:6.1f}-{h['max_s'] * 1e3:6.1f}]"
                  f" {h['of_link_limit']:>8.2f} "
                  f"{m['median_s'] * 1e3:>8.1f} [{m['min_s'] * 1e3:6.1f}-{m['max_s'] * 1e3:6.1f}]"
                  f" {m['of_link_limit']:>8.2f} {row['hvdlite_vs_mpi']:>17.2f}")
        if args.json:
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump({"hosts": args.hosts, "size": size, "rate": args.rate,
                           "rows": rows}, f, indent=1)
    hvd.shutdown()


if __name__ == "__main__":
    arguments = parse_args()
    if arguments.rank:
        measure(arguments)
    else:
        sys.exit(drive(arguments))
