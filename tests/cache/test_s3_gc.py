"""`cache gc --root s3://` (SeaweedFS on loopback, tests/s3_local.py): a small store laid out by hand, uploaded by
the test's own boto3 client, gives the same findings as the same files in a local folder; with --delete the
unreferenced shard and the orphan shard of a dead unit are deleted, the index that named them dropped, the dead
unit's incomplete multipart upload aborted, and a running unit's shard and upload left alone."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from reelcache.base import s3
from reelcache.base.shards import ShardWriter
from reelcache.cache.store import VIDEO_INDEX
from reelcache.cli import main


def shard(d: Path, stem: str, n: int) -> tuple[Path, list[int]]:
    """A store shard `<stem>-00.tar` of n latents; their data offsets."""
    w = ShardWriter(d, stem, 10_000_000)
    offs = [w.write_sample(f"k{stem}{i}", [("safetensors", os.urandom(900), None)])[1]["safetensors"] for i in range(n)]
    (path,) = w.close()
    return path, offs


def index(path: Path, rel: str, offs: list[int]) -> None:
    rows = [
        {"video_key": f"v{o}", "shard": rel, "shard_offset": o, "shape": [1], "bytes": 900, "content_hash": "h",
         "raw_shard": "raw/x-00.tar", "raw_offset": 0, "file_size": 1, "raw_stamp": "s"}
        for o in offs
    ]  # fmt: skip
    pq.write_table(pa.Table.from_pylist(rows, schema=VIDEO_INDEX), path)


def layout(root: Path) -> dict[str, list[int]]:
    """Cache t's store: unit 0's shard (3 entries, one referenced by its sidecar: kept), unit 1's (2 entries, none
    referenced: garbage), unit 2's shard no index lists (a killed unit's orphan), unit 3's too (unit 3 runs)."""
    d = root / "store/video/t"
    d.mkdir(parents=True)
    offs = {}
    for unit, n in (("000000", 3), ("000001", 2), ("000002", 1), ("000003", 1)):
        _, offs[unit] = shard(d, f"{unit}-p", n)
    for unit in ("000000", "000001"):
        index(d / f"{unit}-p.parquet", f"store/video/t/{unit}-p-00.tar", offs[unit])
    (root / "latents/t").mkdir(parents=True)
    side = {"clip_id": ["c"], "shard": ["store/video/t/000000-p-00.tar"], "shard_offset": [offs["000000"][1]]}
    pq.write_table(pa.table(side), root / "latents/t/000000.parquet")
    return offs


def keys(s3_server, root: str) -> set[str]:
    u = s3.parse(root)
    c = s3_server.client()
    return {o["Key"][len(u.key) + 1 :] for page in c.get_paginator("list_objects_v2").paginate(
        Bucket=u.bucket, Prefix=u.key + "/") for o in page.get("Contents", [])}  # fmt: skip


def uploads(s3_server, root: str) -> set[str]:
    u = s3.parse(root)
    found = s3_server.client().list_multipart_uploads(Bucket=u.bucket, Prefix=u.key + "/").get("Uploads", [])
    return {x["Key"][len(u.key) + 1 :] for x in found}


def test_gc_on_s3_lists_then_deletes_orphans_and_aborts_a_dead_units_uploads(
    s3_server, s3_root, tmp_path, monkeypatch, capsys
):
    from reelcache.base import lease as leases
    from reelcache.cache.gc import gc

    monkeypatch.setenv("REELCACHE_S3_MIRROR", str(tmp_path / "mirror"))
    local = tmp_path / "local"
    layout(local)
    u = s3.parse(s3_root)
    c = s3_server.client()
    for p in sorted(local.rglob("*")):
        if p.is_file():
            c.put_object(Bucket=u.bucket, Key=f"{u.key}/{p.relative_to(local).as_posix()}", Body=p.read_bytes())
    # unit 2 was killed: its lease left by a process gone on this host, a shard's multipart upload left open;
    # unit 3 runs (this process holds its lease): its orphan shard and its upload are its own
    dead = {"host": os.uname().nodename, "boot_id": leases.boot_id(), "pid": 2**22 + 7, "pid_start": 1,
            "started_at": "t", "token": "dead"}  # fmt: skip
    c.put_object(Bucket=u.bucket, Key=f"{u.key}/latents/t/000002.lease", Body=json.dumps(dead).encode())
    for unit in ("000002", "000003"):
        c.create_multipart_upload(Bucket=u.bucket, Key=f"{u.key}/store/video/t/{unit}-p-01.tar")
    live = leases.acquire(s3.parse(s3_root) / "latents/t/000003.lease")
    try:
        before = keys(s3_server, s3_root)
        want = gc(local)  # the same store in a folder (no lease files there: unit 3 counts as an orphan there)
        capsys.readouterr()
        assert main(["cache", "gc", "--root", s3_root]) == 0
        out = capsys.readouterr().err
        got = gc(s3_root)
        assert (got["entries"], got["uploads"]) == (want["entries"], 1) and got["orphans"] == want["orphans"] - 1
        assert (
            got["entries"] == 4 and "1 store shards no index lists" in out and "2 incomplete multipart uploads" in out
        )
        assert keys(s3_server, s3_root) == before  # listing deletes nothing
        assert uploads(s3_server, s3_root) == {"store/video/t/000002-p-01.tar", "store/video/t/000003-p-01.tar"}
        got = gc(s3_root, delete=True)
        assert (got["deleted"], got["aborted"]) == (1, 1)
        gone = {"store/video/t/000001-p-00.tar", "store/video/t/000001-p.parquet", "store/video/t/000002-p-00.tar"}
        assert keys(s3_server, s3_root) == before - gone
        assert uploads(s3_server, s3_root) == {"store/video/t/000003-p-01.tar"}  # the running unit's, kept
        ref = tmp_path / "ref"
        shutil.copytree(local, ref)
        gc(ref, delete=True)  # the folder's gc deletes the same (and unit 3's orphan, which has no lease there)
        assert {p.relative_to(ref).as_posix() for p in ref.rglob("*") if p.is_file()} | {
            "latents/t/000002.lease",
            "latents/t/000003.lease",
            "store/video/t/000003-p-00.tar",
        } == keys(s3_server, s3_root)
        assert gc(s3_root, delete=True)["entries"] == 2  # unit 0's two: they share a shard with a live entry
    finally:
        live.release()


