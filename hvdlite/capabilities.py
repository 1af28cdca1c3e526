"""What this build can do, by the names Horovod scripts query (``hvd.nccl_built()``...).

Not the build record (``hvdlite/_build_info.json``, what the build found: MPI, paths):
these are Horovod's capability queries, re-exported by the framework modules.
Collectives run over MPI on host memory; the other transports Horovod can be built with
are absent, so their queries answer False (0 for ``nccl_built``, which Horovod answers
with a version number).
"""
from hvdlite import core


def mpi_built():
    """Returns True: the core runs over MPI."""
    return True


def mpi_enabled():
    """Returns True: MPI is the transport in use."""
    return True


def gloo_built():
    """Returns False: no Gloo transport."""
    return False


def gloo_enabled():
    """Returns False: no Gloo transport."""
    return False


def nccl_built():
    """Returns 0 (Horovod: the NCCL version, 0 without NCCL)."""
    return 0


def ddl_built():
    """Returns False: no IBM DDL."""
    return False


def ccl_built():
    """Returns False: no oneCCL."""
    return False


def cuda_built():
    """Returns False: the framework adapters run collectives on host memory."""
    return False


def gpu_available(ext_base_name, verbose=False):
    """Returns ``cuda_built()`` (False): whether the framework extension ``ext_base_name``
    ('tensorflow', 'torch') runs collectives on GPU tensors, as Horovod's query."""
    return cuda_built()


def rocm_built():
    """Returns False: no ROCm."""
    return False


def is_homogeneous():
    """Returns True when every host runs the same number of ranks.

    Raises:
        NotInitializedError: before ``init()`` or after ``shutdown()``.
    """
    return core.size() == core.local_size() * core.cross_size()


def check_num_rank_power_of_2(num_rank):
    """Returns True if ``num_rank`` is a power of two (Horovod's helper of that name)."""
    return num_rank > 0 and num_rank & (num_rank - 1) == 0
