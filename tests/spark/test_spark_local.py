"""hvdlite.spark.run on Spark's local-cluster mode: 2 workers of 2 cores (4 task slots),
one Spark context shared by the module and stopped after it (its JVMs too).

Each test runs real barrier stages: the tasks register, hvdliterun on the driver starts
the ranks, and the expected values come from numpy or one torch process in this one.
"""
import sys
import time
import uuid

import numpy as np
import pytest

from spark_session import (assert_none_left, local_cluster_context, require_spark,
                           stop_spark, wait_for_executors)

pyspark = require_spark()
from pyspark import cloudpickle  # noqa: E402

import hvdlite.spark  # noqa: E402

# The ranks unpickle these functions without this test module on their path.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

SLOTS = 4
RUN_TIMEOUT_S = 120


@pytest.fixture(scope="module")
def sc():
    context = None
    try:
        context = local_cluster_context(workers=2, cores=SLOTS // 2)
        wait_for_executors(context, SLOTS)
        yield context
    finally:
        stop_spark(context)


def rank_and_place():
    import os
    import socket

    import hvdlite as hvd
    hvd.init()
    print(f"rank {hvd.rank()} of {hvd.size()}", flush=True)
    return (hvd.rank(), hvd.size(), int(os.environ["HVDLITE_SPARK_TASK_INDEX"]),
            socket.gethostname())


def allreduce_against(seed):
    import hvdlite as hvd
    hvd.init()
    data = np.random.default_rng(seed + hvd.rank()).standard_normal(1000)
    return (hvd.allreduce(data, op=hvd.Sum), hvd.allreduce(data, op=hvd.Average),
            hvd.allgather(data[:3].copy()))


def train_linear(x, y, steps, lr):
    import torch

    import hvdlite.torch as hvd
    torch.set_num_threads(1)
    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Linear(x.shape[1], 1)
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
    return torch.cat([p.detach().flatten() for p in model.parameters()]).numpy()


def fail_on_rank_one(message):
    import time

    import hvdlite as hvd
    hvd.init()
    if hvd.rank() == 1:
        raise ValueError(message)
    time.sleep(300)   # ended by the job's failure, long before this


@pytest.mark.timeout(RUN_TIMEOUT_S)
def test_results_in_rank_order_with_default_num_proc(native, sc):
    import io

    out = io.StringIO()
    results = hvdlite.spark.run(rank_and_place, start_timeout=60, stdout=out, verbose=2)
    # The ranks' output reaches the stream given, tagged with rank and (verbose=2) host.
    lines = out.getvalue().splitlines()
    for rank in range(SLOTS):
        assert f"[{rank}@{results[rank][3]}]<stdout>:rank {rank} of {SLOTS}" in lines, lines
    assert sc.defaultParallelism == SLOTS
    assert [r[:2] for r in results] == [(rank, SLOTS) for rank in range(SLOTS)]
    # One host: rank r holds the slot of task r.
    assert sorted(r[2] for r in results) == list(range(SLOTS))


@pytest.mark.timeout(RUN_TIMEOUT_S)
@pytest.mark.parametrize("num_proc", [2, 3])
def test_allreduce_against_numpy(native, sc, num_proc):
    results = hvdlite.spark.run(allreduce_against, args=(10,), num_proc=num_proc,
                                start_timeout=60)
    data = [np.random.default_rng(10 + r).standard_normal(1000) for r in range(num_proc)]
    assert len(results) == num_proc
    for total, mean, gathered in results:
        np.testing.assert_allclose(total, np.sum(data, axis=0), rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(mean, np.mean(data, axis=0), rtol=1e-12, atol=1e-12)
        np.testing.assert_array_equal(gathered, np.concatenate([d[:3] for d in data]))


@pytest.mark.timeout(RUN_TIMEOUT_S)
def test_torch_model_equals_one_process_on_the_whole_batch(native, sc):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(3)
    x = rng.standard_normal((24, 5)).astype(np.float32)
    y = (x @ rng.standard_normal((5, 1)) + 0.5).astype(np.float32)
    results = hvdlite.spark.run(train_linear, args=(x, y, 6, 0.1), num_proc=2,
                                start_timeout=60)
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(6):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(torch.tensor(x)), torch.tensor(y)).backward()
        opt.step()
    want = torch.cat([p.detach().flatten() for p in model.parameters()]).numpy()
    for weights in results:
        np.testing.assert_allclose(weights, want, rtol=1e-5, atol=1e-6)
    torch.manual_seed(0)
    assert not np.allclose(torch.nn.Linear(5, 1).weight.detach().numpy().ravel(),
                           want[:5]), "the reference did not train"


@pytest.mark.timeout(RUN_TIMEOUT_S)
def test_too_few_slots_fails_within_start_timeout(sc):
    begin = time.monotonic()
    with pytest.raises(hvdlite.spark.SparkJobError) as info:
        hvdlite.spark.run(rank_and_place, num_proc=SLOTS + 1, start_timeout=3)
    took = time.monotonic() - begin
    assert took < 15, f"took {took:.1f} s for a start_timeout of 3 s"
    message = str(info.value)
    assert f"num_proc={SLOTS + 1}" in message and f"the cluster has {SLOTS}" in message, message


@pytest.mark.timeout(RUN_TIMEOUT_S)
def test_failing_rank_names_it_and_leaves_nothing(native, sc):
    mark = f"HVDLITE_SPARK_TEST_MARK=fail-{uuid.uuid4().hex}"
    env = dict(__import__("os").environ)
    env[mark.split("=")[0]] = mark.split("=")[1]
    begin = time.monotonic()
    with pytest.raises(hvdlite.spark.SparkJobError) as info:
        hvdlite.spark.run(fail_on_rank_one, args=("boom from rank one",), num_proc=2,
                          start_timeout=60, env=env)
    took = time.monotonic() - begin
    error = info.value
    assert (error.rank, error.task_index) == (1, 1), str(error)
    assert "rank 1 (Spark task 1 on host" in str(error)
    assert "ValueError: boom from rank one" in str(error)
    assert took < 60, f"the failure took {took:.1f} s to end the job (rank 0 sleeps 300 s)"
    assert_none_left(mark)
    # The stage ended too: the cluster takes the next job at once.
    assert [r[0] for r in hvdlite.spark.run(rank_and_place, num_proc=2, start_timeout=30)] \
        == [0, 1]


@pytest.mark.timeout(RUN_TIMEOUT_S)
def test_digits_example_learns(native, sc):
    pytest.importorskip("sklearn")
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))), "examples", "spark_digits.py")
    spec = importlib.util.spec_from_file_location("spark_digits_example", path)
    example = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = example
    spec.loader.exec_module(example)
    cloudpickle.register_pickle_by_value(example)
    # On the shared context (the example's main() starts and stops its own session).
    accuracy = example.run_training(num_proc=2, epochs=5)
    assert accuracy > 0.8, f"test accuracy {accuracy:.2%} after 5 epochs"


