"""A rank of hvdlite.spark.run (``python -m hvdlite.spark`` under hvdliterun).

Fetches the pickled ``(fn, args, kwargs)`` from the driver, runs it and sends back its
return value, or the traceback of what it raised (the rank then exits with code 1 at
once, which ends the job through hvdliterun). Where the driver is and which task holds
each rank's slot come in the environment the driver gives hvdliterun.
"""
import os
import sys
import traceback
from multiprocessing.connection import Client

from pyspark import cloudpickle

DRIVER_ENV = "HVDLITE_SPARK_DRIVER"          # host:port of the DriverService
KEY_ENV = "HVDLITE_SPARK_KEY"                # the job's key, hex
RANK_TASKS_ENV = "HVDLITE_SPARK_RANK_TASKS"  # each rank's task "index:pid", comma separated
TASK_INDEX_ENV = "HVDLITE_SPARK_TASK_INDEX"  # set for fn: the task that holds this rank
TASK_PID_ENV = "HVDLITE_SPARK_TASK_PID"      # set for fn: that task's Python worker


def _call(message, receive_bytes=False):
    host, _, port = os.environ[DRIVER_ENV].rpartition(":")
    with Client((host, int(port)), authkey=bytes.fromhex(os.environ[KEY_ENV])) as conn:
        conn.send(message)
        return conn.recv_bytes() if receive_bytes else conn.recv()


def main() -> int:
    """Runs this rank's call; returns the exit code."""
    rank = int(os.environ["HVDLITE_RANK"])
    index, pid = os.environ[RANK_TASKS_ENV].split(",")[rank].split(":")
    os.environ[TASK_INDEX_ENV], os.environ[TASK_PID_ENV] = index, pid
    fn, args, kwargs = cloudpickle.loads(_call(("fn",), receive_bytes=True))
    try:
        value = cloudpickle.dumps(fn(*args, **kwargs))
    except BaseException:   # noqa: B902 -- whatever fn raised is the job's error
        text = traceback.format_exc()
        sys.stderr.write(text)
        sys.stderr.flush()
        _call(("result", rank, False, text))
        sys.stdout.flush()
        # Now, not at interpreter exit: hvdlite's shutdown there would wait for every
        # other rank to shut down too, while they wait in their collectives for this
        # one. Exiting ends the job through hvdliterun at once.
        os._exit(1)
    _call(("result", rank, True, value))
    return 0
