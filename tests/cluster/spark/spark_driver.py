"""The driver of tests/cluster/test_cluster_spark.py, run inside the master's host.

    spark_driver.py MASTER_URL DRIVER_ADDRESS SLOTS

Connects to the standalone master, waits for SLOTS task slots, then runs through
hvdlite.spark.run: an allreduce across the workers' hosts (every rank reports its
host, its task and its sums), and a function that raises on one rank. Prints one line
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
