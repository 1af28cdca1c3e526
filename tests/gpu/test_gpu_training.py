"""Training on CUDA with hvdlite.torch on 1, 2 and 3 ranks (2 and 3 share the one GPU):
DistributedOptimizer (SGD, Adam; no, fp16 and bf16 compression) against one process on
the whole batch, broadcast_parameters / broadcast_optimizer_state of CUDA state, and
SyncBatchNorm against BatchNorm1d on the whole batch (``gpu_scripts/training.py``).
Skipped without a CUDA device (gpu_support.py).
"""
import gpu_support

torch = gpu_support.require_cuda()

import pytest  # noqa: E402

from harness import assert_ok, describe, run_job  # noqa: E402

pytestmark = pytest.mark.timeout(150)


@pytest.mark.parametrize("np", [1, 2, 3])
def test_training_on_cuda_matches_one_process(native, np):
    result = assert_ok(run_job(np, gpu_support.script("training.py"), timeout=120))
    for body in gpu_support.reports(result, np, describe):
        assert body["info"]["device"].startswith("cuda"), body["info"]
        assert body["checks"] > 40, body
