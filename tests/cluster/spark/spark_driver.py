"""The driver of tests/cluster/test_cluster_spark.py, run inside the master's host.

    spark_driver.py MASTER_URL DRIVER_ADDRESS SLOTS

Connects to the standalone master, waits for SLOTS task slots, then runs through
hvdlite.spark.run: an allreduce across the workers' hosts (every rank reports its
host, its task and its sums), a torch model trained on shards of one batch (where torch
is installed), and a function that raises on one rank. Prints one line
``RESULT <json>``; the test checks it against numpy.
"""
import json
import os
import socket
import sys
import time
import traceback

import numpy as np
from pyspark import SparkConf, SparkContext

import hvdlite.spark
from hvdlite.spark.driver import task_slots

ELEMENTS = 1 << 16


def training_data(rows=24, features=5, seed=3):
    """The torch run's batch: (x, y), float32, y a noisy linear function of x."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, features)).astype(np.float32)
    y = (x @ rng.standard_normal((features, 1)) + 0.5).astype(np.float32)
    return x, y


TRAIN_STEPS, TRAIN_LR = 6, 0.1
try:
    import torch  # noqa: F401 -- only whether the ranks can train
    TRAIN = (*training_data(), TRAIN_STEPS, TRAIN_LR)
except ImportError:
    TRAIN = None


def allreduce_across_hosts():
    import os
    import socket

    import numpy as np

    import hvdlite as hvd
    hvd.init()
    data = np.random.default_rng(100 + hvd.rank()).standard_normal(ELEMENTS)
    total = hvd.allreduce(data, op=hvd.Sum)
    return {"rank": hvd.rank(), "size": hvd.size(), "local_rank": hvd.local_rank(),
            "host": socket.gethostname(), "task": int(os.environ["HVDLITE_SPARK_TASK_INDEX"]),
            "sum_head": total[:8].tolist(), "sum_norm": float(np.linalg.norm(total))}


def train_linear(x, y, steps, lr):
    """A torch model trained by every rank on its shard: after each step, the weights of
    one process on the whole batch (equal shards, mean-squared error)."""
    import socket

    import torch

    import hvdlite.torch as hvd
    torch.set_num_threads(1)
    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Linear(x.shape[1], 1)
    if hvd.rank() != 0:   # start apart: the broadcast must make them equal
        for p in model.parameters():
            p.data.add_(1.0)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr),
                                   named_parameters=model.named_parameters())
    shard = len(x) // hvd.size()
    xs = torch.tensor(x[hvd.rank() * shard:(hvd.rank() + 1) * shard])
    ys = torch.tensor(y[hvd.rank() * shard:(hvd.rank() + 1) * shard])
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(xs), ys).backward()
        opt.step()
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    return {"rank": hvd.rank(), "host": socket.gethostname(), "weights": weights.tolist()}


def fail_on_last_rank():
    import time

    import hvdlite as hvd
    hvd.init()
    if hvd.rank() == hvd.size() - 1:
        raise RuntimeError(f"planned failure on rank {hvd.rank()}")
    time.sleep(300)


def main():
    master, address, slots = sys.argv[1], sys.argv[2], int(sys.argv[3])
    conf = (SparkConf().setMaster(master).setAppName("hvdlite-spark-cluster-test")
            .set("spark.driver.host", address).set("spark.driver.bindAddress", address)
            .set("spark.driver.memory", "512m").set("spark.executor.memory", "512m")
            .set("spark.ui.enabled", "false").set("spark.ui.showConsoleProgress", "false")
            .set("spark.pyspark.python", sys.executable)
            .set("spark.executorEnv.PYTHONPATH", os.environ.get("PYTHONPATH", "")))
    sc = SparkContext(conf=conf)
    sc.setLogLevel("ERROR")
    out = {"driver_host": socket.gethostname()}
    try:
        deadline = time.monotonic() + 120
        while task_slots(sc) != slots and time.monotonic() < deadline:
            time.sleep(0.5)
        out["slots"] = task_slots(sc)
        begin = time.monotonic()
        out["allreduce"] = hvdlite.spark.run(allreduce_across_hosts, num_proc=slots,
                                             start_timeout=120, verbose=2)
        out["allreduce_s"] = time.monotonic() - begin
        want = np.sum([np.random.default_rng(100 + r).standard_normal(ELEMENTS)
                       for r in range(slots)], axis=0)
        out["want_head"] = want[:8].tolist()
        out["want_norm"] = float(np.linalg.norm(want))
        if TRAIN is not None:
            x, y, steps, lr = TRAIN
            begin = time.monotonic()
            out["torch"] = hvdlite.spark.run(train_linear, args=(x, y, steps, lr),
                                             num_proc=slots, start_timeout=120)
            out["torch_s"] = time.monotonic() - begin
        begin = time.monotonic()
        try:
            hvdlite.spark.run(fail_on_last_rank, num_proc=slots, start_timeout=120)
            out["failure"] = None
        except hvdlite.spark.SparkJobError as error:
            out["failure"] = {"message": str(error), "rank": error.rank,
                              "task": error.task_index, "host": error.host}
        out["failure_s"] = time.monotonic() - begin
    except BaseException:   # noqa: B902 -- reported to the test
        out["error"] = traceback.format_exc()
    finally:
        sc.stop()
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
