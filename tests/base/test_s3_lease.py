"""A unit's lease as an object (base/lease.py, ``_Objects``) against a real S3 server: taken by a conditional
create, refreshed on its ETag, judged stale by the server's clock and taken over on the stale ETag; a Claim on
a unit in S3 publishes whole objects while the lease is its own, and nothing once it is lost. The other
holders are written with a plain boto3 client of the test's, as another host's run would."""

from __future__ import annotations

import json
import time

import pytest

from reelcache.base import lease as leases
from reelcache.base import s3
from reelcache.base.units import begin_unit


def other_host(s3_server, url: str) -> str:
    """A lease object written as another host's live run (its heartbeat now); returns its ETag."""
    u = s3.parse(url)
    body = {"host": "gpu-node-3", "boot_id": "b", "pid": 4242, "pid_start": 1, "started_at": "t", "token": "theirs"}
    return s3_server.client().put_object(Bucket=u.bucket, Key=u.key, Body=json.dumps(body).encode())["ETag"]


def token_at(s3_server, url: str) -> str:
    u = s3.parse(url)
    return json.loads(s3_server.client().get_object(Bucket=u.bucket, Key=u.key)["Body"].read())["token"]


def test_taken_refreshed_and_released(s3_server, s3_root):
    url = f"{s3_root}/raw/x/000000.lease"
    taken = time.monotonic()
    lease = leases.acquire(url)
    try:
        assert token_at(s3_server, url) == lease.token and lease.held()
        tag = lease.tag
        holder = leases.read_holder(url)
        # its age by the server's clock (whole seconds): no older than the time since it was taken (a loaded
        # machine took 6 s between the two once; a fixed bound of 5 s failed there)
        assert holder.host != "?" and holder.age_s <= time.monotonic() - taken + 1 and holder.tag == tag
        lease.refresh()  # a conditional overwrite on our ETag: the same holder
        assert lease.tag != tag and token_at(s3_server, url) == lease.token
    finally:
        lease.release()
    assert s3.head(url) is None


def test_a_live_holder_is_busy_and_a_stale_one_is_taken_over_by_the_servers_clock(s3_server, s3_root, monkeypatch):
    url = f"{s3_root}/raw/x/000001.lease"
    theirs = other_host(s3_server, url)
    with pytest.raises(leases.Busy) as e:
        leases.acquire(url)
    assert "gpu-node-3" in str(e.value)
    monkeypatch.setattr(leases, "TTL_S", 1.0)
    deadline = time.monotonic() + 10
    while True:  # stale once the server's Date is a second past its Last-Modified (1 s resolution)
        try:
            lease = leases.acquire(url)
            break
        except leases.Busy as busy:
            assert busy.holder.age_s <= 2 and time.monotonic() < deadline
            time.sleep(0.2)
    try:
        assert token_at(s3_server, url) == lease.token
        assert s3.head(url)["ETag"] not in (theirs, None)
    finally:
        lease.release()


def test_a_takeover_on_a_changed_etag_loses(s3_server, s3_root):
    """Two runs judged one lease stale: the first overwrite on its ETag wins, the second gets 412."""
    url = f"{s3_root}/raw/x/000002.lease"
    stale = other_host(s3_server, url)
    holder = leases.read_holder(url)
    assert holder.tag == stale
    first = leases.take_over(url, holder)
    assert first is not None and token_at(s3_server, url) == first.token
    assert leases.take_over(url, holder) is None  # the same stale ETag, now gone
    assert token_at(s3_server, url) == first.token


def test_a_claim_publishes_whole_objects_and_nothing_once_its_lease_is_lost(s3_server, s3_root, tmp_path):
    remote = s3.parse(s3_root) / "raw/src"
    claim = begin_unit(tmp_path, 3, remote=remote)
    try:
        shard = tmp_path / "000003-00.tar"
        with claim.publish(shard) as tmp:
            tmp.write_bytes(b"shard bytes" * 1000)
        u = remote / "000003-00.tar"
        assert s3_server.client().get_object(Bucket=u.bucket, Key=u.key)["Body"].read() == b"shard bytes" * 1000
        assert not list(tmp_path.iterdir())  # the staged copy is gone
        other_host(s3_server, f"{remote}/000003.lease")  # taken over meanwhile
        with pytest.raises(leases.LostLease, match="lost the lease"):
            with claim.publish(tmp_path / "000003.parquet") as tmp:
                tmp.write_bytes(b"sidecar")
        assert s3.head(remote / "000003.parquet") is None and not list(tmp_path.iterdir())
        assert claim.unlink([shard]) == 0  # the new holder's now: not deleted
        assert s3.head(u) is not None
    finally:
        claim.release()
    assert token_at(s3_server, f"{remote}/000003.lease") == "theirs"  # release leaves another's lease


def test_a_release_racing_the_heartbeat_leaves_no_lease(s3_server, s3_proxy):
    """The heartbeat's refresh and release take turns. A refresh that lands between release's read of the lease's
    ETag and its conditional delete would fail that delete and leave the lease behind until it is stale (seen in
    the namespace-cluster test: an ingest unit's lease left in S3 after the unit ended). Here release's DELETE is
    held by the proxy while a refresh is tried: the refresh waits for release's turn, then does nothing."""
    import threading

    url = s3.parse(s3_proxy.root) / "race.lease"
    lease = leases.acquire(url)
    held = s3_proxy.add("hold", match=lambda method, path: method == "DELETE" and "race.lease" in path)
    release = threading.Thread(target=lease.release)
    release.start()
    deadline = time.monotonic() + 30
    while held.hits == 0:
        assert time.monotonic() < deadline, "release never sent its DELETE"
        time.sleep(0.01)
    beat = threading.Thread(target=lease.refresh)
    beat.start()
    beat.join(1.0)  # unfixed, the refresh's PUT lands now, on the ETag the held DELETE is conditional on
    held.release.set()
    release.join(30)
    beat.join(30)
    assert not release.is_alive() and not beat.is_alive()
    u = s3.parse(url)
    keys = [o["Key"] for o in s3_server.client().list_objects_v2(Bucket=u.bucket, Prefix=u.key).get("Contents", [])]
    assert keys == []
