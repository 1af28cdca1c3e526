"""What the benchmarks that compare systems share: the order of each round, the spread
of every round's figures, and the commit that produced them.

The machine's speed drifts for minutes (memory bandwidth, other load), so no system
keeps a fixed place in the round: round r runs them rotated by r (each system takes
every position once in every len(systems) rounds), and every round's figure is printed
beside the median and range.
"""
import os
import statistics
import subprocess

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def rotated(systems, round_):
    """``systems`` in round ``round_``'s order: rotated left by ``round_``."""
    systems = list(systems)
    if not systems:
        return systems
    k = round_ % len(systems)
    return systems[k:] + systems[:k]


def spread(values, fmt="{:.3f}"):
    """'median M, range LO-HI, rounds a b c' of one figure over the rounds."""
    return (f"median {fmt.format(statistics.median(values))}, range "
            f"{fmt.format(min(values))}-{fmt.format(max(values))}, rounds "
            + " ".join(fmt.format(v) for v in values))


def commit():
    """The checkout's commit (short hash), with "+dirty" when the tree has changes that
    are not committed (tracked files), or "unknown" outside a git checkout."""
    try:
        head = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, timeout=30, check=True)
        dirty = subprocess.run(["git", "-C", REPO, "status", "--porcelain",
                                "--untracked-files=no"],
                               capture_output=True, text=True, timeout=30, check=True)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def print_commit():
    print(f"commit {commit()}", flush=True)
