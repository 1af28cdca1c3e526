"""The PyTorch examples run as the README shows them, on 2 ranks."""
import os
import re

import pytest

import needs

from harness import REPO_ROOT, assert_ok, describe, run_job

needs.import_or_skip("torch")
needs.import_or_skip("sklearn")
pytestmark = pytest.mark.timeout(300)


def test_digits_example_learns(native):
    result = assert_ok(run_job(2, os.path.join(REPO_ROOT, "examples", "pytorch_digits.py"),
                               timeout=240))
    lines = result.rank_stdout.get(0, [])
    accuracies = [float(m.group(1)) for line in lines
                  for m in [re.search(r"test accuracy ([\d.]+)%", line)] if m]
    assert len(accuracies) == 10, describe(result)
    assert accuracies[-1] >= 90.0, lines
    assert not any("test accuracy" in line for line in result.rank_stdout.get(1, []))


def test_synthetic_benchmark_runs(native):
    result = assert_ok(run_job(
        2, os.path.join(REPO_ROOT, "examples", "pytorch_synthetic_benchmark.py"),
        args=["--model", "cnn", "--batch-size", "8", "--num-warmup-batches", "1",
              "--num-batches-per-iter", "2", "--num-iters", "2"], timeout=240))
    assert any("Total samples/sec on 2 rank(s)" in line
               for line in result.rank_stdout.get(0, [])), describe(result)
