"""A real multi-process numpy allreduce: each rank averages its array with every other's.

    python -m hvdlite.runner -np 2 python examples/numpy_allreduce_demo.py
    mpiexec -n 3 python examples/numpy_allreduce_demo.py

Every rank makes its own "gradients" (a few arrays of different shapes and dtypes, drawn
from a generator seeded by its rank), averages them across ranks with hvdlite, and checks
the result against ``numpy.mean`` of all ranks' arrays, which it can rebuild because the
seeds are known. Rank 0 prints what happened. The arrays are submitted asynchronously
and waited for together, the way a training step hands its gradients over.
"""
import sys

import numpy as np

import hvdlite as hvd

SHAPES = {"layer1.weight": (64, 32), "layer1.bias": (32,), "layer2.weight": (32, 10),
          "layer2.bias": (10,)}
STEPS = 3


def gradients(rank, step):
    """This rank's arrays for one step (any rank can rebuild any other rank's)."""
    rng = np.random.default_rng([rank, step])
    return {name: rng.standard_normal(shape).astype(np.float32)
            for name, shape in SHAPES.items()}


def main():
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"hvdlite {hvd.__version__}: {size} ranks, {len(SHAPES)} tensors per step")
    worst = 0.0
    for step in range(STEPS):
        mine = gradients(rank, step)
        # Submit everything, then wait: the core fuses the small tensors into one
        # collective. Same names every step, so steps after the first skip negotiation.
        handles = {name: hvd.allreduce_async(array, name=name, op=hvd.Average)
                   for name, array in mine.items()}
        averaged = {name: hvd.synchronize(h) for name, h in handles.items()}

        everyone = [gradients(r, step) for r in range(size)]
        for name, result in averaged.items():
            expected = np.mean([g[name] for g in everyone], axis=0)
            error = float(np.max(np.abs(result - expected)))
            worst = max(worst, error)
            if not np.allclose(result, expected, rtol=1e-5, atol=1e-6):
                print(f"rank {rank}: {name} differs from numpy's mean by {error}",
                      file=sys.stderr)
                return 1
        show = lambda a: "[" + ", ".join(f"{v:+.4f}" for v in a[:3]) + "]"  # noqa: E731
        reference = np.mean([g["layer2.bias"] for g in everyone], axis=0)
        say(f"step {step}: averaged {sum(a.size for a in mine.values())} floats; "
            f"layer2.bias[:3] = {show(averaged['layer2.bias'])} "
            f"(numpy mean: {show(reference)})")

    # Integers too: the sum of every rank's id, exact.
    total = hvd.allreduce(np.array([rank], dtype=np.int64), name="rank_sum", op=hvd.Sum)
    assert int(total[0]) == size * (size - 1) // 2
    stats = hvd.stats()
    say(f"sum of ranks = {int(total[0])}; largest difference from numpy.mean = {worst:.2e}")
    say(f"core counters: {stats['tensors']} tensors in {stats['collectives']} collectives "
        f"({stats['fused_collectives']} fused), {stats['cache_hits']} negotiated from the "
        f"response cache, {stats['coordinator_gathers']} coordinator rounds")
    say("OK: every rank's result equals numpy's mean of all ranks' arrays")
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
