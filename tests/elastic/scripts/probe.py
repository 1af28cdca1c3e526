"""What the elastic training scripts share: the records the tests read, and deaths on order.

Each rank appends JSON lines to LOG_DIR/g<world>-r<rank>.jsonl (history.py reads them):
  {"ev": "start", ...}    after the world's state was handed over (before any step)
  {"ev": "batch", ...}    (train_elastic.py) before each step's forward: the step and
                          the sample indices this rank is about to train on
  {"ev": "trained", ...}  after each optimizer step: the step and the sample indices
                          this rank trained on
  {"ev": "saved", ...}    after each save reached host memory: the step count and a
                          digest of the weights and optimizer state that were saved
  {"ev": "done", ...}     after training
A kill order is WORLD:RANK:STEP:WHERE: the rank of that world SIGKILLs itself at that
step, at the place WHERE names; ``commit`` (halfway through writing the commit file),
``handover`` (while the new world's state is handed over) and ``host`` (the rank's
wrapper is killed too: what the launcher sees when the rank's host goes down) are
placed here, the others by the script.
"""
import io
import json
import os
import signal
import time

from hvdlite import objects as objects_module
from hvdlite.elastic import protocol
from hvdlite.elastic import state as state_module
from hvdlite.elastic import store as store_module
from hvdlite.runner.testing import stall_wrapper


class Probe:
    """One rank's records and kill orders.

    Args:
        log_dir: the directory of the records.
        kills: the kill orders (``WORLD:RANK:STEP:WHERE`` strings).
        rank: this rank in the current world.
        death_note: a file a victim creates before it dies (or None).
        wrapper_stall: seconds a victim stops its rank wrapper for before it dies
            (``stall_wrapper``): the death reaches the launcher after the survivors'
            shared-memory waits saw the victim's process end (or None).
    """

    def __init__(self, log_dir, kills, rank, death_note=None, wrapper_stall=None):
        self.gen = protocol.generation()
        self.rank = rank
        self.kills = [k.split(":") for k in kills]
        self.death_note = death_note
        self.wrapper_stall = wrapper_stall
        self.step_now = -1  # the step the script is in (for deaths inside a commit)
        self.log_file = open(os.path.join(log_dir, f"g{self.gen}-r{rank}.jsonl"), "a",
                             buffering=1)

    def log(self, ev, **fields):
        self.log_file.write(json.dumps({"ev": ev, **fields}) + "\n")

    def ordered(self, where, step):
        """Whether this rank is to die at ``where`` in ``step``."""
        return any(int(w) == self.gen and int(r) == self.rank and int(at) == step and what == where
                   for w, r, at, what in self.kills)

    def kill_here(self, where, step):
        """SIGKILLs this rank if it is ordered to die here."""
        if not self.ordered(where, step):
            return
        self.log("kill", where=where, step=step, time=time.time())
        if self.death_note:
            open(self.death_note, "w").close()
        if self.wrapper_stall:
            stall_wrapper(self.wrapper_stall)
        if where == "host":  # the rank's wrapper too, as when its host goes down
            os.kill(os.getppid(), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)

    def install(self, step_of, digest):
        """Records every save that reaches host memory and places the deaths in a commit
        and in the handover.

        Args:
            step_of: ``step_of(state)``, the step count a state holds.
            digest: ``digest()``, the digest of the live weights and optimizer state.
        """
        probe = self
        write = store_module.CommitStore.write

        def write_or_die(store, writer, commit_id, **kwargs):
            if probe.ordered("commit", probe.step_now):  # half a file, then death
                os.makedirs(store.directory, exist_ok=True)
                blob = io.BytesIO()
                writer(blob)
                with open(os.path.join(store.directory, f".tmp-{os.getpid()}-half"), "wb") as f:
                    f.write(blob.getbuffer()[:len(blob.getbuffer()) // 2])
                probe.kill_here("commit", probe.step_now)
            write(store, writer, commit_id, **kwargs)

        broadcast_bytes = objects_module.broadcast_bytes

        def broadcast_or_die(blob, root_rank, name, *args, **kwargs):
            if name == "hvdlite.elastic.handover":
                probe.kill_here("handover", 0)
            return broadcast_bytes(blob, root_rank, name, *args, **kwargs)

        save = state_module.State.save

        def save_and_log(state):
            save(state)
            if state._store is not None:  # the saves that reach host memory
                probe.log("saved", step=step_of(state), commit=state.commit_id,
                          digest=digest())

        store_module.CommitStore.write = write_or_die
        objects_module.broadcast_bytes = broadcast_or_die
        state_module.State.save = save_and_log
