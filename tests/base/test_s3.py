"""base/s3.py against a real S3 server (SeaweedFS on loopback, tests/s3_local.py), checked with a plain boto3
client of the test's own, and through the fault proxy: every fault ends with the exact bytes, or one line."""

from __future__ import annotations

import hashlib
import os
import time

import pytest

from reelcache import UserError
from reelcache.base import s3


def _raw(s3_server, url: str):
    u = s3.parse(url)
    return s3_server.client(), u.bucket, u.key


def test_parse_and_bad_bucket_names():
    u = s3.parse("s3://my-bucket/a/b/")
    assert (u.bucket, u.key, str(u / "c.tar"), u.name, str(u.parent)) == (
        "my-bucket",
        "a/b",
        "s3://my-bucket/a/b/c.tar",
        "b",
        "s3://my-bucket/a",
    )
    for bad in ("s3://Bad_Bucket/x", "s3://ab/x", "s3:///x", "/local/path"):
        with pytest.raises(UserError) as e:
            s3.parse(bad)
        assert "\n" not in str(e.value)


def test_put_get_range_list_delete(s3_server, s3_root):
    data = os.urandom(100_000)
    url = f"{s3_root}/dir/obj.bin"
    etag = s3.put(url, data)
    c, bucket, key = _raw(s3_server, url)
    assert c.get_object(Bucket=bucket, Key=key)["Body"].read() == data  # the reference: a plain client
    assert c.head_object(Bucket=bucket, Key=key)["ETag"] == etag
    assert s3.get(url) == data
    assert s3.get_range(url, 1234, 5000) == data[1234:6234]
    with pytest.raises(UserError, match="the object has 100000"):
        s3.get_range(url, 99_000, 5000)
    s3.put(f"{s3_root}/dir/other", b"x")
    s3.put(f"{s3_root}/dirt", b"y")
    d = key.rsplit("/", 1)[0]
    assert [o["Key"] for o in s3.list_objects(f"{s3_root}/dir/")] == [f"{d}/obj.bin", f"{d}/other"]
    assert s3.head(url)["ContentLength"] == len(data)
    s3.delete(url)
    assert s3.head(url) is None
    s3.delete(url)  # absent: fine


def test_conditional_writes(s3_root):
    url = f"{s3_root}/lease"
    e1 = s3.put(url, b"one", if_none_match=True)
    with pytest.raises(s3.PreconditionFailed):
        s3.put(url, b"two", if_none_match=True)
    e2 = s3.put(url, b"three", if_match=e1)
    with pytest.raises(s3.PreconditionFailed):
        s3.put(url, b"four", if_match=e1)  # the ETag it was taken on is gone
    assert s3.get(url) == b"three"
    with pytest.raises(s3.PreconditionFailed):
        s3.delete(url, if_match=e1)
    s3.delete(url, if_match=e2)
    assert s3.head(url) is None


def test_multipart_upload_whole_or_nothing(s3_server, s3_root, tmp_path):
    data = os.urandom(s3.PART_BYTES * 2 + 12345)
    src = tmp_path / "big"
    src.write_bytes(data)
    url = f"{s3_root}/big.tar"
    s3.upload_file(src, url)
    c, bucket, key = _raw(s3_server, url)
    got = c.get_object(Bucket=bucket, Key=key)["Body"].read()
    assert hashlib.sha256(got).digest() == hashlib.sha256(data).digest()
    # an upload that fails after its first part leaves no object, and no upload behind
    half = f"{s3_root}/half.tar"
    with pytest.raises(RuntimeError), s3.Upload(half) as up:
        up.write(data[: s3.PART_BYTES + 10])
        assert s3.head(half) is None  # a part is up, nothing is visible
        raise RuntimeError("the writer died")
    assert s3.head(half) is None
    assert [u for u in s3.list_uploads(f"{s3_root}/") if u["Key"].endswith("half.tar")] == []