def test_gc_on_s3_never_takes_a_stale_listing_for_the_truth(s3_server, s3_proxy, tmp_path, monkeypatch):
    """The listing leaves out unit 0's sidecar (tests/s3_local.py: 'stale'): its referenced entry stays live (the
    sidecar of a unit with a store index is looked for by a HEAD), so gc --delete keeps unit 0's shard."""
    from reelcache.cache.gc import gc

    monkeypatch.setenv("REELCACHE_S3_MIRROR", str(tmp_path / "mirror"))
    local = tmp_path / "local"
    layout(local)
    root = s3_proxy.root
    u = s3.parse(root)
    c = s3_server.client()
    for p in sorted(local.rglob("*")):
        if p.is_file():
            c.put_object(Bucket=u.bucket, Key=f"{u.key}/{p.relative_to(local).as_posix()}", Body=p.read_bytes())
    listing = lambda m, p: m == "GET" and "list-type=2" in p  # noqa: E731
    stale = s3_proxy.add("stale", listing, times=1000, hide=lambda key: key.endswith("/latents/t/000000.parquet"))
    got = gc(root, delete=True)
    assert stale.hits and got["entries"] == gc(local)["entries"] == 4
    assert "store/video/t/000000-p-00.tar" in keys(s3_server, root)


@pytest.mark.parametrize("where", ["folder", "s3"])
def test_gc_keeps_the_shards_of_a_unit_that_finishes_between_its_listing_and_its_lease_check(
    where, s3_server, s3_root, tmp_path, monkeypatch
):
    """Unit 2's shard is listed while the unit runs (its index not yet published); the unit then publishes its
    index and its sidecar and lets its lease go, all before gc's first lease check: no check sees it running.
    gc --delete must keep its shard (its index, there when the indexes are read, names it; its sidecar references
    it), on a folder and on S3 alike."""
    from reelcache.cache import gc as gc_mod

    monkeypatch.setenv("REELCACHE_S3_MIRROR", str(tmp_path / "mirror"))
    local = tmp_path / "local"
    offs = layout(local)
    shard2 = "store/video/t/000002-p-00.tar"
    finish = tmp_path / "finish"  # unit 2's index and sidecar, written by the test as the unit would
    finish.mkdir()
    index(finish / "index.parquet", shard2, offs["000002"])
    pq.write_table(
        pa.table({"clip_id": ["c2"], "shard": [shard2], "shard_offset": [offs["000002"][0]]}), finish / "side.parquet"
    )
    done = {
        "store/video/t/000002-p.parquet": finish / "index.parquet",
        "latents/t/000002.parquet": finish / "side.parquet",
    }
    root, u, c = str(local), s3.parse(s3_root), s3_server.client()
    if where == "s3":
        root = s3_root
        for p in sorted(local.rglob("*")):
            if p.is_file():
                c.put_object(Bucket=u.bucket, Key=f"{u.key}/{p.relative_to(local).as_posix()}", Body=p.read_bytes())
    store_cls = gc_mod.Bucket if where == "s3" else gc_mod.Folder
    checks = []
    running = store_cls.running

    def unit_2_finishes_first(self, units):
        if not checks:
            for rel, src in done.items():
                if where == "s3":
                    c.put_object(Bucket=u.bucket, Key=f"{u.key}/{rel}", Body=src.read_bytes())
                else:
                    shutil.copy(src, local / rel)
        checks.append(1)
        return running(self, units)

    monkeypatch.setattr(store_cls, "running", unit_2_finishes_first)
    got = gc_mod.gc(root, delete=True)
    assert len(checks) == 2
    there = keys(s3_server, s3_root) if where == "s3" else {p.relative_to(local).as_posix() for p in local.rglob("*")}
    assert shard2 in there
    # unit 1's shard (its entries unreferenced) and unit 3's orphan (no lease in this layout) are deleted as before
    assert got["deleted"] == 1 and "store/video/t/000001-p-00.tar" not in there
