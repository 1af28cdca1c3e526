"""The harness itself: tagged output per rank, structured results, failures, timeouts.

These scripts do not import hvdlite's core, so they run on a build without it.
"""
import time

import pytest

from harness import assert_body_passed, assert_ok, run_bodies, run_job

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
    with pytest.raises(AssertionError, match="timed out after 2s"):
        run_job(2, "import time\nprint('sleeping', flush=True)\ntime.sleep(600)\n", timeout=2)
    assert time.monotonic() - start < 60


def test_script_arguments(tmp_path):
    script = tmp_path / "echo_args.py"
    script.write_text("import json, sys\nprint('HVDLITE_RESULT ' + json.dumps(sys.argv[1:]))\n")
    result = assert_ok(run_job(2, str(script), args=("a", 3), timeout=90))
    assert result.result(0) == ["a", "3"] and result.result(1) == ["a", "3"]


def test_run_bodies_reports_each_body_by_name():
    outcomes, job = run_bodies(2, {
        "passes": "assert shared == 7\nvalues['rank'] = rank",
        "fails": "failures.append(f'wrong on {rank}')",
        "raises": "if rank == 1:\n    raise ValueError('body broke on purpose')",
        "after": "failures.extend([] if shared == 7 else ['prelude lost'])",
    }, prelude="""
        import os
        rank = int(os.environ.get("HVDLITE_RANK", os.environ.get("PMI_RANK", "-1")))
        shared = 7
    """, timeout=90)
    assert list(outcomes) == ["passes", "fails", "raises", "after"]
    assert job.returncode == 0
    failures = {name: [body["failures"] for body in ranks] for name, ranks in outcomes.items()}
    assert failures["passes"] == [[], []] and failures["after"] == [[], []]
    assert failures["fails"] == [["wrong on 0"], ["wrong on 1"]]
    assert failures["raises"][0] == []
    assert "body broke on purpose" in failures["raises"][1][0]
    assert [body["values"] for body in outcomes["passes"]] == [{"rank": 0}, {"rank": 1}]
    assert outcomes["fails"][0]["values"] == {}
    assert_body_passed(outcomes, "passes")
    with pytest.raises(AssertionError, match=r"body 'raises' failed\nrank 1: raised"):
        assert_body_passed(outcomes, "raises")


def test_run_bodies_fails_when_a_rank_does_not_report_every_body():
    # Rank 1 leaves (exit status 0) before its second body: a missing report alone fails.
    with pytest.raises(AssertionError, match=r"job of bodies \['first', 'second'\] failed; "
                                             r"each rank ended \{0: \['first', 'second'\], "
                                             r"1: \['first'\]\}"):
        run_bodies(2, {"first": "pass", "second": "if rank == 1:\n    sys.exit(0)"},
                   prelude="""
                       import os, sys
                       rank = int(os.environ.get("HVDLITE_RANK", os.environ.get("PMI_RANK")))
                   """, timeout=90)
