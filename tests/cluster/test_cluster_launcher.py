"""hvdliterun's many-host flags on a namespace cluster: the remote shell, a host that
cannot be reached, a host whose link is down at start, --verbose host tags,
--network-interface."""
import re
import time

import pytest

from cluster_harness import run_cluster_job
from harness import describe

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("native")]

HELLO = r'''
import json, socket
import hvdlite as hvd
hvd.init()
print("HVDLITE_RESULT", json.dumps({"host": socket.gethostname(), "rank": hvd.rank()}))
'''


def test_a_host_the_remote_shell_cannot_reach_is_named(cluster2):
    start = time.monotonic()
    result = run_cluster_job(cluster2, "h1:1,nosuchhost:2", HELLO, timeout=120,
                             launcher_args=["--start-timeout", "60"])
    elapsed = time.monotonic() - start
    assert result.returncode != 0, describe(result)
    launcher = "\n".join(result.untagged)
    assert "cannot start ranks 1, 2 on host nosuchhost" in launcher, describe(result)
    assert elapsed < 60, f"took {elapsed:.1f}s, longer than --start-timeout"
    assert not result.leftovers, result.leftovers


def test_a_host_whose_link_is_down_fails_the_start_naming_it(cluster2):
    cluster2.set_link("h2", up=False)
    try:
        start = time.monotonic()
        result = run_cluster_job(cluster2, "h1:1,h2:1", HELLO, timeout=120,
                                 launcher_args=["--start-timeout", "8"])
        elapsed = time.monotonic() - start
    finally:
        cluster2.set_link("h2", up=True)
    assert result.returncode != 0, describe(result)
    launcher = "\n".join(result.untagged)
    assert re.search(r"missing ranks: 1 on host h2", launcher), describe(result)
    assert elapsed < 8 + 30, f"took {elapsed:.1f}s"
    assert not result.leftovers, result.leftovers


def test_verbose_tags_lines_with_the_host_and_interface_sets_the_call_back(cluster2):
    result = run_cluster_job(cluster2, "h1:1,h2:2", HELLO, timeout=120,
                             launcher_args=["--verbose", "--network-interface", "eth0"])
    assert result.returncode == 0, describe(result)
    assert [result.result(r)["host"] for r in range(3)] == ["h1", "h2", "h2"]
    for rank, host in enumerate(["h1", "h2", "h2"]):
        assert re.search(rf"^\[{rank}@{host}\]<stdout>:HVDLITE_RESULT", result.stdout, re.M), \
            result.stdout
    h1 = cluster2.host("h1").address
    assert f"ranks call the launcher back at {h1}" in result.stderr, result.stderr
    assert "-iface eth0" in result.stderr
    assert not result.leftovers, result.leftovers


def test_launcher_host_variable_sets_the_call_back_address(cluster2):
    # HVDLITE_LAUNCHER_HOST wins over the routed address: h1's address works (and is
    # the one announced); h2's, where no launcher listens, cannot work.
    h1, h2 = cluster2.host("h1").address, cluster2.host("h2").address
    result = run_cluster_job(cluster2, "h1:1,h2:1", HELLO, timeout=120,
                             env={"HVDLITE_LAUNCHER_HOST": h1}, launcher_args=["--verbose"])
    assert result.returncode == 0, describe(result)
    assert f"ranks call the launcher back at {h1}" in result.stderr, result.stderr
    start = time.monotonic()
    result = run_cluster_job(cluster2, "h1:1,h2:1", HELLO, timeout=120,
                             env={"HVDLITE_LAUNCHER_HOST": h2},
                             launcher_args=["--verbose", "--start-timeout", "8"])
    assert result.returncode != 0, describe(result)
    assert f"ranks call the launcher back at {h2}" in result.stderr, result.stderr
    assert time.monotonic() - start < 8 + 30
    assert not result.leftovers, result.leftovers
