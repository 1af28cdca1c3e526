#!/usr/bin/env python3
"""Repeats "a rank killed on another host" (tests/cluster/test_cluster_faults.py) and
counts the survivors that died of a signal instead of raising RankFailedError.

    scripts/lost_peer_loop.py --runs 20               # 2 namespace hosts x 2 ranks (root)
    scripts/lost_peer_loop.py --runs 20 --one-host    # 4 ranks here, MPI over UCX tcp
    scripts/lost_peer_loop.py --runs 20 --small       # 2 hosts x 1 rank, small ops alone

Each run: the last rank (3; 1 with --small) SIGKILLs itself after 20 allreduces; the
others must each write what they raised. With --small the survivor is inside its own
blocking call's cycle, in MPI, when its peer dies (where each rank has a core). Per run
it prints whether a survivor died of SIGSEGV, how many times hvdlite's MPI fault guard
caught a fault ("parked": a parked background thread or an escaped cycle), which ranks raised
(a bad run also: a zero job status, or processes left on a host);
the job's output of a bad run goes to ``--keep DIR``. Exit status: 1 if any run was bad.
"""
import argparse
import os
import sys
import tempfile

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for sub in ("tests/cluster", "tests/multirank", "tests", ""):
    sys.path.insert(0, os.path.join(REPO_ROOT, sub))

import harness  # noqa: E402
import test_cluster_faults as scenario  # noqa: E402

VICTIM = 3
# One host: UCX over TCP between the ranks, as between hosts (no shared memory).
ONE_HOST_ENV = {"HVDLITE_PEER_TIMEOUT": str(scenario.PEER_TIMEOUT_S), "UCX_TLS": "tcp,self",
                "HVDLITE_SHM_ALLREDUCE": "0", "MPIR_CVAR_NOLOCAL": "1"}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--one-host", action="store_true")
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--keep", default=tempfile.gettempdir())
    args = parser.parse_args()
    cluster = None
    if not args.one_host:
        from hvdlite.runner import netns_cluster
        netns_cluster.cleanup_stale()
        cluster = netns_cluster.NetnsCluster(2).start()
    victim = 1 if args.small else VICTIM
    bad = 0
    try:
        for run in range(args.runs):
            with tempfile.TemporaryDirectory(prefix="hvdlite-faults-") as out_dir:
                os.chmod(out_dir, 0o777)
                if cluster is None:
                    result = harness.run_job(victim + 1, scenario.SCRIPT, timeout=150,
                                             env=ONE_HOST_ENV, args=[out_dir, victim, int(args.small)])
                else:
                    result = scenario._job(cluster, out_dir, victim=victim, small_only=args.small,
                                           hosts="h1:1,h2:1" if args.small else "h1:2,h2:2")
                raised = sorted(scenario._raised(out_dir, range(victim)))
            text = result.stdout + result.stderr
            died = "Segmentation fault" in text or "signal 11" in text
            ok = (not died and raised == list(range(victim)) and result.returncode != 0
                  and not getattr(result, "leftovers", None))
            if not ok:
                bad += 1
                path = os.path.join(args.keep, f"lost_peer_loop.run{run}.txt")
                with open(path, "w", encoding="utf-8") as f:
                    f.write(harness.describe(result) + "\n" + text)
            print(f"run {run}: segfault={died} parked={text.count('hvdlite: SIGSEGV inside')} "
                  f"raised={raised} status={result.returncode}", flush=True)
    finally:
        if cluster is not None:
            cluster.close()
    print(f"{args.runs} runs, {bad} bad", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
