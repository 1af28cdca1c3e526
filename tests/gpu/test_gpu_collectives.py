"""hvdlite.torch collectives on CUDA tensors: one rank through NCCL, one rank forced onto
the staged MPI path (``HVDLITE_GPU_OPERATIONS=MPI``), and 2 and 3 ranks sharing the one
GPU (NCCL refuses two ranks on one device, so the core stages through host memory by
itself). Every job runs ``gpu_scripts/collectives.py``: every op and dtype against
values computed on the CPU, each result on the rank's device; the core's counters say
which path ran. Skipped without a CUDA device (gpu_support.py).
"""
import gpu_support

torch = gpu_support.require_cuda()

import pytest  # noqa: E402

from harness import assert_ok, describe, run_job  # noqa: E402

pytestmark = pytest.mark.timeout(150)
SCRIPT = gpu_support.script("collectives.py")


def run(np, env, said=None):
    result = assert_ok(run_job(np, SCRIPT, timeout=120, env=env))
    bodies = gpu_support.reports(result, np, describe)
    for rank, body in enumerate(bodies):
        assert body["info"]["device"].startswith("cuda"), body["info"]
        assert body["checks"] > 400, f"rank {rank}: {body['checks']} checks"
    if said is not None:  # what the core logs at INFO when it decides the GPU path
        assert said in result.stderr, describe(result)
    return bodies


@pytest.mark.parametrize("pack", ["kernel", "batch"])
def test_one_rank_goes_through_nccl(native, pack):
    # Fused groups (odd sizes of every dtype, and 200 x 16 KiB) are packed by the core's
    # copy kernel, or by cudaMemcpyBatchAsync where the runtime has it (else copy by copy).
    said = {"kernel": "packed with the core's copy kernel", "batch": "packed with "}[pack]
    (body,) = run(1, {"HVDLITE_GPU_OPERATIONS": None, "HVDLITE_GPU_PACK": pack,
                      "HVDLITE_LOG_LEVEL": "INFO"}, said=said)
    assert gpu_support.stat(body, "nccl_collectives") > 0, body["info"]["stats"]


def test_one_rank_with_gpu_operations_mpi_is_staged(native):
    (body,) = run(1, {"HVDLITE_GPU_OPERATIONS": "MPI"})
    assert gpu_support.stat(body, "staged_collectives") > 0, body["info"]["stats"]
    assert gpu_support.stat(body, "nccl_collectives") == 0, body["info"]["stats"]


@pytest.mark.parametrize("np,chunk", [(2, None), (3, None), (2, "65536")])
def test_ranks_sharing_a_gpu_are_staged(native, np, chunk):
    # A staged allreduce goes in chunks (4 MiB by default: the 16 MiB tensor takes 5);
    # with 64 KiB ones every tensor above that size and the fused groups are cut too.
    bodies = run(np, {"HVDLITE_GPU_OPERATIONS": None, "HVDLITE_GPU_STAGE_CHUNK": chunk})
    if torch.cuda.device_count() < np:  # ranks share a device: NCCL cannot serve them
        for body in bodies:
            assert gpu_support.stat(body, "staged_collectives") > 0, body["info"]["stats"]
