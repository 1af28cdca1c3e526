"""What each task of the barrier stage runs: a TaskService, registered with the driver.

The task holds its slot (a core of an executor) for its rank while the job runs.
hvdliterun starts the ranks of a host through the TaskService of that host's first task
(see driver.py), so each rank runs on the host of its task; the task returns when the
driver ends the job, or when the driver's connection drops.
"""
import os
import socket
from multiprocessing.connection import Client
from typing import Iterator, Tuple

from hvdlite.spark.service import TaskService


def barrier_task(driver_address: Tuple[str, int], key: bytes):
    """The mapPartitions function of the barrier stage.

    Args:
        driver_address: the DriverService's (host, port).
        key: the job's key.

    Returns:
        A function of a partition's iterator that yields ``(task index, host name)``.
    """
    def run_task(_: Iterator) -> Iterator[Tuple[int, str]]:
        from pyspark import BarrierTaskContext

        index = BarrierTaskContext.get().partitionId()
        hostname = socket.gethostname()
        service = TaskService(key)
        try:
            with Client(driver_address, authkey=key) as conn:
                conn.send(("register", index, hostname, service.port, os.getpid()))
                try:
                    conn.recv()   # ("end",): the job is over
                except (EOFError, OSError):
                    pass          # the driver is gone: end what runs here all the same
        finally:
            service.close()
        yield index, hostname

    return run_task
