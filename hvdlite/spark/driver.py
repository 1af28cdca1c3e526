"""hvdlite.spark.run: a function on every task of a Spark barrier stage, as one world.

The steps, in the driver:

1. wait (up to start_timeout) until the cluster has ``num_proc`` task slots: a barrier
   stage needs all its tasks at once, and Spark itself would retry its slot check for
   minutes before failing;
2. start a DriverService and submit a barrier stage of ``num_proc`` tasks; each starts
   a TaskService and registers with the driver (index, host, address);
3. place the ranks: hosts in the order of their first task, each with as many slots as
   it has tasks; rank r is the r-th slot, and its task the matching task of that host;
4. run hvdliterun (``python -m hvdlite.runner``, the launcher users run) on the driver
   with those hosts and, as its remote shell, task_shell.py: where hvdliterun would ssh
   to a host it reaches the TaskService of that host's first task, which runs the
   command (mpiexec's proxy) inside the task. Every rank then fetches the function from
   the driver, runs it and sends back its result; hvdliterun's tagged output goes to
   ``stdout``/``stderr``, and a failing rank ends the job through hvdliterun;
5. end the tasks (the stage completes) and return the results in rank order, or raise
   SparkJobError naming the failed rank, its task and host, with its traceback.
"""
import json
import logging
import os
import secrets
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, TextIO

from pyspark import InheritableThread, SparkContext, cloudpickle

import hvdlite
from hvdlite.runner.supervisor import describe_returncode
from hvdlite.spark import rank as rank_module
from hvdlite.spark import task_shell
from hvdlite.spark.service import DriverService, TaskInfo
from hvdlite.spark.task import barrier_task

logger = logging.getLogger("hvdlite")

START_TIMEOUT_ENV = "HVDLITE_SPARK_START_TIMEOUT"
DEFAULT_START_TIMEOUT_S = 600.0
_TASK_SHELL_PATH = os.path.abspath(task_shell.__file__)
_PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(hvdlite.__file__)))
# After hvdliterun is told to end (SIGTERM), how long before SIGKILL: it ends its ranks.
_LAUNCHER_TERM_GRACE_S = 20.0
# How long the barrier stage gets to finish once its tasks are told the job is over.
_STAGE_END_S = 60.0


class SparkJobError(RuntimeError):
    """hvdlite.spark.run failed: too few task slots, a rank or a task failed.

    Attributes:
        rank: the rank that failed, if one did.
        task_index: its Spark task (the barrier stage's partition), if known.
        host: the host it ran on, if known.
    """

    def __init__(self, message: str, rank: Optional[int] = None,
                 task_index: Optional[int] = None, host: Optional[str] = None):
        super().__init__(message)
        self.rank = rank
        self.task_index = task_index
        self.host = host


@dataclass
class Placement:
    """Where each rank runs: hosts in the order of their first task.

    Attributes:
        hosts: (address, slots) per host, for hvdliterun's -H.
        rank_tasks: the task that holds each rank's slot, by rank.
        starters: address -> (address, port) of the TaskService that starts the
            host's processes (its first task's).
    """

    hosts: List[tuple]
    rank_tasks: List[TaskInfo]
    starters: Dict[str, tuple]

    @classmethod
    def of(cls, tasks: Sequence[TaskInfo]) -> "Placement":
        by_host: Dict[str, List[TaskInfo]] = {}
        for task in sorted(tasks, key=lambda t: t.index):
            by_host.setdefault(task.hostname, []).append(task)
        hosts, rank_tasks, starters = [], [], {}
        for group in by_host.values():
            address = group[0].address
            hosts.append((address, len(group)))
            rank_tasks.extend(group)
            starters[address] = (address, group[0].service_port)
        return cls(hosts, rank_tasks, starters)

    def host_list(self) -> str:
        return ",".join((f"[{a}]" if ":" in a else a) + f":{n}" for a, n in self.hosts)


