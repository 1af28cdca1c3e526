"""The two small servers of a Spark job.

* DriverService, in the driver: each barrier task registers with it (its index, host
  and the port of its TaskService) and holds the connection open until the driver ends
  the job; each rank fetches the pickled function from it and sends back its result.
* TaskService, in each Spark task: runs the commands task_shell.py brings (hvdliterun's
  mpiexec starting its processes on that host) and streams their output back.

Both are multiprocessing.connection listeners: every connection proves it knows the
job's random key (an HMAC challenge) before a message is read, and messages are
pickled tuples.
"""
import logging
import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import AuthenticationError, Client, Connection, Listener
from typing import Callable, Dict, List, Optional, Tuple

logger = logging.getLogger("hvdlite")

# After SIGTERM to a command's process group, how long before SIGKILL.
KILL_GRACE_S = 5.0
_READ_SIZE = 65536


def _accept_loop(listener: Listener, closed: threading.Event,
                 serve: Callable[[Connection, Tuple], None]):
    """Accepts connections until ``closed``; each is served on a thread of its own."""
    while not closed.is_set():
        try:
            conn = listener.accept()
        except (AuthenticationError, OSError, EOFError):
            continue   # a caller without the key, or the listener closing
        if closed.is_set():
            conn.close()
            return
        peer = listener.last_accepted
        threading.Thread(target=serve, args=(conn, peer), daemon=True,
                         name="hvdlite-spark-conn").start()


def _wake(port: int, key: bytes):
    """Unblocks a listener's accept() on ``port`` (closing its socket alone does not)."""
    try:
        Client(("127.0.0.1", port), authkey=key).close()
    except (OSError, EOFError, AuthenticationError):
        pass


@dataclass
class TaskInfo:
    """One barrier task, as it registered with the driver."""

    index: int
    hostname: str
    address: str        # the task's address as the driver saw its connection
    service_port: int   # its TaskService
    pid: int            # the task's Python worker
    conn: Connection