def test_check_root(s3_server, s3_root, monkeypatch):
    assert s3.check_root(s3_root).bucket == s3.parse(s3_root).bucket
    assert [o["Key"] for o in s3.list_objects(s3_root)] == []  # the probe is gone
    missing = "s3://no-such-bucket-here/root"
    with pytest.raises(UserError, match="s3://no-such-bucket-here: no such bucket") as e:
        s3.check_root(missing)
    assert "\n" not in str(e.value)
    c = s3_server.client()
    assert "no-such-bucket-here" not in [b["Name"] for b in c.list_buckets()["Buckets"]]  # not made by a PUT
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    s3.forget_clients()
    with pytest.raises(UserError, match="refused the credentials") as e:
        s3.check_root(s3_root)
    assert "\n" not in str(e.value)


def test_check_root_refused_endpoint(s3_root, monkeypatch):
    from s3_local import free_ports

    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_ports(1)[0]}")
    s3.forget_clients()
    t0 = time.monotonic()
    with pytest.raises(UserError, match="cannot reach the S3 endpoint") as e:
        s3.check_root(s3_root)
    assert "\n" not in str(e.value)
    assert time.monotonic() - t0 < 30  # bounded retries, not a hang


def test_check_root_refuses_a_store_that_ignores_conditional_writes(s3_proxy):
    puts = []  # the probe's first create goes through; its second, conditional, is "accepted" by the store
    s3_proxy.add(
        "accept", lambda m, p: m == "PUT" and ".reelcache-check-" in p and bool(puts.append(p) or len(puts) > 1)
    )
    with pytest.raises(UserError, match="does not honour conditional writes") as e:
        s3.check_root(s3_proxy.root)
    assert "\n" not in str(e.value) and s3_proxy.faults[0].hits == 1
    assert s3.list_objects(s3_proxy.root) == []  # the probe is gone


@pytest.mark.parametrize(
    "kind,kw",
    [
        ("slowdown", {}),
        ("slowdown", {"retry_after": 0}),
        ("error500", {}),
        ("reset", {}),
        ("short", {}),
    ],
)
def test_read_faults_end_exact(s3_proxy, kind, kw):
    data = os.urandom(300_000)
    url = f"{s3_proxy.root}/obj"
    s3.put(url, data)
    gets = lambda m, p: m == "GET" and "/obj" in p  # noqa: E731
    s3_proxy.add(kind, gets, **kw)
    assert s3.get_range(url, 1000, 200_000) == data[1000:201_000]
    s3_proxy.add(kind, gets, **kw)
    assert s3.get(url) == data
    assert sum(f.hits for f in s3_proxy.faults) == 2


def test_read_fault_every_time_is_one_line(s3_proxy):
    url = f"{s3_proxy.root}/obj"
    s3.put(url, b"z" * 10_000)
    s3_proxy.add("short", lambda m, p: m == "GET", times=100)
    with pytest.raises(UserError, match=f"reading {url}: failed {s3.ATTEMPTS} times") as e:
        s3.get_range(url, 0, 10_000)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("how", ["get", "get_with_age", "get_range", "get_range_boto3"])
def test_a_persistent_500_is_tried_our_attempts_in_all_and_names_the_object(s3_proxy, monkeypatch, how):
    """A GET answered 500 every time is sent ATTEMPTS times in all (our retries with their backoff; botocore's
    are off under them, obstore's always are), then one line naming the object: not ATTEMPTS x botocore's."""
    url = f"{s3_proxy.root}/broken"
    s3.put(url, b"b" * 10_000)
    if how == "get_range_boto3":
        monkeypatch.setattr(s3, "_obstore_pid", -1)  # as in a child forked after obstore started: boto3 reads
    s3_proxy.clear()
    s3_proxy.add("error500", lambda m, p: m == "GET" and "/broken" in p, times=1000)
    read = {"get": lambda: s3.get(url), "get_with_age": lambda: s3.get_with_age(url)}.get(
        how, lambda: s3.get_range(url, 100, 1000)
    )
    with pytest.raises(s3.S3Error, match=f"reading {url}: failed {s3.ATTEMPTS} times") as e:
        read()
    assert "\n" not in str(e.value)
    assert [m for m, p in s3_proxy.requests if "/broken" in p] == ["GET"] * s3.ATTEMPTS