class _BarrierStage:
    """The Spark job of one run: ``num_proc`` barrier tasks, collected on a thread."""

    def __init__(self, sc: SparkContext, num_proc: int, driver_address, key: bytes):
        self.sc = sc
        self.group = f"hvdlite-spark-{secrets.token_hex(6)}"
        self.error: Optional[BaseException] = None
        self.tasks: Optional[list] = None
        rdd = sc.parallelize(range(num_proc), num_proc).barrier().mapPartitions(
            barrier_task(driver_address, key))
        self.thread = InheritableThread(target=self._collect, args=(rdd,), daemon=True)

    def _collect(self, rdd):
        self.sc.setJobGroup(self.group, "hvdlite.spark.run", interruptOnCancel=True)
        try:
            self.tasks = rdd.collect()
        except BaseException as exc:   # noqa: B902 -- reported by run()
            self.error = exc

    def start(self):
        self.thread.start()

    def failed(self) -> bool:
        return self.error is not None

    def cancel(self):
        self.sc.cancelJobGroup(self.group)

    def join(self, timeout: float) -> bool:
        self.thread.join(timeout)
        return not self.thread.is_alive()


def task_slots(sc: SparkContext) -> Optional[int]:
    """How many tasks the cluster can run at once now (executors' cores over
    spark.task.cpus), or None where this Spark does not say."""
    try:
        jsc = sc._jsc.sc()   # noqa: SLF001 -- the JVM SparkContext; no public call says it
        profile = jsc.resourceProfileManager().defaultResourceProfile()
        return int(jsc.maxNumConcurrentTasks(profile))
    except Exception:   # noqa: BLE001 -- an older or newer Spark: skip the check
        return None


def _wait_for_slots(sc: SparkContext, num_proc: int, deadline: float, start_timeout: float):
    """Waits for the executors to offer ``num_proc`` slots; raises SparkJobError when
    they do not by the deadline (executors register a while after the context starts)."""
    slots = task_slots(sc)
    while slots is not None and slots < num_proc:
        if time.monotonic() >= deadline:
            raise SparkJobError(
                f"hvdlite.spark.run: num_proc={num_proc} needs {num_proc} Spark task slots "
                f"at once (a barrier stage), but the cluster has {slots} (executor cores "
                f"over spark.task.cpus; default parallelism {sc.defaultParallelism}) after "
                f"waiting {start_timeout:g} s (start_timeout)")
        time.sleep(0.5)
        slots = task_slots(sc)


def _relay(pipe, stream: TextIO, lines: Optional[List[str]] = None):
    """Copies hvdliterun's output to ``stream`` line by line; keeps hvdliterun's own
    (untagged) lines in ``lines``."""
    with pipe:
        for raw in iter(pipe.readline, b""):
            line = raw.decode("utf-8", "replace")
            if lines is not None and line.startswith("hvdliterun:"):
                lines.append(line.rstrip("\n"))
            try:
                stream.write(line)
                stream.flush()
            except (OSError, ValueError):
                pass


def _launcher_argv(placement: Placement, num_proc: int, tasks_file: str,
                   start_timeout: float, extra_mpi_args: Optional[str], verbose: int,
                   nics) -> List[str]:
    python = sys.executable
    shell = shlex.join([python, "-I", _TASK_SHELL_PATH, "--tasks", tasks_file]) + " {host}"
    argv = [python, "-m", "hvdlite.runner", "-np", str(num_proc),
            "-H", placement.host_list(), "--remote-shell", shell,
            "--start-timeout", f"{max(start_timeout, 1.0):g}"]
    if verbose >= 2:
        argv.append("--verbose")
    if nics:
        argv += ["--network-interface", ",".join(nics) if not isinstance(nics, str) else nics]
    if extra_mpi_args:
        argv += ["--mpi-args", extra_mpi_args]
    return argv + [python, "-m", "hvdlite.spark"]


