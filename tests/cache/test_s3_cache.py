"""The cache on a root in S3 (SeaweedFS on loopback, tests/s3_local.py) against the same cache made on a local
folder (the reference): the store's latent and caption members, downloaded by the test's own boto3 client, and
the catalog's latents rows are equal; a unit killed mid-upload and rerun through the store's faults ends equal;
a raw shard deleted since planning is its clips' reject naming the object, as a missing local shard is."""

from __future__ import annotations

import io
import json
import shutil
import signal
import sys
import tarfile
from pathlib import Path

import pytest
from s3_local import start_until_hit
from support import CACHED_WHERE, cache_config, cache_plan

from reelcache.base import s3
from reelcache.cli import main

# What of a latents row is compared: all but the store shard's name, which carries the plan's id (a hash of the
# plan rows, and those hold the raw shard's stamp: a file's mtime, an object's Last-Modified).
pytestmark = pytest.mark.timeout(600)  # the module's reference cache is made in the first test's setup

COLS = (
    "clip_id, view, status, reject_reason, bucket, shape, shard_offset, video_key, text_key, text_offset, "
    "num_frames, height, width, window_start"
)


def members(data: bytes) -> dict[str, tuple]:
    """A store shard's members: name -> (safetensors header as JSON, tensor bytes); not the tar mtime."""
    out = {}
    with tarfile.open(fileobj=io.BytesIO(data)) as t:
        for m in t:
            blob = t.extractfile(m).read()
            n = int.from_bytes(blob[:8], "little")
            out[m.name] = (json.loads(blob[8 : 8 + n]), blob[8 + n :])
    return out


def store_members(files: dict[str, bytes]) -> dict[str, dict]:
    """kind -> every member of the store's shards of that kind (video, text)."""
    out: dict[str, dict] = {"video": {}, "text": {}}
    for rel, data in files.items():
        if rel.startswith("store/") and rel.endswith(".tar"):
            out[rel.split("/")[1]].update(members(data))
    return out


# The clips of two raw shards (15 of the demo's 26 ok clips, the small ones of unit 3 among them): a short unit.
WHERE = CACHED_WHERE


def latents_rows(root: Path) -> list[tuple]:
    import duckdb

    with duckdb.connect(str(root / "catalog.duckdb"), read_only=True) as db:
        return db.sql(f"SELECT {COLS} FROM latents ORDER BY clip_id, view").fetchall()


@pytest.fixture()
def reference(cached_demo) -> Path:
    """The local cache (conftest's cached_demo): the ingested demo, manifest m (WHERE), cache t in one unit."""
    return cached_demo


