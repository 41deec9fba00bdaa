"""A unit's lease (base/lease.py) as another host and a later run see it: stale only when its
heartbeat stops, read whatever its writer's version, and never published over once lost."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

import pytest

from reelcache import UserError


def test_another_hosts_lease_is_stale_only_after_its_heartbeat_stops(tmp_path):
    from reelcache.base import lease as leases
    from reelcache.base.units import begin_unit

    lease = tmp_path / "000003.lease"
    lease.write_text(
        json.dumps(
            {
                "host": "gpu-node-17",
                "boot_id": "x",
                "pid": 1,
                "pid_start": 1,
                "started_at": "2026-01-01T00:00:00Z",
                "token": "abc",
            }
        )
    )
    (tmp_path / "000003-00.tar").write_bytes(b"the other node's shard")
    with pytest.raises(UserError, match="gpu-node-17 pid 1"):
        begin_unit(tmp_path, 3)
    assert (tmp_path / "000003-00.tar").exists()
    old = time.time() - leases.TTL_S - 60
    os.utime(lease, (old, old))  # no heartbeat for longer than the TTL: the node is gone
    claim = begin_unit(tmp_path, 3)
    assert claim.sidecar == tmp_path / "000003.parquet" and not (tmp_path / "000003-00.tar").exists()
    assert json.loads(lease.read_text())["pid"] == os.getpid()
    claim.release()
    assert not lease.exists()


def test_a_lease_with_its_pid_start_as_a_string_still_reads(tmp_path):
    """Leases written before pid_start was an int hold the start ticks as a string: read as the int, so
    the same-host rule still tells a live holder from a pid now used by another process."""
    from reelcache.base import lease as leases

    ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])  # field 22
    me = {"host": socket.gethostname(), "boot_id": leases.boot_id(), "pid": os.getpid()}
    lease = tmp_path / "000004.lease"
    for start, stale in ((ticks, False), (ticks - 1, True)):
        lease.write_text(
            json.dumps({**me, "pid_start": str(start), "started_at": "2026-01-01T00:00:00Z", "token": "a"})
        )
        holder = leases.read_holder(lease)
        assert holder.pid_start == start and leases.is_stale(holder) == stale
    assert leases.pid_start(os.getpid()) == ticks


def test_a_run_that_lost_its_lease_does_not_publish(tmp_path):
    from reelcache.base.lease import LostLease
    from reelcache.base.units import begin_unit

    claim = begin_unit(tmp_path, 5)
    lease = tmp_path / "000005.lease"
    taken = json.loads(lease.read_text()) | {"host": "gpu-node-3", "pid": 77, "token": "theirs"}
    lease.write_text(json.dumps(taken))  # another node took the unit over while this run was frozen
    with pytest.raises(LostLease, match="lost the lease"):
        with claim.publish(claim.sidecar) as tmp:
            tmp.write_bytes(b"results")
    assert not claim.sidecar.exists() and json.loads(lease.read_text())["token"] == "theirs"
    claim.release()
    assert json.loads(lease.read_text())["token"] == "theirs"  # releasing never removes another's lease