def _launcher_env(env: Optional[Dict[str, str]], service: DriverService, driver_host: str,
                  key: bytes, placement: Placement) -> Dict[str, str]:
    result = dict(os.environ if env is None else env)
    # The ranks import the hvdlite this driver runs (the same path on every host).
    paths = [_PACKAGE_PARENT] + [p for p in result.get("PYTHONPATH", "").split(os.pathsep) if p]
    result["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    result[rank_module.DRIVER_ENV] = f"{driver_host}:{service.port}"
    result[rank_module.KEY_ENV] = key.hex()
    result[task_shell.KEY_ENV] = key.hex()
    result[rank_module.RANK_TASKS_ENV] = ",".join(f"{t.index}:{t.pid}"
                                                  for t in placement.rank_tasks)
    return result


def run(fn, args=(), kwargs=None, num_proc: Optional[int] = None,
        start_timeout: Optional[float] = None, extra_mpi_args: Optional[str] = None,
        env: Optional[Dict[str, str]] = None, stdout: Optional[TextIO] = None,
        stderr: Optional[TextIO] = None, verbose: int = 1, nics=None) -> List[Any]:
    """Runs ``fn(*args, **kwargs)`` on ``num_proc`` ranks, each one task of a Spark
    barrier stage, as one hvdlite world (``fn`` calls ``hvd.init()`` as usual).

    Args:
        fn: the function every rank runs (pickled with cloudpickle).
        args, kwargs: its arguments.
        num_proc: how many ranks; default: the SparkContext's default parallelism.
        start_timeout: seconds for the slots, the tasks and the ranks to start; default
            HVDLITE_SPARK_START_TIMEOUT, else 600.
        extra_mpi_args: more mpiexec arguments (hvdliterun's --mpi-args).
        env: the ranks' environment (default: the driver's).
        stdout, stderr: where the ranks' tagged output goes (default: sys.stdout and
            sys.stderr).
        verbose: 0 quiet, 1 the placement at INFO, 2 also hosts in the output tags.
        nics: network interface names for MPI (hvdliterun's --network-interface).

    Returns:
        The value ``fn`` returned on each rank, in rank order.

    Raises:
        SparkJobError: the cluster has fewer task slots than ``num_proc`` or the tasks
            did not start within ``start_timeout``, a rank raised (its traceback is in
            the message) or ended, or a Spark task failed.
    """
    sc = SparkContext._active_spark_context   # noqa: SLF001 -- no public accessor
    if sc is None:
        raise SparkJobError("hvdlite.spark.run needs a running SparkContext "
                            "(SparkSession.builder.getOrCreate() first)")
    num_proc = int(num_proc or sc.defaultParallelism)
    if num_proc < 1:
        raise ValueError(f"num_proc must be at least 1, got {num_proc}")
    if start_timeout is None:
        start_timeout = float(os.environ.get(START_TIMEOUT_ENV, DEFAULT_START_TIMEOUT_S))
    deadline = time.monotonic() + start_timeout
    _wait_for_slots(sc, num_proc, deadline, start_timeout)

    key = secrets.token_bytes(32)
    payload = cloudpickle.dumps((fn, tuple(args), dict(kwargs or {})))
    driver_host = sc.getConf().get("spark.driver.host") or "127.0.0.1"
    with DriverService(key, payload) as service:
        stage = _BarrierStage(sc, num_proc, (driver_host, service.port), key)
        stage.start()
        try:
            tasks = service.wait_for_tasks(num_proc, deadline, stage.failed)
            if tasks is None:
                stage.cancel()
                if service.lost is not None:
                    raise _lost_task_error(service.lost, None, stage)
                if stage.error is not None:
                    raise SparkJobError(f"hvdlite.spark.run: the barrier stage failed before "
                                        f"its tasks started: {stage.error}")
                raise SparkJobError(
                    f"hvdlite.spark.run: only {service.registered()} of num_proc={num_proc} "
                    f"Spark tasks started within start_timeout={start_timeout:g} s (the "
                    f"cluster has {task_slots(sc)} task slots)")
            placement = Placement.of(tasks)
            if verbose:
                logger.info("hvdlite.spark.run: %d ranks on %s (rank -> task %s)", num_proc,
                            placement.host_list(), [t.index for t in placement.rank_tasks])
            launch = _Launch(service, placement, num_proc, deadline, extra_mpi_args, verbose, nics,
                             _launcher_env(env, service, driver_host, key, placement))
            returncode, launcher_lines = launch.run(stdout or sys.stdout, stderr or sys.stderr,
                                                    stage)
        except BaseException:
            stage.cancel()
            raise
        finally:
            logger.debug("hvdlite.spark.run: ending the tasks")
            service.end_tasks()
        if not stage.join(_STAGE_END_S):
            stage.cancel()
        with service.cond:
            results = dict(service.results)
            lost = service.lost
    return _outcome(results, placement, num_proc, returncode, launcher_lines, stage, lost)


class _Launch:
    """hvdliterun, run on the driver for one placement."""

    def __init__(self, service, placement, num_proc, deadline, extra_mpi_args, verbose, nics,
                 env):
        self.service = service
        self.placement = placement
        self.num_proc = num_proc
        self.deadline = deadline
        self.extra_mpi_args = extra_mpi_args
        self.verbose = verbose
        self.nics = nics
        self.env = env

    def run(self, stdout: TextIO, stderr: TextIO, stage: _BarrierStage):
        """Runs hvdliterun to its end, ending it early when the stage fails.

        Returns:
            (hvdliterun's exit status, its own stderr lines).
        """
        launcher_lines: List[str] = []
        with tempfile.TemporaryDirectory(prefix="hvdlite-spark-") as tmpdir:
            tasks_file = os.path.join(tmpdir, "tasks.json")
            with open(tasks_file, "w", encoding="utf-8") as f:
                json.dump(self.placement.starters, f)
            argv = _launcher_argv(self.placement, self.num_proc, tasks_file,
                                  self.deadline - time.monotonic(), self.extra_mpi_args,
                                  self.verbose, self.nics)
            logger.debug("hvdlite.spark.run: %s", shlex.join(argv))
            proc = subprocess.Popen(argv, env=self.env, stdin=subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    start_new_session=True)
            relays = [threading.Thread(target=_relay, args=(proc.stdout, stdout), daemon=True),
                      threading.Thread(target=_relay, args=(proc.stderr, stderr, launcher_lines),
                                       daemon=True)]
            for relay in relays:
                relay.start()
            try:
                while True:
                    try:
                        proc.wait(1.0)
                        break
                    except subprocess.TimeoutExpired:
                        if stage.failed() or self.service.lost is not None:
                            _end(proc)
            finally:
                _end(proc)
                for relay in relays:
                    relay.join(10.0)
        logger.debug("hvdlite.spark.run: hvdliterun exited with %s", proc.returncode)
        return proc.returncode, launcher_lines


def _end(proc: subprocess.Popen):
    """Ends hvdliterun (SIGTERM: it ends its ranks), SIGKILL to its group if it lingers."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(_LAUNCHER_TERM_GRACE_S)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, 9)
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait()


def _lost_task_error(task: TaskInfo, placement: Optional[Placement],
                     stage: _BarrierStage) -> SparkJobError:
    ranks = [r for r, t in enumerate(placement.rank_tasks) if t.index == task.index] \
        if placement else []
    holding = f", which held the slot of rank {ranks[0]}," if ranks else ""
    spark = f": {stage.error}" if stage.error is not None else ""
    return SparkJobError(f"hvdlite.spark.run: Spark task {task.index} on host {task.hostname}"
                         f"{holding} ended before the job did (its executor or Python worker "
                         f"failed){spark}", rank=ranks[0] if ranks else None,
                         task_index=task.index, host=task.hostname)


def _outcome(results, placement: Placement, num_proc: int, returncode: int,
             launcher_lines: List[str], stage: _BarrierStage,
             lost: Optional[TaskInfo]) -> List[Any]:
    """The results in rank order, or SparkJobError for the first failure."""
    for rank in sorted(results):
        ok, value = results[rank]
        if not ok:
            task = placement.rank_tasks[rank]
            raise SparkJobError(f"hvdlite.spark.run: rank {rank} (Spark task {task.index} on "
                                f"host {task.hostname}) failed:\n{value}",
                                rank=rank, task_index=task.index, host=task.hostname)
    missing = [r for r in range(num_proc) if r not in results]
    if lost is not None and missing:
        raise _lost_task_error(lost, placement, stage)
    if stage.error is not None and missing:
        raise SparkJobError(f"hvdlite.spark.run: the barrier stage failed while ranks "
                            f"{missing} ran: {stage.error}")
    if returncode != 0 or missing:
        said = "; ".join(launcher_lines) or "no message"
        first = missing[0] if missing else None
        task = placement.rank_tasks[first] if first is not None else None
        raise SparkJobError(
            f"hvdlite.spark.run: hvdliterun {describe_returncode(returncode)}, ranks "
            f"{missing} returned nothing ({said})", rank=first,
            task_index=task.index if task else None, host=task.hostname if task else None)
    return [cloudpickle.loads(results[rank][1]) for rank in range(num_proc)]
