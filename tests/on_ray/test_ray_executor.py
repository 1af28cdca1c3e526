"""RayExecutor on a single-node Ray cluster: horovod.ray's API over real ranks.

One Ray cluster (6 logical CPUs) serves the module; one executor of 3 workers serves
most tests (forming a world takes about a second, Ray's own start several). Expected
values come from numpy and from one process training on the whole batch.
"""
import time

import numpy as np
import pytest

import needs
import ray_bodies

pytestmark = [pytest.mark.timeout(180),
              needs.needs("ray", needs.installed("ray"), "ray not installed")]

SIZE = 3


@pytest.fixture(scope="module")
def executor(ray_local):
    from hvdlite.ray import RayExecutor

    settings = RayExecutor.create_settings(timeout_s=60)
    executor = RayExecutor(settings, num_workers=SIZE, cpus_per_worker=1)
    executor.start(executable_cls=ray_bodies.Counter, executable_args=[10],
                   executable_kwargs={"step": 5})
    try:
        yield executor
    finally:
        executor.shutdown()


def test_argument_errors_as_horovod():
    ray_mod = needs.import_or_skip("ray")  # noqa: F841
    from hvdlite.ray import RayExecutor

    settings = RayExecutor.create_settings()
    with pytest.raises(ValueError, match="Both `min_workers` and `num_workers`"):
        RayExecutor(settings, num_workers=2, min_workers=1)
    with pytest.raises(ValueError, match="`max_workers` provided without any positive"):
        RayExecutor(settings, max_workers=3)
    with pytest.raises(ValueError, match=r"`max_workers` \(1\) < `min_workers` \(2\)"):
        RayExecutor(settings, min_workers=2, max_workers=1)
    with pytest.raises(ValueError, match="One of `num_workers`, `num_hosts`"):
        RayExecutor(settings)
    with pytest.raises(ValueError, match="Both `num_workers` and `num_hosts`"):
        RayExecutor(settings, num_workers=2, num_hosts=2)
    with pytest.raises(ValueError, match="use_gpu must be True if gpus_per_worker"):
        RayExecutor(settings, num_workers=2, gpus_per_worker=1)
    with pytest.raises(ValueError, match="gpus_per_worker must be >= 1"):
        RayExecutor(settings, num_workers=2, use_gpu=True, gpus_per_worker=0)
    with pytest.raises(ValueError, match="`num_workers` must be a positive integer"):
        RayExecutor(settings, num_workers=0)
    with pytest.raises(ValueError, match="timeout_s must be a number > 0"):
        RayExecutor.create_settings(timeout_s=0)
    elastic = RayExecutor(settings, min_workers=1, max_workers=2)
    with pytest.raises(RuntimeError, match="not started"):
        elastic.run(ray_bodies.identity)
    elastic.start()  # an elastic executor starts its workers in each run
    with pytest.raises(RuntimeError, match="already called"):
        elastic.start()
    with pytest.raises(RuntimeError, match="elastic RayExecutor .* runs its workers only"):
        elastic.run_remote(ray_bodies.identity)
    with pytest.raises(RuntimeError, match="elastic RayExecutor .* runs its workers only"):
        elastic.execute_single(lambda executable: None)
    elastic.shutdown()
    with pytest.raises(RuntimeError, match="not started"):
        RayExecutor(settings, num_workers=1).run(ray_bodies.identity)


def test_ranks_in_order_on_one_node(executor):
    ids = executor.run(ray_bodies.identity)
    assert [i["rank"] for i in ids] == list(range(SIZE))
    assert [i["local_rank"] for i in ids] == list(range(SIZE))
    assert all(i["size"] == SIZE and i["local_size"] == SIZE for i in ids), ids
    assert all(i["cross_rank"] == 0 and i["cross_size"] == 1 for i in ids), ids


