"""Fixtures for single-process tests: an MPI singleton is rank 0 of 1.

``hvd`` initializes hvdlite once in the pytest process and leaves it running (shutdown
happens at exit), because a core cannot be assumed to restart after shutdown. Tests of
init/shutdown themselves run in a fresh interpreter through ``run_py``.
"""
import os
import signal
import subprocess
import sys
import textwrap

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

try:
    import hvdlite  # noqa: F401  (an installed copy, or the checkout via sys.path)
except ImportError:
    sys.path.insert(0, REPO_ROOT)
    import hvdlite  # noqa: F401

# The directory holding the hvdlite the tests import, for the child interpreters.
HVDLITE_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(hvdlite.__file__)))


def native_load_error():
    """Returns None if the native library loads, else the ImportError's text."""
    try:
        import hvdlite._native  # noqa: F401
    except ImportError as e:
        return str(e)
    return None


@pytest.fixture(scope="session")
def native():
    """Skips the test when the native library cannot be loaded; else hvdlite._native."""
    error = native_load_error()
    if error is not None:
        if os.environ.get("HVDLITE_REQUIRE_NATIVE") == "1":
            pytest.fail(f"native library unavailable: {error}")  # CI: never all-skipped
        pytest.skip(f"native library unavailable: {error}")
    import hvdlite._native

    return hvdlite._native


@pytest.fixture(scope="session")
def hvd(native):
    """hvdlite, initialized once for the whole session (size 1)."""
    import hvdlite

    hvdlite.init()
    yield hvdlite


def child_env(env=None):
    """Returns the environment for a child interpreter that imports this hvdlite."""
    merged = dict(os.environ)
    merged["PYTHONPATH"] = os.pathsep.join(
        p for p in (HVDLITE_PARENT, merged.get("PYTHONPATH")) if p)
    merged.setdefault("PYTHONFAULTHANDLER", "1")
    merged.setdefault("OMP_NUM_THREADS", "1")
    if env:
        for key, value in env.items():
            if value is None:
                merged.pop(key, None)
            else:
                merged[key] = value
    return merged


def _run_py(code, timeout=60, env=None, check=True):
    """Runs ``code`` in a fresh ``python -c`` and returns the CompletedProcess.

    Args:
        code: Python source (dedented here).
        timeout: seconds; on expiry the child's whole process group is killed.
        env: variables to set (None values remove them) on top of this environment.
        check: assert a zero exit status, showing the child's output otherwise.

    Raises:
        AssertionError: the child timed out, or failed while ``check`` is set.
    """
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=child_env(env), cwd=REPO_ROOT, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        raise AssertionError(f"child timed out after {timeout}s; stdout:\n{stdout[-3000:]}\n"
                             f"stderr:\n{stderr[-3000:]}") from None
    result = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    if check and proc.returncode != 0:
        raise AssertionError(f"child exited with {proc.returncode}; stdout:\n"
                             f"{stdout[-3000:]}\nstderr:\n{stderr[-3000:]}")
    return result


@pytest.fixture(scope="session")
def run_py():
    """``run_py(code, timeout=60, env=None, check=True)``: see ``_run_py``."""
    return _run_py
