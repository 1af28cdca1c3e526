"""HvdliteEnvironment: Lightning's view of a job whose processes someone else started.

hvdliterun (or mpirun, srun...) starts the ranks and MPI connects them; hvdlite knows
each process's rank, local rank and host index, and this environment only reports them.
Lightning never starts processes here and never opens a torch.distributed group.
"""
import logging

from lightning.fabric.plugins.environments import ClusterEnvironment

import hvdlite.torch as hvd

_log = logging.getLogger("hvdlite")


def ensure_initialized():
    """Starts hvdlite unless the script already did (``hvd.init()`` twice only warns,
    but a strategy should not make a correct script warn)."""
    if not hvd.is_initialized():
        hvd.init()


class HvdliteEnvironment(ClusterEnvironment):
    """Ranks from hvdlite: ``global_rank`` is ``hvd.rank()``, ``local_rank`` is
    ``hvd.local_rank()``, ``node_rank`` is ``hvd.cross_rank()`` (the host's index) and
    ``world_size`` is ``hvd.size()``. Asking for any of them starts hvdlite if needed.

    Lightning may try to set the rank or size (its own strategies compute them from
    ``devices`` and ``num_nodes``); hvdlite's are the truth, so a different value is
    refused rather than silently believed.
    """

    @property
    def creates_processes_externally(self):
        return True

    @property
    def main_address(self):
        # Only torch.distributed's rendezvous reads it; hvdlite's ranks meet through MPI.
        return "127.0.0.1"

    @property
    def main_port(self):
        return 0

    @staticmethod
    def detect():
        """True when hvdlite is running (Lightning's auto-detection does not ask
        environments it does not know; HvdliteStrategy passes this one itself)."""
        return hvd.is_initialized()

    def world_size(self):
        ensure_initialized()
        return hvd.size()

    def set_world_size(self, size):
        if size != self.world_size():
            raise ValueError(f"the job has {self.world_size()} hvdlite ranks, Lightning "
                             f"asked for {size}: start the processes with hvdliterun -np N")

    def global_rank(self):
        ensure_initialized()
        return hvd.rank()

    def set_global_rank(self, rank):
        if rank != self.global_rank():
            raise ValueError(f"this process is hvdlite rank {self.global_rank()}, "
                             f"Lightning asked for rank {rank}")

    def local_rank(self):
        ensure_initialized()
        return hvd.local_rank()

    def node_rank(self):
        ensure_initialized()
        return hvd.cross_rank()
