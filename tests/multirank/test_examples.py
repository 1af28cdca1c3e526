"""The examples that no other test runs, as the README shows them, with few epochs: each
must learn (a printed accuracy well above chance, 10% on the digits' 10 classes), not
only exit 0. (pytorch_digits.py and pytorch_synthetic_benchmark.py: test_torch_examples.py;
numpy_allreduce_demo.py: test_core_example.py.)
"""
import os
import re

import pytest

import needs

from harness import REPO_ROOT, assert_ok, describe, run_job

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("native")]
needs.import_or_skip("sklearn")


def example(name):
    return os.path.join(REPO_ROOT, "examples", name)


def figures(lines, pattern):
    return [float(m.group(1)) for line in lines for m in [re.search(pattern, line)] if m]


@needs.needs("torch", needs.installed("torch"), "torch not installed")
def test_pytorch_elastic_digits_survives_a_killed_rank_and_learns():
    # 3 ranks, rank 2 SIGKILLed in epoch 2: the job goes on with 2 from the last commit.
    result = assert_ok(run_job(3, example("pytorch_elastic_digits.py"),
                               args=["--epochs", "3", "--kill-rank", "2", "--kill-at-epoch", "2"],
                               launcher_args=["--min-np", "2", "--max-np", "3"], timeout=240))
    lines = result.rank_stdout.get(0, [])
    info = describe(result)
    assert any(line.startswith("reset: 2 rank(s) go on from epoch 2") for line in lines), info
    final = [line for line in lines if line.startswith("final test accuracy")]
    assert len(final) == 1 and "on 2 rank(s)" in final[0], info
    assert figures(final, r"final test accuracy ([\d.]+)%")[0] >= 50.0, info
    assert figures(lines, r"epoch  3  2 rank\(s\)  test accuracy ([\d.]+)%"), info


# Checked without importing TensorFlow here (seconds): the jobs import it.
needs_tensorflow = needs.needs("tensorflow", needs.installed("tensorflow"), "tensorflow not installed")
needs_keras = needs.needs("keras", needs.installed("keras"), "keras not installed")


@needs_tensorflow
def test_tensorflow2_gradient_tape_learns():
    result = assert_ok(run_job(2, example("tensorflow2_gradient_tape.py"),
                               args=["--steps", "60"], timeout=240))
    accuracy = figures(result.rank_stdout.get(0, []), r"accuracy on all of digits: ([\d.]+)")
    assert len(accuracy) == 1 and accuracy[0] >= 0.8, describe(result)


@needs_tensorflow
@needs_keras
def test_tensorflow2_keras_digits_learns():
    result = assert_ok(run_job(2, example("tensorflow2_keras_digits.py"),
                               args=["--epochs", "3"], timeout=240))
    accuracy = figures(result.rank_stdout.get(0, []),
                       r"test accuracy \(mean over 2 ranks\): ([\d.]+)")
    assert len(accuracy) == 1 and accuracy[0] >= 0.8, describe(result)