def test_callbacks_get_every_report_of_every_rank(executor):
    got = []
    ranks = executor.run(ray_bodies.ranks_report, args=["a"], callbacks=[got.append])
    assert ranks == list(range(SIZE))
    assert sorted((g["rank"], g["i"]) for g in got) == \
        [(r, i) for r in range(SIZE) for i in range(2)], got
    assert all(g["value"] == "a" for g in got), got
    for rank in range(SIZE):  # each rank's reports in the order it sent them
        assert [g["i"] for g in got if g["rank"] == rank] == [0, 1], got
    # Without callbacks, reports go nowhere; a second run's callbacks get only its own.
    executor.run(ray_bodies.ranks_report, args=["b"])
    later = []
    executor.run(ray_bodies.ranks_report, args=["c"], callbacks=[later.append, len])
    assert sorted(g["value"] for g in later) == ["c"] * (2 * SIZE), later
    assert len(got) == 2 * SIZE


def test_reports_after_the_driver_queue_is_gone_are_dropped_not_fatal(executor):
    got = []
    results = executor.run(ray_bodies.reports_after_the_queue_dies, callbacks=[got.append])
    assert [rank for rank, _ in results] == list(range(SIZE))
    for rank, said in results:
        assert len(said) == 1 and "report queue is gone" in said[0], (rank, said)
    assert sorted(g["rank"] for g in got if g["i"] == 0) == list(range(SIZE)), got


def test_collectives_against_numpy(executor):
    results = executor.run(ray_bodies.collectives)
    vectors = [ray_bodies.rank_values(r)[0] for r in range(SIZE)]
    rows = np.concatenate([ray_bodies.rank_values(r)[1] for r in range(SIZE)])
    for rank, got in enumerate(results):
        np.testing.assert_allclose(got["sum"], np.sum(vectors, axis=0), rtol=1e-12,
                                   err_msg=f"rank {rank}")
        np.testing.assert_allclose(got["average"], np.mean(vectors, axis=0), rtol=1e-12)
        np.testing.assert_array_equal(got["gathered"], rows)
        np.testing.assert_array_equal(got["broadcast"], vectors[SIZE - 1])


def test_run_remote_returns_refs_in_rank_order(executor, ray_local):
    refs = executor.run_remote(ray_bodies.identity)
    assert len(refs) == SIZE and all(isinstance(r, ray_local.ObjectRef) for r in refs)
    assert [i["rank"] for i in ray_local.get(refs, timeout=60)] == list(range(SIZE))
    args_result = executor.run(lambda a, b=0: a * 10 + b, args=[4], kwargs={"b": 2})
    assert args_result == [42] * SIZE


def test_stateful_executable(executor):
    # Counter(10, step=5) on each rank: every call adds 5 to that rank's own state.
    first = executor.execute(lambda counter: counter.bump())
    second = executor.execute(lambda counter: counter.bump())
    assert first == [(r, 15) for r in range(SIZE)]
    assert second == [(r, 20) for r in range(SIZE)]
    assert executor.execute_single(lambda counter: counter.bump()) == (0, 25)
    # Only rank 0 moved.
    assert executor.execute(lambda counter: counter.value) == [25, 20, 20]


def test_torch_training_equals_one_process(executor):
    needs.import_or_skip("torch")
    got = executor.run(ray_bodies.train_distributed)
    want = ray_bodies.train_reference(SIZE)
    for rank, weights in enumerate(got):
        assert weights.keys() == want.keys()
        for name in want:
            np.testing.assert_allclose(weights[name], want[name], rtol=1e-5, atol=1e-6,
                                       err_msg=f"rank {rank} {name}")


def test_error_of_one_rank_reaches_the_driver(executor, ray_local):
    with pytest.raises(ray_local.exceptions.RayTaskError, match="rank 1 fails on purpose"):
        executor.run(ray_bodies.fail_on_rank, args=[1])
    # The world is still whole: a collective after the error works.
    assert [r["sum"].shape for r in executor.run(ray_bodies.collectives)] == [(5,)] * SIZE


