"""Fixtures for tests on a namespace cluster (issue 16): N hosts, each a network
namespace with its own host name and address, links shaped with tc.

Clusters are shared per test module (building one takes about a second per host) and
always torn down; the tests skip with the reason when the machine cannot build one
(not root; ip, tc or unshare missing).
"""
import pytest

import needs

from hvdlite.runner import netns_cluster


@pytest.fixture(scope="session")
def cluster_support():
    """Skips unless this process can build namespace clusters; removes stale ones once."""
    reason = netns_cluster.unavailable_reason()
    if reason:
        needs.need("cluster", reason)
    netns_cluster.cleanup_stale()


@pytest.fixture(scope="module")
def make_cluster(cluster_support):
    """``make_cluster(num_hosts, rate=None, loss_percent=0.0)``: a started cluster, the same
    object for the same arguments within the module, torn down after the module."""
    made = {}

    def make(num_hosts, rate=None, loss_percent=0.0):
        key = (num_hosts, rate, loss_percent)
        if key not in made:
            made[key] = netns_cluster.NetnsCluster(num_hosts, rate=rate,
                                                   loss_percent=loss_percent).start()
        return made[key]

    yield make
    for cluster in made.values():
        cluster.close()


@pytest.fixture(scope="module")
def cluster2(make_cluster):
    """Two hosts h1, h2 on unshaped links."""
    return make_cluster(2)
