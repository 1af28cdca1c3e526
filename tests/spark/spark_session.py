"""A Spark context for a test module, and the checks the Spark tests share.

``local_cluster_context`` starts Spark's ``local-cluster`` mode (a master, workers and
executors as separate JVMs on this machine: the barrier stage, its tasks and the
executors' Python workers are real); ``stop_spark`` stops the context and the py4j
gateway's JVM, so no JVM outlives its module, even after a failure.
"""
import os
import shutil
import time

import needs

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def java_missing():
    """Why Spark cannot start here, or None."""
    if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        return "no java on PATH and no JAVA_HOME (Spark needs Java 17 or 21)"
    return None


def require_spark():
    """Imports pyspark, or skips (fails where CI requires the spark area)."""
    pyspark = needs.import_or_skip("pyspark", "spark")
    reason = java_missing()
    if reason:
        needs.need("spark", reason)
    return pyspark


def local_cluster_context(workers=2, cores=2, memory_mb=1024, app="hvdlite-spark-tests"):
    """A SparkContext on ``local-cluster[workers,cores,memory_mb]``, executors of 512m,
    whose Python workers import this tree's hvdlite."""
    from pyspark import SparkConf, SparkContext

    conf = (SparkConf().setMaster(f"local-cluster[{workers},{cores},{memory_mb}]")
            .setAppName(app)
            .set("spark.executor.memory", "512m")
            .set("spark.driver.memory", "512m")
            .set("spark.ui.enabled", "false")
            .set("spark.ui.showConsoleProgress", "false")
            .set("spark.executorEnv.PYTHONPATH", REPO_ROOT)
            .set("spark.executorEnv.OMP_NUM_THREADS", "1"))
    sc = SparkContext(conf=conf)
    sc.setLogLevel("ERROR")
    return sc


def wait_for_executors(sc, slots, timeout_s=90.0):
    """Waits until the executors offer ``slots`` task slots (they register a few
    seconds after the context starts; until then defaultParallelism is smaller)."""
    from hvdlite.spark.driver import task_slots

    deadline = time.monotonic() + timeout_s
    while task_slots(sc) != slots:
        if time.monotonic() > deadline:
            raise AssertionError(f"the executors offer {task_slots(sc)} task slots after "
                                 f"{timeout_s:g} s, expected {slots}")
        time.sleep(0.5)


def stop_spark(sc):
    """Stops ``sc`` and the gateway JVM pyspark started (the next module starts anew)."""
    from pyspark import SparkContext

    gateway = SparkContext._gateway   # noqa: SLF001
    proc = getattr(gateway, "proc", None)
    try:
        if sc is not None:
            sc.stop()
    finally:
        if gateway is not None:
            try:
                gateway.shutdown()
            except Exception:   # noqa: BLE001 -- the JVM may be gone already
                pass
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(20)
            except Exception:   # noqa: BLE001
                proc.kill()
                proc.wait()
        SparkContext._gateway = None   # noqa: SLF001
        SparkContext._jvm = None       # noqa: SLF001


def processes_with(mark):
    """Pids of live processes whose environment holds ``mark`` (the ranks, hvdliterun,
    mpiexec and its proxies all inherit the environment hvdlite.spark.run gives them)."""
    needle = mark.encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle in f.read():
                    with open(f"/proc/{entry}/stat", "rb") as f:
                        if f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X"):
                            found.append(int(entry))
        except OSError:
            continue
    return found


def assert_none_left(mark, grace_s=10.0):
    """Fails, naming them, when processes of the job marked ``mark`` outlive grace_s."""
    deadline = time.monotonic() + grace_s
    while True:
        left = processes_with(mark)
        if not left:
            return
        if time.monotonic() > deadline:
            lines = []
            for pid in left:
                try:
                    with open(f"/proc/{pid}/cmdline", "rb") as f:
                        words = f.read().split(b"\0")
                    lines.append(f"{pid}: {b' '.join(words).decode(errors='replace')}")
                except OSError:
                    pass
            raise AssertionError("processes of the job left behind:\n" + "\n".join(lines))
        time.sleep(0.5)
