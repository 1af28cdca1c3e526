"""Elastic state and the ``run`` wrapper, framework-free.

A reset starts a new world (new processes: MPI cannot shrink or grow a world in place),
so what a commit saves must outlive the processes that made it. In a job of the elastic
driver every ``save`` writes the serialized state to tmpfs on the rank's host (see
store.py); the first thing a new world does, in ``run``, is find the newest commit among
its ranks' hosts and broadcast it from the rank that has it. Outside the driver (plain
``python`` or ``hvdliterun`` without ``--min-np``/``--max-np``) the commit stays in
process memory and a failed collective is raised after ``restore()``, as there is no one
to start a new world.
"""
import functools
import io
import os
import pickle
import struct
import sys

import numpy as np

from hvdlite import core, objects, ops, peer_faults
from hvdlite.elastic import protocol
from hvdlite.elastic.store import CommitStore
from hvdlite.errors import (HorovodInternalError, HostsUpdatedInterrupt, MismatchError,
                            RankFailedError, TransportError)

# A serialized state: the commit id, then the subclass's bytes (a commit file too).
COMMIT_HEADER = struct.Struct("<q")


class State:
    """What the user commits: subclasses say how to serialize it.

    Subclasses implement ``_serialize(file)`` (write the state into a binary file
    object) and ``_deserialize(buffer)`` (read it back from a memoryview), which must
    round-trip bit for bit, and may override ``on_reset``.
    """

    def __init__(self):
        self._reset_callbacks = []
        self._commit_id = 0
        self._saved = None     # the last commit, outside an elastic job
        self._store = None     # the tmpfs store, inside one (set by run)

    # -- the user's API ------------------------------------------------------------------

    def register_reset_callbacks(self, callbacks):
        """Adds functions called with no arguments after each reset (new world size).

        Args:
            callbacks: a list of callables.
        """
        self._reset_callbacks.extend(callbacks)

    def on_reset(self):
        """Runs after a reset, once the state holds the last commit."""
        for callback in self._reset_callbacks:
            callback()

    def commit(self):
        """Saves the state as the one a reset returns to, then checks for added hosts.

        Raises:
            HostsUpdatedInterrupt: hosts were added; ``run`` resets the world with them.
            HorovodInternalError: a peer failed during the check.
        """
        self.save()
        try:
            self.check_host_updates()
        except HostsUpdatedInterrupt as exc:
            exc.state_saved = True
            raise

    def save(self):
        """Saves the current state as the last commit (no host check)."""
        self._commit_id += 1
        self._keep()

    def _keep(self):
        """Makes the current state the one ``restore`` returns to (commit id unchanged)."""
        if self._store is not None:
            # Straight into tmpfs: no copy of the serialized state in process memory.
            self._store.write(self._write, self._commit_id)
        else:
            self._saved = self._blob()

    def restore(self):
        """Returns the state to the last commit."""
        blob = self._store.read_own() if self._store is not None else self._saved
        if blob is not None:
            self._load_blob(blob)

    def sync(self, root_rank=0):
        """Makes every rank's state equal to ``root_rank``'s (bit for bit) and keeps it as
        the state ``restore`` returns to, on every rank (as Horovod's TensorFlow states
        save in ``sync``; the commit id does not change).

        Args:
            root_rank: the rank whose state everyone takes.
        """
        blob = self._blob() if core.rank() == root_rank else None
        self._load_blob(objects.broadcast_bytes(blob, root_rank, "hvdlite.elastic.sync"))
        self._keep()

    def check_host_updates(self):
        """Raises HostsUpdatedInterrupt on every rank when the driver has added slots.

        Rank 0 asks the driver; its answer is broadcast, so all ranks agree. Outside an
        elastic job nothing is ever added.

        Raises:
            HostsUpdatedInterrupt: slots were added.
        """
        if self._store is None:
            return
        flag = np.array([1 if core.rank() == 0 and protocol.ask_hosts_updated() else 0],
                        dtype=np.int32)
        if ops.broadcast(flag, 0, name="hvdlite.elastic.hosts_updated")[0]:
            raise HostsUpdatedInterrupt(skip_sync=True)

    @property
    def commit_id(self):
        """How many saves this state has seen since the job started, across resets."""
        return self._commit_id

    # -- serialization -----------------------------------------------------------------

    def _keep_values(self, values):
        """Makes each of ``values`` (a dict) an attribute that commits keep."""
        self._value_names = list(values)
        for name, value in values.items():
            setattr(self, name, value)

    def _serialize(self, f):
        raise NotImplementedError

    def _deserialize(self, data):
        raise NotImplementedError

    def _write(self, f):
        f.write(COMMIT_HEADER.pack(self._commit_id))
        self._serialize(f)

    def _blob(self):
        buffer = io.BytesIO()
        self._write(buffer)
        return buffer.getbuffer()

    def _load_blob(self, blob):
        view = memoryview(blob).cast("B")
        (self._commit_id,) = COMMIT_HEADER.unpack_from(view)
        self._deserialize(view[COMMIT_HEADER.size:])

    # -- worlds (called by run) ----------------------------------------------------------

    def _enter_world(self):
        """Brings this rank's state to the job's last commit at the start of a world."""
        if not protocol.in_elastic_job():
            self.sync()
            self.save()
            return
        self._store = CommitStore(protocol.state_dir(), protocol.generation(),
                                  core.rank())
        if protocol.generation() == 0:
            self.sync()
        else:
            self._hand_over()
        self.save()
        # Every rank now holds this world's commit on its host: older worlds' files go.
        ops.allreduce(np.zeros(1, np.int32), name="hvdlite.elastic.saved", op=ops.Sum)
        self._store.drop_older_generations()
        if protocol.generation() > 0:
            self.on_reset()

    def _hand_over(self):
        """Finds the newest commit on the world's hosts and broadcasts it from its owner."""
        commit_id, path = self._store.newest()
        ids = ops.allgather(np.array([commit_id], dtype=np.int64),
                            name="hvdlite.elastic.newest").tolist()
        best = max(ids)
        if best < 0:
            raise RuntimeError(
                f"hvdlite elastic: no committed state found in {self._store.directory} on "
                f"any host of the new world (generation {protocol.generation()}); the "
                f"hosts that held it are all gone")
        source = ids.index(best)
        blob = np.fromfile(path, dtype=np.uint8) if core.rank() == source else None
        self._load_blob(objects.broadcast_bytes(blob, source, "hvdlite.elastic.handover"))


