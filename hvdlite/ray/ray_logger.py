"""Reports from the workers to ``run(fn, callbacks=[...])`` on the driver (horovod.ray's
``ray_logger``).

    from hvdlite.ray import ray_logger       # was: from horovod.ray import ray_logger

    def train():
        ...
        ray_logger.log({"epoch": epoch, "loss": loss})   # in any worker

    executor.run(train, callbacks=[print])   # each callback gets each dict, on the driver

While ``run`` has callbacks, each worker holds a Ray queue (an actor on the driver's
node) that :func:`log` puts into; a thread of the driver takes the reports out and calls
the callbacks with each, in the order the queue got them. Outside such a ``run``,
:func:`log` drops the report (with one warning per process, as horovod.ray does).
"""
import logging
import threading
import warnings
from typing import Any, Callable, List, Optional

logger = logging.getLogger("hvdlite")

_queue = None  # this worker's queue while a run with callbacks goes on
_GONE = object()  # in place of the run's queue once a report found it gone
_warned: set = set()  # the reasons a report was dropped that were warned of
# Seconds the driver's thread waits on the queue per look (it blocks in Ray, no spin).
POLL_S = 0.2


def configure(queue) -> None:
    """Sets (or, with None, clears) where :func:`log` puts reports in this process."""
    global _queue
    _queue = queue


def log(info: Any) -> None:
    """Sends ``info`` (a dict, or any picklable value) to the driver's callbacks.

    A report never fails the training: outside a run with callbacks, or once the
    driver's queue is gone, it is dropped with one warning per process (for each of
    the two)."""
    global _queue
    gone = "the driver's report queue is gone"
    if _queue is _GONE:
        why = gone
    elif _queue is not None:
        import ray

        try:
            _queue.put(info)
            return
        except ray.exceptions.RayError as exc:
            logger.debug("hvdlite ray: report queue: %r", exc)
            _queue, why = _GONE, gone
    else:
        why = "called outside a RayExecutor.run with callbacks"
    if why not in _warned:
        warnings.warn(f"hvdlite.ray.ray_logger.log: {why}: reports are dropped")
        _warned.add(why)


class CallbackPump:
    """The driver's side: a Ray queue, and a thread that calls the callbacks with what
    arrives in it. :meth:`close` delivers what is left, then removes the queue.

    Args:
        callbacks: callables, each called with every report.
    """

    def __init__(self, callbacks: List[Callable[[Any], Any]]):
        import ray
        from ray.util.queue import Queue
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        self.callbacks = list(callbacks)
        # On the driver's node, never elsewhere: a queue on a worker's node would die
        # with that node, and the job's reports with it.
        here = ray.get_runtime_context().get_node_id()
        self.queue = Queue(actor_options={
            "num_cpus": 0,
            "scheduling_strategy": NodeAffinitySchedulingStrategy(here, soft=False)})
        self.error: Optional[BaseException] = None  # the first callback's exception
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._pump, name="hvdlite-ray-callbacks",
                                        daemon=True)
        self._thread.start()

    def _deliver(self, info):
        for callback in self.callbacks:
            try:
                callback(info)
            except Exception as exc:  # noqa: BLE001 - raised from run() at its end
                if self.error is None:
                    self.error = exc
                logger.warning("hvdlite ray: callback %r raised %r", callback, exc)

    def _pump(self):
        from ray.util.queue import Empty

        while not self._stop.is_set():
            try:
                info = self.queue.get(block=True, timeout=POLL_S)
            except Empty:
                continue
            except Exception as exc:  # noqa: BLE001 - the queue's actor is gone
                logger.debug("hvdlite ray: callback queue: %r", exc)
                return
            self._deliver(info)

    def close(self, timeout: float = 30.0):
        """Stops the thread, delivers the reports still queued and removes the queue."""
        import ray

        self._stop.set()
        self._thread.join(timeout)
        try:
            left = self.queue.qsize()
            for info in (self.queue.get_nowait_batch(left) if left else []):
                self._deliver(info)
        except Exception as exc:  # noqa: BLE001 - the queue's actor is gone
            logger.debug("hvdlite ray: callback queue: %r", exc)
        try:
            self.queue.shutdown()
        except Exception:  # noqa: BLE001
            ray.kill(self.queue.actor)
