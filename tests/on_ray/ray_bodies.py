"""What the Ray tests run inside the workers (imported there by name: PYTHONPATH)."""
import os
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


class Doomed:
    """An actor that ``call_a_dead_actor_on_rank`` kills before calling it."""

    def ping(self):
        return True


def call_a_dead_actor_on_rank(rank_to_fail):
    """fn's own call to an actor it killed: Ray raises an actor's death inside fn (a
    RayTaskError that is also a RayActorError, while the worker itself lives)."""
    import time

    import ray

    import hvdlite as hvd

    hvd.init()
    if hvd.rank() == rank_to_fail:
        doomed = ray.remote(Doomed).options(num_cpus=0).remote()
        ray.get(doomed.ping.remote())
        ray.kill(doomed)  # asynchronous: a call right after may still be answered
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            ray.get(doomed.ping.remote())  # raises once the actor is dead
            time.sleep(0.05)
        raise RuntimeError("the killed actor still answers after 30 s")
    return hvd.rank()


def reports_after_the_queue_dies():
    """Rank 0 kills the driver's report queue after the first report of each rank; the
    reports after it are dropped with one warning per process, and fn goes on. Returns
    (rank, the warnings' messages)."""
    import time
    import warnings

    import numpy as np
    import ray

    import hvdlite as hvd
    from hvdlite.ray import ray_logger

    hvd.init()
    ray_logger.log({"rank": hvd.rank(), "i": 0})
    hvd.allreduce(np.zeros(1), name="reported")  # every first report is in the queue
    if hvd.rank() == 0:
        queue = ray_logger._queue.actor
        deadline = time.monotonic() + 30
        while ray.get(queue.qsize.remote()) and time.monotonic() < deadline:
            time.sleep(0.05)  # the driver has taken every first report
        ray.kill(queue)
        try:
            ray.get(queue.qsize.remote(), timeout=30)
        except ray.exceptions.RayActorError:
            pass  # dead, as wanted
    hvd.allreduce(np.zeros(1), name="killed")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(1, 4):
            ray_logger.log({"rank": hvd.rank(), "i": i})
    return hvd.rank(), [str(w.message) for w in caught]


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
        import torch

        hvd.allreduce(torch.ones(2), name="waits_for_the_lost_rank")  # raises RankFailedError
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


# -- elastic (issue 30): a least-squares model trained step by step, one commit a step --

ELASTIC_STEPS = 24
ELASTIC_W0 = (0.5, -0.25, 1.0)
ELASTIC_LR = 0.1


def elastic_data(step, rank):
    """The samples rank ``rank`` trains on at ``step``, in any world."""
    rng = np.random.default_rng(1000 * step + rank)
    return rng.standard_normal((4, 3)), rng.standard_normal(4)


def elastic_reference(history):
    """numpy's replay of the committed steps: ``history`` is [(step, world size)], each
    step's gradient the average of its ranks' (as DistributedOptimizer's)."""
    w = np.array(ELASTIC_W0, dtype=np.float64)
    for step, size in history:
        grads = []
        for rank in range(size):
            x, y = elastic_data(step, rank)
            grads.append(2.0 * x.T @ (x @ w - y) / len(y))
        w = w - ELASTIC_LR * np.mean(grads, axis=0)
    return w


def elastic_train(steps, step_s=0.2, use_torch=True):
    """An elastic job's function: ``steps`` SGD steps, a commit after each. Returns this rank's place, its committed history and
    its weights. Every rank reports each commit through ray_logger. Runs again from its start in each new world; the state brings it to the
    last commit."""
    import socket as socket_mod
    import time

    from hvdlite.ray import ray_logger

    if use_torch:
        import torch

        import hvdlite.torch as hvd

        torch.set_num_threads(1)
        hvd.init()
        model = torch.nn.Linear(3, 1, bias=False).double()
        with torch.no_grad():
            model.weight.copy_(torch.tensor([ELASTIC_W0], dtype=torch.float64))
        optimizer = hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=ELASTIC_LR),
            named_parameters=model.named_parameters())
        state = hvd.elastic.TorchState(model, optimizer, step=0, history=[])

        def train_step(step):
            x, y = (torch.from_numpy(a) for a in elastic_data(step, hvd.rank()))
            optimizer.zero_grad()
            ((model(x).squeeze(1) - y) ** 2).mean().backward()
            optimizer.step()

        def weights():
            return model.weight.detach().numpy()[0].copy()
    else:
        import hvdlite as hvd
        import hvdlite.elastic

        hvd.init()
        state = hvdlite.elastic.ObjectState(step=0, history=[],
                                            w=np.array(ELASTIC_W0, dtype=np.float64))

        def train_step(step):
            x, y = elastic_data(step, hvd.rank())
            grad = 2.0 * x.T @ (x @ state.w - y) / len(y)
            state.w = state.w - ELASTIC_LR * hvd.allreduce(grad, op=hvd.Average,
                                                           name="elastic.grad")

        def weights():
            return state.w.copy()

    elastic = hvd.elastic if use_torch else hvdlite.elastic

    @elastic.run
    def train(state):
        while state.step < steps:
            train_step(state.step)
            state.history = state.history + [(state.step, hvd.size())]
            state.step += 1
            state.commit()
            ray_logger.log({"step": state.step, "size": hvd.size(), "rank": hvd.rank(),
                            "pid": os.getpid(), "host": socket_mod.gethostname(),
                            "time": time.time()})
            time.sleep(step_s)
        return {"rank": hvd.rank(), "size": hvd.size(), "host": socket_mod.gethostname(),
                "history": [list(h) for h in state.history], "w": weights().tolist(),
                "pid": os.getpid()}

    return train(state)


class Blocker:
    """An actor that only holds resources (so that a node is busy until it ends)."""

    def ready(self):
        return True


def ranks_report(value):
    """A static run's body for callbacks: each rank reports twice."""
    import hvdlite as hvd
    from hvdlite.ray import ray_logger

    hvd.init()
    for i in range(2):
        ray_logger.log({"rank": hvd.rank(), "i": i, "value": value})
    return hvd.rank()


def bump_and_train(counter):
    """An elastic execute's body: the world's executable, then a short elastic job."""
    return counter.bump(), elastic_train(3, step_s=0.0, use_torch=False)


def train_loop_that_hangs(config):
    """Ray Train's loop of a run that never ends: each worker joins hvdlite, then waits
    for good (a hang for ``fit_within`` to end)."""
    import time

    import hvdlite.torch as hvd

    hvd.init()
    time.sleep(3600)