def test_requests_outside_our_retries_keep_botocores(s3_proxy):
    """A HEAD, a PUT, a listing are not wrapped by our retries: botocore's standard mode retries them (ATTEMPTS
    tries in all), so a 500 once is no failure, and a persistent one is tried ATTEMPTS times."""
    url = f"{s3_proxy.root}/plain"
    s3_proxy.add("error500", lambda m, p: m == "PUT" and "/plain" in p)
    s3.put(url, b"p")
    s3_proxy.add("error500", lambda m, p: m == "GET" and "list-type=2" in p)
    assert len(s3.list_objects(f"{s3_proxy.root}/")) == 1
    s3_proxy.clear()
    s3_proxy.add("error500", lambda m, p: m == "HEAD" and "/plain" in p, times=1000)
    with pytest.raises(s3.S3Error, match=f"reading {url}"):
        s3.head(url)
    assert [m for m, p in s3_proxy.requests if "/plain" in p] == ["HEAD"] * s3.ATTEMPTS


def test_stall_is_one_line_naming_the_object(s3_proxy, monkeypatch):
    url = f"{s3_proxy.root}/stalls"
    s3.put(url, b"s" * 50_000)
    monkeypatch.setenv("REELCACHE_S3_STALL_S", "0.5")
    s3.forget_clients()
    s3_proxy.add("stall", lambda m, p: m == "GET", times=100, stall_s=30)
    t0 = time.monotonic()
    with pytest.raises(s3.Stalled, match=f"reading {url}: no byte for 0.5 s") as e:
        s3.get_range(url, 0, 50_000)
    assert "\n" not in str(e.value)
    assert time.monotonic() - t0 < 10


def test_lost_put_response_is_our_own_write(s3_server, s3_proxy):
    url = f"{s3_proxy.root}/created"
    s3_proxy.add("lost", lambda m, p: m == "PUT" and "/created" in p)
    etag = s3.put(url, b"mine", if_none_match=True)  # committed, response lost, resent: 412, but ours
    c, bucket, key = _raw(s3_server, url)
    r = c.get_object(Bucket=bucket, Key=key)
    assert (r["Body"].read(), r["ETag"]) == (b"mine", etag)
    assert [m for m, p in s3_proxy.requests if "/created" in p].count("PUT") == 2
    with pytest.raises(s3.PreconditionFailed):  # another writer's object is still refused
        s3.put(url, b"theirs", if_none_match=True)
    s3_proxy.add("lost", lambda m, p: m == "PUT" and "/created" in p)
    e2 = s3.put(url, b"mine again", if_match=etag)
    assert s3.get(url) == b"mine again" and s3.head(url)["ETag"] == e2


def _child_get_range(url: str, conn) -> None:
    conn.send(s3.get_range(url, 1000, 50_000))


def test_a_child_forked_after_ranged_reads_reads_too(s3_root):
    """obstore's runtime does not survive a fork: a child forked from a process that made ranged reads (as the
    loader's DataLoader workers are) reads by boto3 instead of hanging on its first request."""
    import multiprocessing

    url = f"{s3_root}/forked"
    data = os.urandom(100_000)
    s3.put(url, data)
    assert s3.get_range(url, 0, 10) == data[:10]  # the parent's runtime started
    ctx = multiprocessing.get_context("fork")
    here, there = ctx.Pipe()
    p = ctx.Process(target=_child_get_range, args=(url, there))
    p.start()
    got = None
    try:
        got = here.recv() if here.poll(60) else None
    finally:
        p.kill() if got is None else p.join(10)
    assert got == data[1000:51_000]
