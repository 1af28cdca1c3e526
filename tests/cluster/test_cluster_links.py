"""The namespace cluster itself: hosts, names, shaped links, faults, teardown.

The rate test is a property of the link, not of hvdlite: a 10 Mbit/s link cannot carry
4 MiB (33.5 Mbit) in less than ~3.4 s, so an MPI transfer faster than 2 s would mean the
traffic bypassed the link (e.g. shared memory between namespaces).
"""
import os
import re
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest

import cluster_harness
from hvdlite.runner import netns_cluster

pytestmark = pytest.mark.timeout(300)

_CONNECT = textwrap.dedent("""
    import socket, sys
    try:
        socket.create_connection((sys.argv[1], 22), timeout=float(sys.argv[2])).close()
    except ConnectionRefusedError:
        print("reached")      # the host answered (nothing listens on port 22)
    except OSError as e:
        print("unreachable", type(e).__name__)
""")


def _probe(cluster, src, dst, timeout=1.5):
    out = cluster.run(src, [sys.executable, "-c", _CONNECT, dst, str(timeout)],
                      capture_output=True, text=True, timeout=30)
    return out.stdout.strip()


def test_each_host_has_its_own_name_and_address(cluster2):
    seen = {}
    for host in cluster2.hosts:
        out = cluster2.run(host.name, [sys.executable, "-c",
                                       "import socket; n = socket.gethostname(); "
                                       "print(n, socket.gethostbyname(n))"],
                           capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        seen[host.name] = out.stdout.split()
    assert seen == {h.name: [h.name, h.address] for h in cluster2.hosts}
    assert len({h.address for h in cluster2.hosts}) == 2
    assert _probe(cluster2, "h1", "h2") == "reached"
    assert _probe(cluster2, "h2", "h1") == "reached"


def test_a_cut_link_makes_the_host_unreachable_until_restored(cluster2):
    cluster2.set_link("h2", up=False)
    try:
        assert _probe(cluster2, "h1", "h2").startswith("unreachable")
    finally:
        cluster2.set_link("h2", up=True)
    assert _probe(cluster2, "h1", "h2") == "reached"


def test_full_loss_drops_everything_and_zero_loss_restores(cluster2):
    cluster2.shape_link("h2", loss_percent=100)
    try:
        assert _probe(cluster2, "h1", "h2").startswith("unreachable")
    finally:
        cluster2.shape_link("h2", loss_percent=0)
    assert _probe(cluster2, "h1", "h2") == "reached"


def test_mpi_traffic_between_hosts_is_bound_by_the_shaped_link(make_cluster):
    cluster = make_cluster(2, rate="10mbit")
    script = textwrap.dedent("""
        import os
        import time
        import numpy as np
        from mpi4py import MPI
        comm = MPI.COMM_WORLD
        buf = np.zeros(4 << 20, np.uint8)
        comm.Barrier()
        start = time.perf_counter()
        if comm.rank == 0:
            comm.Send(buf, 1)
        else:
            comm.Recv(buf, 0)
        comm.Barrier()
        # One write: mpiexec's output tagging may cut a line written in pieces.
        os.write(1, b'HVDLITE_RESULT {"seconds": %f}\\n' % (time.perf_counter() - start))
    """)
    with tempfile.TemporaryDirectory(prefix="hvdlite-cluster-") as tmpdir:
        os.chmod(tmpdir, 0o755)
        path = os.path.join(tmpdir, "send.py")
        with open(path, "w", encoding="utf-8") as f:
            f.write(script)
        command = cluster_harness.mpiexec_command(cluster, "h1:1,h2:1", 2,
                                                  [sys.executable, path], tmpdir)
        result = cluster_harness.run_in_cluster(cluster, command, timeout=120)
    assert result.returncode == 0, "\n".join(result.untagged[-30:]) + result.stderr[-3000:]
    # Read from the whole output: a line may still carry a second rank tag inside it.
    times = [float(t) for t in re.findall(r'"seconds": ([0-9.]+)', result.stdout)]
    assert len(times) == 2, result.stdout[-3000:]
    seconds = min(times)
    # 4 MiB at 10 Mbit/s is >= 3.36 s on the wire; well under 2 s means a bypass.
    assert seconds >= 2.0, f"4 MiB crossed a 10 Mbit/s link in {seconds:.3f}s"


def _namespaces():
    return set(os.listdir(netns_cluster.NETNS_DIR)) if os.path.isdir(
        netns_cluster.NETNS_DIR) else set()


def test_close_removes_namespaces_processes_and_files(cluster_support):
    cluster = netns_cluster.NetnsCluster(2).start()
    names = {cluster.switch_netns} | {h.netns for h in cluster.hosts}
    assert names <= _namespaces()
    sleeper = cluster.popen("h2", ["sleep", "300"])
    cluster.close()
    assert sleeper.wait(timeout=10) == -signal.SIGKILL
    assert not names & _namespaces()
    assert not any(os.path.exists(os.path.join(netns_cluster.ETC_NETNS_DIR, n)) for n in names)
    assert cluster.prefix not in {c["prefix"] for c in netns_cluster.list_clusters()}
    cluster.close()  # idempotent


def test_cleanup_stale_removes_the_cluster_of_a_killed_creator(cluster_support):
    creator = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent("""
            import sys, time
            from hvdlite.runner.netns_cluster import NetnsCluster
            cluster = NetnsCluster(2).start()
            print(cluster.prefix, flush=True)
            time.sleep(300)
        """)], stdout=subprocess.PIPE, text=True, env=cluster_harness.harness.job_env())
    try:
        prefix = creator.stdout.readline().strip()
        assert prefix.startswith("hvdlc"), prefix
        mine = {n for n in _namespaces() if n.startswith(prefix + "-")}
        assert len(mine) == 3
        assert not {n for n in netns_cluster.cleanup_stale() if n.startswith(prefix + "-")}
    finally:
        creator.kill()  # SIGKILL: no atexit, no handler
        creator.wait(timeout=10)
    removed = set(netns_cluster.cleanup_stale())
    assert mine <= removed
    assert not mine & _namespaces()


def test_sigterm_tears_the_cluster_down(cluster_support):
    creator = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent("""
            import time
            from hvdlite.runner.netns_cluster import NetnsCluster
            cluster = NetnsCluster(1).start()
            print(cluster.prefix, flush=True)
            time.sleep(300)
        """)], stdout=subprocess.PIPE, text=True, env=cluster_harness.harness.job_env())
    prefix = creator.stdout.readline().strip()
    assert any(n.startswith(prefix + "-") for n in _namespaces())
    creator.send_signal(signal.SIGTERM)
    assert creator.wait(timeout=30) == -signal.SIGTERM
    assert not any(n.startswith(prefix + "-") for n in _namespaces())