class ObjectState(State):
    """Picklable values as attributes: ``ObjectState(epoch=0, batch=0)``.

    Args:
        **kwargs: the values; each becomes an attribute that commits and resets keep.
    """

    def __init__(self, **kwargs):
        super().__init__()
        self._keep_values(kwargs)
        self.save()

    def _serialize(self, f):
        pickle.dump({name: getattr(self, name) for name in self._value_names}, f)

    def _deserialize(self, data):
        for name, value in pickle.loads(data).items():
            setattr(self, name, value)


def _leave_for_reset(reason):
    """Ends this rank so that the driver starts the next world (never returns)."""
    rank = core.rank() if core.is_initialized() else "?"
    sys.stdout.flush()
    sys.stderr.write(f"hvdlite elastic: rank {rank} leaves world "
                     f"{protocol.generation()} for a reset: {reason}\n")
    sys.stderr.flush()
    protocol.run_reset_hooks()
    # No shutdown: peers may be gone and the core's farewell could wait on them.
    os._exit(protocol.RESET_EXIT_CODE)


def run(func):
    """Decorator for the training function ``func(state, *args, **kwargs)``.

    At the start of every world the state is brought to the job's last commit (the
    first world: rank 0's state). When a collective fails because a peer died, or hosts
    were added, the rank leaves for a reset; the driver starts the next world, where
    training goes on from the last commit and the reset callbacks run.

    Outside an elastic job a failed collective restores the last commit and is raised.

    Returns:
        The wrapped function; it returns ``func``'s result.
    """
    @functools.wraps(func)
    def wrapper(state, *args, **kwargs):
        try:
            state._enter_world()  # a peer may die during the handover too
            result = func(state, *args, **kwargs)
        except MismatchError:
            raise  # the script's own inconsistency: a new world would meet it again
        except HorovodInternalError as exc:
            if state._store is None:
                state.restore()
                raise
            if isinstance(exc, (RankFailedError, TransportError)):  # a peer may be lost
                # Leaving before the launcher knows which peer died would let the driver
                # count the dead one a survivor and start the next world on its slot.
                peer_faults.await_notice()
            _leave_for_reset(f"a collective failed: {exc}")
        except HostsUpdatedInterrupt as exc:
            if state._store is None:
                raise
            if not getattr(exc, "state_saved", False):
                state.save()
            _leave_for_reset("hosts were added")
        if state._store is not None:
            state._store.remove_own()
        return result

    return wrapper