def kill_task_of_rank_one():
    import os
    import signal
    import time

    import hvdlite as hvd
    hvd.init()
    if hvd.rank() == 1:
        os.kill(int(os.environ["HVDLITE_SPARK_TASK_PID"]), signal.SIGKILL)
    time.sleep(300)   # ended with the job, long before this


@pytest.mark.timeout(RUN_TIMEOUT_S)
def test_failing_task_names_it_and_leaves_nothing(native, sc):
    import os

    mark = uuid.uuid4().hex
    env = dict(os.environ, HVDLITE_SPARK_TEST_MARK=mark)
    begin = time.monotonic()
    with pytest.raises(hvdlite.spark.SparkJobError) as info:
        hvdlite.spark.run(kill_task_of_rank_one, num_proc=2, start_timeout=60, env=env)
    took = time.monotonic() - begin
    error = info.value
    assert (error.task_index, error.rank) == (1, 1), str(error)
    assert "Spark task 1 on host" in str(error) and "ended before the job did" in str(error)
    assert took < 60, f"took {took:.1f} s (rank 0 sleeps 300 s)"
    assert_none_left(f"HVDLITE_SPARK_TEST_MARK={mark}")
    assert [r[0] for r in hvdlite.spark.run(rank_and_place, num_proc=2, start_timeout=60)] \
        == [0, 1]
