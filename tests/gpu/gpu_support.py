"""What the GPU tests share: the CUDA check each module makes before anything else, and
where the rank scripts are.

These tests need a CUDA device that torch sees. CI and the developers' machines have
none, so they are not an area of tests/needs.py: ``HVDLITE_REQUIRE=all`` (scripts/test.sh)
must not turn their skip into a failure. On a GPU machine, ``HVDLITE_REQUIRE_GPU=1``
(scripts/gpu_check.sh sets it) does: a module that cannot run then fails at collection,
like ``HVDLITE_REQUIRE_NATIVE=1`` for the native library.
"""
import importlib
import os

import pytest

SWITCH = "HVDLITE_REQUIRE_GPU"
SCRIPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_scripts")


def _unavailable(reason):
    if os.environ.get(SWITCH) == "1":
        pytest.fail(f"{SWITCH}=1, but: {reason}", pytrace=False)
    pytest.skip(reason, allow_module_level=True)


def require_cuda():
    """Returns torch when it sees a CUDA device; otherwise skips the calling module (or
    fails it under ``HVDLITE_REQUIRE_GPU=1``). Call at module level, first."""
    try:
        torch = importlib.import_module("torch")
    except ImportError as error:
        _unavailable(f"GPU tests need torch: {error}")
    if not torch.cuda.is_available():
        _unavailable(f"no CUDA device (torch {torch.__version__}, built for CUDA "
                     f"{torch.version.cuda or 'none'})")
    return torch


def script(name):
    """The path of a rank script in gpu_scripts/."""
    return os.path.join(SCRIPTS, name)


def stat(body, name):
    """A counter of ``hvdlite.core.stats()`` from a rank's report, failing clearly when
    this core does not count it."""
    stats = body["info"]["stats"]
    assert name in stats, f"core.stats() has no counter {name!r}: {sorted(stats)}"
    return stats[name]


def reports(result, np, describe):
    """Every rank's report (asserting each reported checks and no failures)."""
    bodies = []
    for rank in range(np):
        body = result.result(rank)
        assert body["checks"] > 0, describe(result)
        assert body["failures"] == [], (f"rank {rank}: {len(body['failures'])} failure(s):\n"
                                        + "\n".join(body["failures"]))
        bodies.append(body)
    return bodies