class DriverService:
    """The driver's server: task registration, the function for the ranks, their results.

    Args:
        key: the job's key.
        payload: the pickled ``(fn, args, kwargs)`` every rank fetches.
    """

    def __init__(self, key: bytes, payload: bytes):
        self.key = key
        self.payload = payload
        self.listener = Listener(("0.0.0.0", 0), authkey=key)
        self.port = self.listener.address[1]
        self.tasks: Dict[int, TaskInfo] = {}        # Guarded by cond.
        self.results: Dict[int, Tuple[bool, object]] = {}   # rank -> (ok, value); cond.
        self.lost: Optional[TaskInfo] = None   # the first task that ended early; cond.
        self.ending = False                    # end_tasks() was called; cond.
        self.cond = threading.Condition()
        self.closed = threading.Event()
        self.thread = threading.Thread(
            target=_accept_loop, args=(self.listener, self.closed, self._serve),
            daemon=True, name="hvdlite-spark-driver")
        self.thread.start()

    def _serve(self, conn: Connection, peer):
        try:
            message = conn.recv()
        except (EOFError, OSError):
            conn.close()
            return
        kind = message[0]
        if kind == "register":
            _, index, hostname, service_port, pid = message
            task = TaskInfo(index, hostname, peer[0], service_port, pid, conn)
            with self.cond:
                self.tasks[index] = task
                self.cond.notify_all()
            self._watch(task)   # the connection stays open: end_tasks() answers it
            return
        try:
            if kind == "fn":
                conn.send_bytes(self.payload)
            elif kind == "result":
                _, rank, ok, value = message
                with self.cond:
                    self.results[rank] = (ok, value)
                    self.cond.notify_all()
                conn.send("ok")
        except (EOFError, OSError):
            pass
        finally:
            conn.close()

    def _watch(self, task: TaskInfo):
        """Waits for the task's side to close: after end_tasks(), or because the task
        ended early (its executor or Python worker failed), which is recorded."""
        try:
            task.conn.recv()
        except (EOFError, OSError):
            pass
        task.conn.close()
        with self.cond:
            if not self.ending and self.lost is None:
                self.lost = task
                logger.debug("hvdlite.spark: task %d on %s ended early", task.index,
                             task.hostname)
            self.cond.notify_all()

    def wait_for_tasks(self, count: int, deadline: float,
                       give_up: Callable[[], bool]) -> Optional[List[TaskInfo]]:
        """Waits until ``count`` tasks registered, the monotonic ``deadline`` passed, a
        task ended early or ``give_up()`` says so (checked each second).

        Returns:
            The tasks by index, or None when they did not all come.
        """
        with self.cond:
            while len(self.tasks) < count:
                left = deadline - time.monotonic()
                if left <= 0 or self.lost is not None or give_up():
                    return None
                self.cond.wait(min(left, 1.0))
            return [self.tasks[i] for i in sorted(self.tasks)]

    def registered(self) -> int:
        """How many tasks registered so far."""
        with self.cond:
            return len(self.tasks)

    def end_tasks(self):
        """Tells every registered task that the job is over (each then returns)."""
        with self.cond:
            self.ending = True
            tasks = list(self.tasks.values())
        for task in tasks:
            try:
                task.conn.send(("end",))
            except (EOFError, OSError):
                pass   # its watch thread closes the connection when the task hangs up

    def close(self):
        """Ends the tasks and stops serving (idempotent)."""
        self.end_tasks()
        if self.closed.is_set():
            return
        self.closed.set()
        _wake(self.port, self.key)
        self.listener.close()
        self.thread.join(5.0)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _kill_group(proc: subprocess.Popen):
    """SIGTERM to the command's process group, SIGKILL after KILL_GRACE_S."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        try:
            proc.wait(KILL_GRACE_S)
            return
        except subprocess.TimeoutExpired:
            continue


class TaskService:
    """Runs task_shell.py's commands inside this Spark task, one thread each.

    Each command runs in a process group of its own, which is ended when the caller's
    connection drops or the service closes (the Spark task ends).

    Args:
        key: the job's key.
    """

    def __init__(self, key: bytes):
        self.key = key
        self.listener = Listener(("0.0.0.0", 0), authkey=key)
        self.port = self.listener.address[1]
        self.closed = threading.Event()
        self.procs: List[subprocess.Popen] = []   # Guarded by lock.
        self.lock = threading.Lock()
        self.thread = threading.Thread(
            target=_accept_loop, args=(self.listener, self.closed, self._serve),
            daemon=True, name="hvdlite-spark-task")
        self.thread.start()

    def _serve(self, conn: Connection, peer):
        with conn:
            try:
                kind, command = conn.recv()
            except (EOFError, OSError, ValueError):
                return
            if kind != "run":
                return
            with self.lock:
                if self.closed.is_set():
                    return
                proc = subprocess.Popen(["/bin/sh", "-c", command], stdin=subprocess.DEVNULL,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        start_new_session=True)
                self.procs.append(proc)
            logger.debug("task service: started %s (pid %d)", command, proc.pid)
            send_lock = threading.Lock()
            pumps = [threading.Thread(target=self._pump, args=(conn, send_lock, pipe, fd, proc),
                                      daemon=True)
                     for pipe, fd in ((proc.stdout, 1), (proc.stderr, 2))]
            for pump in pumps:
                pump.start()
            # The caller sends nothing more: readable means it hung up.
            while proc.poll() is None:
                try:
                    if conn.poll(1.0):
                        conn.recv()
                except (EOFError, OSError):
                    _kill_group(proc)
                    break
            returncode = proc.wait()
            for pump in pumps:
                pump.join()
            try:
                with send_lock:
                    conn.send(("exit", returncode if returncode >= 0 else 128 - returncode))
            except (EOFError, OSError):
                pass

    @staticmethod
    def _pump(conn, send_lock, pipe, fd, proc):
        with pipe:
            for chunk in iter(lambda: os.read(pipe.fileno(), _READ_SIZE), b""):
                try:
                    with send_lock:
                        conn.send(("out", fd, chunk))
                except (EOFError, OSError):
                    _kill_group(proc)
                    return

    def close(self):
        """Ends every command still running and stops serving (idempotent)."""
        with self.lock:
            if self.closed.is_set():
                return
            self.closed.set()
            procs = list(self.procs)
        for proc in procs:
            if proc.poll() is None:
                _kill_group(proc)
        _wake(self.port, self.key)
        self.listener.close()
        self.thread.join(5.0)