def test_unsatisfiable_placement_group_is_a_clear_error(ray_local):
    from ray.util import placement_group_table

    from hvdlite.ray import RayExecutor

    before = {pg_id for pg_id, pg in placement_group_table().items()
              if pg["state"] != "REMOVED"}
    settings = RayExecutor.create_settings(placement_group_timeout_s=3)
    executor = RayExecutor(settings, num_workers=2, cpus_per_worker=50)
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=r"could not place the 2 worker\(s\) within 3 s"):
        executor.start()
    assert time.monotonic() - started < 15
    after = {pg_id for pg_id, pg in placement_group_table().items()
             if pg["state"] != "REMOVED"}
    assert after == before, "the executor's placement group was left behind"
    assert executor.workers == []


def test_node_without_hvdlite_core_is_named(ray_local):
    from hvdlite.ray import RayExecutor

    executor = RayExecutor(RayExecutor.create_settings(timeout_s=30, placement_group_timeout_s=20),
                           num_workers=2)
    with pytest.raises(RuntimeError, match=r"cannot run hvdlite ranks on node .*native core"):
        # Each worker's environment points the core's loader at a missing file.
        executor.start(extra_env_vars={"HVDLITE_LIBRARY": "/nonexistent/libhvdlite.so"})
    assert executor.workers == []


@pytest.mark.timeout(480)
def test_ray_train_backend_trains_and_reports(ray_local, tmp_path):
    """Rank 1 of the first worker group dies: Ray Train restarts the group (max_failures
    1), whose new world trains from the start and reports."""
    needs.import_or_skip("torch")
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

    from hvdlite.ray import HvdliteConfig
    from ray_support import fit_within

    size = 2
    trainer = DataParallelTrainer(
        ray_bodies.train_loop_per_worker,
        train_loop_config={"die_once": str(tmp_path / "died")},
        backend_config=HvdliteConfig(timeout_s=60),
        scaling_config=ScalingConfig(num_workers=size, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(storage_path=str(tmp_path), name="hvdlite-train",
                             failure_config=FailureConfig(max_failures=1)))
    # Two worker groups one after another: about 60 s here alone, 236 s once in CI
    # beside the other lane (the logs then say where it was).
    result = fit_within(trainer, 420)
    assert result.error is None, result.error
    assert (tmp_path / "died").exists(), "the first group's rank 1 did not die"
    assert result.metrics["step"] == ray_bodies.STEPS and result.metrics["size"] == size
    assert result.metrics["rank"] == result.metrics["world_rank"] == 0
    with result.checkpoint.as_directory() as directory:
        got = dict(np.load(f"{directory}/weights.npz"))
    want = ray_bodies.train_reference(size)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6, err_msg=name)


HUNG_RUN_BOUND_S = 45


@pytest.mark.timeout(180)
def test_a_hung_ray_train_run_fails_its_test_and_gives_its_cpus_back(ray_local, tmp_path):
    """fit_within's failure path: a run that hangs fails the test with Ray Train's logs,
    and its controller and workers are ended (their ranks' processes under mpiexec go
    with them), so the module's later tests find the cluster's CPUs free."""
    needs.import_or_skip("torch")
    from ray.train import RunConfig, ScalingConfig
    from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

    from hvdlite.ray import HvdliteConfig
    from ray_support import assert_all_gone, fit_within, rank_processes, train_run_processes

    free = ray_local.available_resources().get("CPU", 0)  # earlier tests may hold some
    before = set(rank_processes())
    trainer = DataParallelTrainer(
        ray_bodies.train_loop_that_hangs,
        backend_config=HvdliteConfig(timeout_s=60),
        scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(storage_path=str(tmp_path), name="hvdlite-hangs"))
    with pytest.raises(pytest.fail.Exception,
                       match=rf"(?s)has not returned within {HUNG_RUN_BOUND_S} s "
                             r"\(its run was ended: [1-9]"):
        fit_within(trainer, HUNG_RUN_BOUND_S)
    assert train_run_processes() == []  # end_train_run saw none for 3 s before it returned
    assert_all_gone(set(rank_processes()) - before, 30, "rank processes of the ended run")
    deadline = time.monotonic() + 30
    while ray_local.available_resources().get("CPU", 0) < free and time.monotonic() < deadline:
        time.sleep(0.5)
    assert ray_local.available_resources().get("CPU", 0) >= free, \
        (free, ray_local.available_resources())


