"""What the Ray tests run inside the workers (imported there by name: PYTHONPATH)."""
import socket

import numpy as np

# The training problem the Ray tests share: a small MLP, a fixed batch, SGD.
BATCH_PER_RANK = 8
FEATURES, HIDDEN, CLASSES = 6, 8, 3
STEPS = 4
LR = 0.1


def identity():
    """This rank's place: rank, size, local rank/size, cross rank/size, host name."""
    import hvdlite as hvd

    hvd.init()
    return {"rank": hvd.rank(), "size": hvd.size(), "local_rank": hvd.local_rank(),
            "local_size": hvd.local_size(), "cross_rank": hvd.cross_rank(),
            "cross_size": hvd.cross_size(), "hostname": socket.gethostname()}


def rank_values(rank):
    """The arrays rank ``rank`` contributes to the collectives."""
    rng = np.random.default_rng(100 + rank)
    return rng.standard_normal(5), rng.standard_normal((rank + 1, 2))


def collectives():
    """allreduce (sum, average), allgather of uneven rows, broadcast from the last rank."""
    import hvdlite as hvd

    hvd.init()
    vector, rows = rank_values(hvd.rank())
    return {"sum": hvd.allreduce(vector, op=hvd.Sum),
            "average": hvd.allreduce(vector, op=hvd.Average),
            "gathered": hvd.allgather(rows),
            "broadcast": hvd.broadcast(vector, root_rank=hvd.size() - 1)}


def make_data(size):
    """The whole batch of ``size`` ranks and the model's starting weights."""
    import torch

    generator = torch.Generator().manual_seed(7)
    x = torch.randn(BATCH_PER_RANK * size, FEATURES, generator=generator)
    y = torch.randint(0, CLASSES, (BATCH_PER_RANK * size,), generator=generator)
    return x, y


def make_model():
    import torch

    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, HIDDEN), torch.nn.Tanh(),
                               torch.nn.Linear(HIDDEN, CLASSES))


def train_reference(size):
    """One process on the whole batch: the weights after STEPS steps of SGD."""
    import torch

    torch.set_num_threads(1)
    x, y = make_data(size)
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    for _ in range(STEPS):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


def train_distributed(report=None):
    """Each rank its shard, averaged gradients (DistributedOptimizer): the weights after
    STEPS steps; ``report(step, loss)`` is called on each step when given."""
    import torch

    import hvdlite.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    x, y = make_data(hvd.size())
    shard = slice(hvd.rank() * BATCH_PER_RANK, (hvd.rank() + 1) * BATCH_PER_RANK)
    model = make_model()
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9),
        named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    for step in range(STEPS):
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x[shard]), y[shard])
        loss.backward()
        optimizer.step()
        if report is not None:
            report(step, float(loss))
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


class Counter:
    """A stateful executable: counts the calls made on it, remembers its start value."""

    def __init__(self, start, step=1):
        import hvdlite as hvd

        hvd.init()
        self.value = start
        self.step = step
        self.rank = hvd.rank()

    def bump(self):
        self.value += self.step
        return self.rank, self.value


def fail_on_rank(rank_to_fail):
    import hvdlite as hvd

    hvd.init()
    if hvd.rank() == rank_to_fail:
        raise ValueError(f"rank {hvd.rank()} fails on purpose")
    return hvd.rank()


def train_loop_per_worker(config):
    """Ray Train's loop: trains as train_distributed, reports every step's loss and,
    at the end, a checkpoint with the weights (rank 0's)."""
    import os
    import tempfile

    import ray.train

    import hvdlite.torch as hvd

    def report(step, loss):
        ray.train.report({"step": step, "loss": loss, "rank": hvd.rank(), "size": hvd.size()})

    marker = config.get("die_once")
    if marker and not os.path.exists(marker):
        hvd.init()
        if hvd.rank() == 1:  # the first attempt's rank 1 dies; Ray Train restarts the group
            open(marker, "w").close()
            os._exit(1)
        hvd.allreduce(np.ones(2), name="waits_for_the_lost_rank")  # raises RankFailedError
    weights = train_distributed(report=None if config.get("quiet") else report)
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = None
        if hvd.rank() == 0:
            np.savez(os.path.join(tmp, "weights.npz"), **weights)
            checkpoint = ray.train.Checkpoint.from_directory(tmp)
        ray.train.report({"step": STEPS, "rank": hvd.rank(), "size": hvd.size(),
                          "world_rank": ray.train.get_context().get_world_rank()},
                         checkpoint=checkpoint)


class DiesOnRank1:
    """An executable whose making kills the worker process of rank 1."""

    def __init__(self):
        import os

        import hvdlite as hvd

        hvd.init()
        if hvd.rank() == 1:
            os._exit(3)


def lose_rank_1():
    """Rank 1's process ends; the others' next collective must fail, not hang."""
    import os

    import hvdlite as hvd

    hvd.init()
    if hvd.rank() == 1:
        os._exit(1)
    try:
        hvd.allreduce(np.ones(4), name="after_the_loss")
    except Exception as exc:  # the error is the answer
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def executor_in_current_placement_group():
    """Inside a task of a placement group (as a Ray Tune trial runs): RayExecutor puts
    its workers into that group. Returns the ranks and whether the group was used."""
    from ray.util.placement_group import get_current_placement_group

    from hvdlite.ray import RayExecutor

    executor = RayExecutor(RayExecutor.create_settings(timeout_s=60,
                                                       placement_group_timeout_s=20),
                           num_workers=2)
    executor.start()
    try:
        ids = executor.run(identity)
        used = executor._placement_group.id == get_current_placement_group().id
    finally:
        executor.shutdown()
    return [i["rank"] for i in ids], [i["size"] for i in ids], used
