"""Many nodes on one machine (tests/cluster_local.py): the cluster itself, then ingest and the latent
cache over real ssh with GNU parallel, with a node killed and a node cut off mid-unit.

References: the one-machine ingest (conftest's ``ingested``: every unit in one process) for the
catalog rows and the shard bytes; the cache units run in one process for the latents; the plan's
units for "every unit done once".
"""

from __future__ import annotations

import subprocess

import pytest

pytestmark = pytest.mark.multinode


def test_nodes_have_their_names_and_reach_each_other_over_ssh_only_inside(cluster):
    """Each node answers over ssh from the head with its own hostname and address; the machine's own
    network namespace gained nothing; a node has no route out."""
    for i, name in enumerate(cluster.names, 1):
        out = cluster.run(1, "ssh", name, "hostname; hostname -I; getent hosts node1").stdout.split()
        assert out[:2] == [name, cluster.addr(i)] and out[2:4] == [cluster.addr(1), "node1"], out
    host_addrs = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True).stdout
    assert cluster.net + "." not in host_addrs
    assert "default" not in cluster.run(2, "ip", "route").stdout
    assert cluster.run(1, "cat", "/etc/hostname").stdout.strip() == "node1"
    assert subprocess.run(["hostname"], capture_output=True, text=True).stdout.strip() != "node1"