def test_worker_dying_at_start_is_named_and_nothing_is_left(ray_local):
    from ray.util import placement_group_table

    from hvdlite.ray import RayExecutor
    from ray_support import assert_all_gone, rank_processes

    executor = RayExecutor(RayExecutor.create_settings(timeout_s=30), num_workers=2)
    before = set(rank_processes())
    with pytest.raises(RuntimeError,
                       match=r"the worker of rank 1 on \S+ \(\S+\) died while making its "
                             r"DiesOnRank1"):
        executor.start(executable_cls=ray_bodies.DiesOnRank1)
    assert executor.workers == []
    assert all(pg["state"] == "REMOVED" for pg in placement_group_table().values()
               if pg["strategy"] == "PACK" and len(pg["bundles"]) == 2), \
        "the executor's placement group was left behind"
    assert_all_gone(set(rank_processes()) - before, 15, "rank processes of the failed start")


def test_example_ray_digits_learns(ray_local, capsys):
    needs.import_or_skip("torch")
    needs.import_or_skip("sklearn")
    import sys

    from ray_support import REPO_ROOT

    sys.path.insert(0, f"{REPO_ROOT}/examples")
    try:
        import ray_digits
    finally:
        sys.path.pop(0)
    loss, accuracy = ray_digits.main(["--num-workers", "2", "--epochs", "3"])
    out = capsys.readouterr().out
    assert "training on 2 rank(s)" in out and "epoch 3:" in out, out
    # Chance is a loss of 2.3 (ln 10) and an accuracy of 0.1.
    assert accuracy > 0.8 and loss < 1.0, (loss, accuracy, out)


def test_worker_lost_while_running_fails_the_survivors(ray_local):
    from hvdlite.ray import RayExecutor
    from ray_support import assert_all_gone, rank_processes

    executor = RayExecutor(RayExecutor.create_settings(timeout_s=30), num_workers=2)
    before = set(rank_processes())
    executor.start()
    try:
        refs = executor.run_remote(ray_bodies.lose_rank_1)
        with pytest.raises(ray_local.exceptions.RayActorError):
            ray_local.get(refs[1], timeout=60)
        # The launcher tells the survivor, whose wait raises instead of hanging.
        outcome = ray_local.get(refs[0], timeout=60)
        assert outcome.startswith("RankFailedError") and "rank 1" in outcome, outcome
    finally:
        executor.shutdown()
    assert executor.workers == []
    assert_all_gone(set(rank_processes()) - before, 15, "rank processes of the lost job")


def test_runs_inside_the_current_placement_group(ray_local):
    from ray.util import placement_group_table
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    group = placement_group([{"CPU": 1}, {"CPU": 1}], strategy="PACK")
    ray_local.get(group.ready(), timeout=60)
    try:
        task = ray_local.remote(num_cpus=0)(ray_bodies.executor_in_current_placement_group)
        ranks, sizes, used = ray_local.get(task.options(
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=group, placement_group_capture_child_tasks=True)).remote(),
            timeout=120)
        assert ranks == [0, 1] and sizes == [2, 2] and used
        # The group is the caller's: the executor's shutdown leaves it.
        assert placement_group_table(group)["state"] == "CREATED"
    finally:
        remove_placement_group(group)


def test_elastic_below_min_workers_ends_with_the_reason(executor):
    """The module's executor holds 3 of the 6 CPUs: an elastic job needing 4 workers
    waits elastic_timeout for them, then run() raises saying so, starting no world."""
    from hvdlite.ray import RayExecutor

    elastic = RayExecutor(RayExecutor.create_settings(timeout_s=30), min_workers=4,
                          max_workers=6, cpus_per_worker=1, elastic_timeout=2)
    elastic.start()
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"only 3 usable slot\(s\) .*fewer than "
                                           r"min_workers 4, for 2 s \(elastic_timeout\)"):
        elastic.run(ray_bodies.identity)
    assert time.monotonic() - started < 30
    assert elastic.last_worlds == []
    elastic.shutdown()


