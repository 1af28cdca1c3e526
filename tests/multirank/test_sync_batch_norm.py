"""hvd.SyncBatchNorm on 2 and 3 real ranks (``torch_scripts/sync_batch_norm.py``), each
rank with a different batch size (one with none in a step), against torch's BatchNorm on
the concatenated batch in one process: outputs, input gradients, the ranks' weight and
bias gradients added up, running_mean / running_var / num_batches_tracked over three
steps (momentum 0.1, 0.3 and None), 2D to 5D inputs, float64 and float32, without
affine or running statistics; eval mode with running statistics communicates nothing;
training through DistributedOptimizer equals one process; too few values are refused on
every rank.
"""
import pytest

import needs

from harness import assert_shared_checks_pass

needs.import_or_skip("torch")
pytestmark = pytest.mark.timeout(300)

# The script runs in harness.shared_checks's job, beside the other checking scripts of
# torch_scripts/ (torch is imported once per rank count for the four modules).


@pytest.mark.parametrize("np", [2, 3])
def test_sync_batch_norm_equals_one_batch_norm_on_the_whole_batch(native, np):
    assert_shared_checks_pass("torch_scripts", np, "sync_batch_norm.py", min_checks=219)
