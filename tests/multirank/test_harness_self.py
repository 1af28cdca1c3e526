"""The harness itself: tagged output per rank, structured results, failures, timeouts.

These scripts do not import hvdlite's core, so they run on a build without it.
"""
import time

import pytest

from harness import assert_ok, run_job

pytestmark = pytest.mark.timeout(240)


def test_results_and_lines_per_rank():
    result = assert_ok(run_job(2, """
        import json, os, sys
        rank = int(os.environ.get("HVDLITE_RANK", os.environ.get("PMI_RANK", "-1")))
        print("hello from", rank)
        print("to stderr", rank, file=sys.stderr)
        print("HVDLITE_RESULT " + json.dumps({"rank": rank, "env": os.environ["OMP_NUM_THREADS"]}))
    """, timeout=90))
    assert sorted(result.results) == [0, 1]
    for rank in (0, 1):
        assert result.result(rank) == {"rank": rank, "env": "1"}
        assert any(f"hello from {rank}" in line for line in result.rank_stdout[rank])
        assert any(f"to stderr {rank}" in line for line in result.rank_stderr[rank])


def test_failure_shows_the_traceback():
    result = run_job(2, """
        import os
        if os.environ.get("HVDLITE_RANK", os.environ.get("PMI_RANK")) == "1":
            raise RuntimeError("rank one broke on purpose")
    """, timeout=90)
    assert result.returncode != 0
    with pytest.raises(AssertionError, match="rank one broke on purpose"):
        assert_ok(result)


def test_timeout_kills_the_job():
    start = time.monotonic()
    with pytest.raises(AssertionError, match="timed out after 5s"):
        run_job(2, "import time\nprint('sleeping', flush=True)\ntime.sleep(600)\n", timeout=5)
    assert time.monotonic() - start < 60


def test_script_arguments(tmp_path):
    script = tmp_path / "echo_args.py"
    script.write_text("import json, sys\nprint('HVDLITE_RESULT ' + json.dumps(sys.argv[1:]))\n")
    result = assert_ok(run_job(2, str(script), args=("a", 3), timeout=90))
    assert result.result(0) == ["a", "3"] and result.result(1) == ["a", "3"]