def test_elastic_execute_makes_the_executable_and_trains_in_rank_order(executor):
    """One elastic world on the 3 CPUs the module's executor leaves free: the executable
    is made on every rank, execute's results come in rank order, and the (framework-
    free) elastic job's weights equal numpy's replay."""
    from hvdlite.ray import RayExecutor

    elastic = RayExecutor(RayExecutor.create_settings(timeout_s=60), min_workers=2,
                          max_workers=2, cpus_per_worker=1, elastic_timeout=30)
    elastic.start(executable_cls=ray_bodies.Counter, executable_args=[10],
                  executable_kwargs={"step": 5})
    try:
        results = elastic.execute(ray_bodies.bump_and_train)
    finally:
        elastic.shutdown()
    assert elastic.last_worlds == [2]
    assert [bumped for bumped, _ in results] == [(0, 15), (1, 15)], results
    trained = [r for _, r in results]
    assert [r["rank"] for r in trained] == [0, 1] and all(r["size"] == 2 for r in trained)
    history = [tuple(h) for h in trained[0]["history"]]
    assert history == [(0, 2), (1, 2), (2, 2)]
    for r in trained:
        np.testing.assert_allclose(r["w"], ray_bodies.elastic_reference(history),
                                   rtol=1e-12)


@pytest.mark.parametrize("body, message", [
    (ray_bodies.fail_on_rank, "rank 1 fails on purpose"),
    # Ray's error for fn's own call to a dead actor is also a RayActorError: still fn's.
    (ray_bodies.call_a_dead_actor_on_rank, "ActorDiedError|actor died|dead actor")],
    ids=["exception", "dead_actor_inside_fn"])
def test_elastic_run_raises_the_functions_error_and_ends(executor, body, message):
    """An exception of fn (not a lost peer) ends the elastic job at once: run() raises
    it with the worker's traceback, no second world is tried."""
    import ray
    from hvdlite.ray import RayExecutor

    elastic = RayExecutor(RayExecutor.create_settings(timeout_s=60), min_workers=2,
                          max_workers=2, cpus_per_worker=1, elastic_timeout=30)
    elastic.start()
    try:
        with pytest.raises(ray.exceptions.RayTaskError, match=message):
            elastic.run(body, args=[1])
    finally:
        elastic.shutdown()
    assert elastic.last_worlds == [2]


def test_elastic_slots_follow_free_resources_and_held_workers(monkeypatch):
    """The discovery's arithmetic, on Ray's answers as given: free CPUs (and GPUs)
    divided by what a worker takes, plus this job's workers there; dead nodes out."""
    needs.import_or_skip("ray")
    from hvdlite.ray import elastic

    nodes = [{"NodeID": "a", "NodeManagerAddress": "10.0.0.1", "Alive": True},
             {"NodeID": "b", "NodeManagerAddress": "10.0.0.2", "Alive": True},
             {"NodeID": "c", "NodeManagerAddress": "10.0.0.3", "Alive": False},
             {"NodeID": "d", "NodeManagerAddress": "10.0.0.4", "Alive": True}]
    free = {"a": {"CPU": 5.0, "GPU": 1.0}, "b": {"CPU": 1.0}, "c": {"CPU": 8.0},
            "d": {"CPU": 4.0, "GPU": 4.0}}
    monkeypatch.setattr(elastic.ray, "nodes", lambda: nodes)
    monkeypatch.setattr(elastic, "_free_resources", lambda alive: free)
    cpu_only = elastic.RayNodes(cpus_per_worker=2, gpus_per_worker=0)
    assert cpu_only.slots() == [("10.0.0.1", 2), ("10.0.0.4", 2)]
    cpu_only.hold("b", 1)  # b's CPU is this job's worker: b still offers it
    cpu_only.hold("a", 2)
    assert cpu_only.slots() == [("10.0.0.1", 4), ("10.0.0.2", 1), ("10.0.0.4", 2)]
    assert cpu_only.node_id("10.0.0.2") == "b" and cpu_only.node_id("10.0.0.3") is None
    cpu_only.release_all()
    with_gpus = elastic.RayNodes(cpus_per_worker=1, gpus_per_worker=2)
    assert with_gpus.slots() == [("10.0.0.4", 2)]