@pytest.fixture()
def mirror(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("REELCACHE_S3_MIRROR", str(tmp_path / "mirror"))
    return tmp_path / "mirror"


def download(s3_server, root: str) -> dict[str, bytes]:
    """Every object under the root, by a plain boto3 client (not the code under test): rel -> bytes."""
    u = s3.parse(root)
    c = s3_server.client()
    keys = [o["Key"] for page in c.get_paginator("list_objects_v2").paginate(Bucket=u.bucket, Prefix=u.key + "/")
            for o in page.get("Contents", [])]  # fmt: skip
    return {k[len(u.key) + 1 :]: c.get_object(Bucket=u.bucket, Key=k)["Body"].read() for k in keys}


def s3_cache_root(s3_server, root: str, ingested: Path, tmp_path: Path) -> str:
    """The ingested demo's raw shards, sidecars and plan uploaded to `root` by a plain client; merged and a
    manifest m made there by `catalog merge/manifest --root s3://`; the cache planned: its one unit."""
    u = s3.parse(root)
    c = s3_server.client()
    for p in sorted((ingested / "raw").rglob("*")):
        if p.is_file():
            c.put_object(Bucket=u.bucket, Key=f"{u.key}/{p.relative_to(ingested).as_posix()}", Body=p.read_bytes())
    assert main(["catalog", "merge", "--root", root]) == 0
    assert main(["catalog", "manifest", "--root", root, "--name", "m", "--where", WHERE]) == 0
    objects = download(s3_server, root)
    (name,) = [k for k in objects if k.startswith("manifests/m-") and k.endswith(".parquet")]
    shutil.rmtree(s3.mirror_dir(root) / "manifests")  # cache plan reads it back from S3
    (unit,) = cache_plan(root, cache_config(tmp_path, "m", clips_per_unit=100))
    assert (s3.mirror_dir(root) / name).read_bytes() == objects[name]
    return unit


def assert_same_cache(s3_server, root: str, reference: Path) -> None:
    assert main(["catalog", "merge", "--root", root]) == 0
    got = download(s3_server, root)
    assert not [k for k in got if k.endswith(".lease") or "tmp" in k], sorted(got)
    ref = {str(p.relative_to(reference)): p.read_bytes() for p in (reference / "store").rglob("*.tar")}
    want, have = store_members(ref), store_members(got)
    assert want["video"] and want["text"] and have == want
    assert latents_rows(s3.mirror_dir(root)) == latents_rows(reference)
    u = s3.parse(root)
    left = s3_server.client().list_multipart_uploads(Bucket=u.bucket).get("Uploads", [])
    assert not [x for x in left if x["Key"].startswith(u.key + "/")]


@pytest.mark.slow  # a cache unit over the demo, and merges
def test_cache_on_s3_equals_local(s3_server, s3_root, mirror, ingested, reference, tmp_path):
    unit = s3_cache_root(s3_server, s3_root, ingested, tmp_path)
    assert main(["cache", "run", "--root", s3_root, unit]) == 0
    assert_same_cache(s3_server, s3_root, reference)
    assert not list((s3.mirror_dir(s3_root) / "store").rglob("*.tar"))  # staged shards uploaded and removed


@pytest.mark.slow  # two cache runs over the demo
def test_killed_mid_upload_then_rerun_through_faults(s3_server, s3_proxy, mirror, ingested, reference, tmp_path):
    """The unit's first store shard upload (its caption shard's, before any clip is decoded) reaches the proxy and
    goes no further: the run is killed, no shard or sidecar object is left. Its rerun meets a reset in the middle
    of a raw clip's ranged read, a 503 on its video shard's PUT and a lost response to its sidecar's PUT, and ends
    equal to the reference."""
    root = s3_proxy.root
    unit = s3_cache_root(s3_server, root, ingested, tmp_path)
    held = s3_proxy.add("hold", lambda m, p: m == "PUT" and "/store/text/t/000000-" in p)
    cmd = [sys.executable, "-m", "reelcache.cli", "cache", "run", "--root", root, unit]
    proc = start_until_hit(cmd, held, 600, "uploaded its shard")
    proc.send_signal(signal.SIGKILL)  # killed while its shard's upload is held
    proc.wait()
    s3_proxy.clear()
    left = [o["Key"].split("/root/", 1)[1] for o in s3.list_objects(f"{root}/")]
    assert "latents/t/000000.lease" in left and "latents/t/000000.parquet" not in left, left
    assert not [k for k in left if k.startswith("store/")], left
    raw = lambda m, p: m == "GET" and "/raw/openvid/" in p and p.endswith(".tar")  # noqa: E731
    reset = s3_proxy.add("reset", raw)
    slow = s3_proxy.add("slowdown", lambda m, p: m == "PUT" and "/store/video/t/000000-" in p)
    lost = s3_proxy.add("lost", lambda m, p: m == "PUT" and p.endswith("/latents/t/000000.parquet"))
    assert main(["cache", "run", "--root", root, unit]) == 0
    assert (reset.hits, slow.hits, lost.hits) == (1, 1, 1)
    # one ranged GET per clip encoded (and the one the reset cut short, again): no raw shard read whole
    gets = [p for m, p in s3_proxy.requests if raw(m, p)]
    assert len(gets) == sum(r[2] == "ok" for r in latents_rows(reference)) + 1, gets
    s3_proxy.clear()
    assert_same_cache(s3_server, root, reference)


@pytest.mark.slow  # a cache unit over the demo
def test_a_raw_shard_deleted_since_planning_rejects_its_clips_naming_it(
    s3_server, s3_root, mirror, ingested, reference, tmp_path
):
    unit = s3_cache_root(s3_server, s3_root, ingested, tmp_path)
    gone = s3.parse(s3_root) / "raw/openvid/000003-00.tar"
    s3_server.client().delete_object(Bucket=gone.bucket, Key=gone.key)
    assert main(["cache", "run", "--root", s3_root, unit]) == 0
    assert main(["catalog", "merge", "--root", s3_root]) == 0
    import duckdb

    with duckdb.connect(str(s3.mirror_dir(s3_root) / "catalog.duckdb"), read_only=True) as db:
        rows = db.sql(
            "SELECT l.status, l.reject_reason, l.reject_detail, c.shard FROM latents l JOIN clips c USING (clip_id)"
        ).fetchall()
    hit = [r for r in rows if r[3] == "raw/openvid/000003-00.tar"]
    assert hit and all(r[:2] == ("rejected", "undecodable") and f"{gone}: no such object" in r[2] for r in hit)
    assert all(r[0] == "ok" for r in rows if r[3] != "raw/openvid/000003-00.tar")


def test_a_bucket_that_does_not_exist_is_one_line_before_any_work(s3_server, s3_root, mirror, tmp_path, capsys):
    root = "s3://no-such-bucket-x/root"
    config = cache_config(tmp_path, "m")
    for args in (
        ["cache", "plan", "--root", root, "--config", str(config)],
        ["cache", "run", "--root", root, "t/000000"],
        ["catalog", "manifest", "--root", root, "--name", "m"],
    ):
        capsys.readouterr()
        assert main(args) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "s3://no-such-bucket-x: no such bucket" in err[0], (args, err)
    assert not mirror.exists()  # no work was done


@pytest.mark.slow  # two cache runs over the demo
def test_a_stall_fails_the_unit_cleanly_and_its_rerun_through_500s_and_short_bodies_is_equal(
    s3_server, s3_proxy, mirror, ingested, reference, tmp_path, monkeypatch, capsys
):
    """A raw clip's ranged read stalls past REELCACHE_S3_STALL_S: the unit fails in one line naming the raw shard's
    object and publishes nothing (no sidecar, no store object, no upload left, its lease released). Its rerun meets
    a 500 and a body cut short on raw reads and a 500 on its video store shard's PUT, and ends equal to the
    reference."""
    import re

    root = s3_proxy.root
    unit = s3_cache_root(s3_server, root, ingested, tmp_path)
    raw = lambda m, p: m == "GET" and "/raw/openvid/" in p and p.endswith(".tar")  # noqa: E731
    monkeypatch.setenv("REELCACHE_S3_STALL_S", "2")
    s3.forget_clients()
    stall = s3_proxy.add("stall", raw, stall_s=30)
    capsys.readouterr()
    assert main(["cache", "run", "--root", root, unit]) == 2
    err = [line for line in capsys.readouterr().err.strip().splitlines() if "error" in line]
    assert stall.hits == 1 and len(err) == 1, err
    assert re.search(rf"reading {re.escape(root)}/raw/openvid/\d+-00\.tar: no byte for 2 s", err[0]), err
    s3_proxy.clear()
    left = [o["Key"].split("/root/", 1)[1] for o in s3.list_objects(f"{root}/")]
    assert not [k for k in left if k.startswith("store/") or k.startswith("latents/t/000000.")], left
    u = s3.parse(root)
    ups = s3_server.client().list_multipart_uploads(Bucket=u.bucket).get("Uploads", [])
    assert not [x for x in ups if x["Key"].startswith(u.key + "/")]
    monkeypatch.delenv("REELCACHE_S3_STALL_S")
    s3.forget_clients()
    faults = [
        s3_proxy.add("error500", raw),
        s3_proxy.add("short", raw),
        s3_proxy.add("error500", lambda m, p: m == "PUT" and "/store/video/t/000000-" in p),
    ]
    assert main(["cache", "run", "--root", root, unit]) == 0
    assert [f.hits for f in faults] == [1, 1, 1]
    s3_proxy.clear()
    assert_same_cache(s3_server, root, reference)
