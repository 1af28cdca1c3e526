"""What this build can do, by the names Horovod scripts query (``hvd.nccl_built()``...).

Not the build record (``hvdlite/_build_info.json``, what the build found: MPI, paths):
these are Horovod's capability queries, re-exported by the framework modules.
Collectives on host memory run over MPI; on CUDA tensors (``hvdlite.torch``) over NCCL
or staged through host memory, with the CUDA runtime and NCCL opened at run time, so
``cuda_built``/``nccl_built`` say whether they open on this machine. The other transports
Horovod can be built with are absent: their queries answer False.
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


def _gpu_support():
    """(CUDA runtime version, NCCL version) as the core opens them at run time; 0 for a
    library it cannot open."""
    from hvdlite._native import check, ffi, lib

    cuda, nccl = ffi.new("int32_t *"), ffi.new("int32_t *")
    check(lib.hvdlite_gpu_support(cuda, nccl))
    return cuda[0], nccl[0]


def nccl_built():
    """Returns the NCCL version (e.g. 22809 for 2.28.9) where the core can run CUDA
    tensors through NCCL here, else 0, as Horovod's answer. hvdlite is never compiled
    against NCCL: the core opens it at run time (docs/gpu.md), so this asks whether it
    opens, together with the CUDA runtime."""
    cuda, nccl = _gpu_support()
    return nccl if cuda else 0


def ddl_built():
    """Returns False: no IBM DDL."""
    return False


def ccl_built():
    """Returns False: no oneCCL."""
    return False


def cuda_built():
    """Returns True where the core can open the CUDA runtime, so that
    ``hvdlite.torch`` takes CUDA tensors (staged through host memory where NCCL cannot
    serve them). Horovod answers whether it was compiled with CUDA; hvdlite needs no CUDA
    at build time, so the answer is about this machine."""
    return _gpu_support()[0] > 0


def gpu_available(ext_base_name, verbose=False):
    """Returns ``cuda_built()``: whether the framework extension ``ext_base_name``
    ('tensorflow', 'torch') can run collectives on GPU tensors here, as Horovod's query.
    Only ``hvdlite.torch`` takes GPU tensors; for the others this is False."""
    available = ext_base_name in ("torch", "hvdlite.torch") and cuda_built()
    if verbose and not available:
        print(f"hvdlite: GPU collectives are not available to {ext_base_name}")
    return available


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
