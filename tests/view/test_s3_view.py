"""The viewer over a root in S3 (docs/STORAGE.md): its catalog is the one `catalog merge --root s3://...` made in
the root's local mirror; a clip's video is read from its raw shard object by exact ranged GETs.

References: the same demo ingested onto a local folder (conftest's ``ingested``): its shards' members read by
``tarfile``, and the viewer's own thumbnails over that local root (tests/view/test_server.py checks those
against ffmpeg's first frame). The shards go up with a plain boto3 client, through a FaultProxy that counts
what it sends."""

from __future__ import annotations

import tarfile

import pytest
from starlette.testclient import TestClient  # needs httpx (pyproject's dev extra)
from support import sql

from reelcache import UserError
from reelcache.base import s3
from reelcache.cli import main
from reelcache.view.server import build_app

BASE = "http://127.0.0.1:8050"  # a Host the viewer listens as


@pytest.fixture()
def s3_view(s3_server, s3_proxy, ingested, tmp_path, monkeypatch):
    """The ingested demo's raw shards and sidecars uploaded under a fresh root, merged there; the viewer over it."""
    monkeypatch.setenv("REELCACHE_S3_MIRROR", str(tmp_path / "mirror"))
    root, u, c = s3_proxy.root, s3.parse(s3_proxy.root), s3_server.client()
    for p in sorted((ingested / "raw").rglob("*")):
        if p.is_file():
            c.put_object(Bucket=u.bucket, Key=f"{u.key}/{p.relative_to(ingested).as_posix()}", Body=p.read_bytes())
    assert main(["catalog", "merge", "--root", root]) == 0
    view = TestClient(build_app(root), base_url=BASE, raise_server_exceptions=False)
    yield view, root
    view.app.state.store.close()


def member(path, offset: int) -> bytes:
    with tarfile.open(path) as t:
        (m,) = [m for m in t if m.offset_data == offset]
        return t.extractfile(m).read()


def test_clips_play_from_their_shard_objects_by_exact_ranged_reads(s3_view, s3_proxy, ingested, tmp_path):
    view, root = s3_view
    assert view.app.state.root == s3.mirror_dir(root).resolve()  # the catalog merge made, on the local disk
    clips = sql(ingested, "SELECT clip_id, shard, shard_offset, file_size FROM clips WHERE status = 'ok' ORDER BY 1")
    assert len(clips) >= 10
    for clip_id, shard, offset, size in clips:
        s3_proxy.bodies.clear()
        r = view.get(f"/media/raw?id={clip_id}")
        assert r.status_code == 200 and r.content == member(ingested / shard, offset), clip_id
        tar_gets = [n for m, p, n in s3_proxy.bodies if m == "GET" and p.split("?")[0].endswith(shard)]
        assert tar_gets == [size]  # one GET of exactly the member's bytes
    clip_id, shard, offset, size = clips[0]
    s3_proxy.bodies.clear()
    r = view.get(f"/media/raw?id={clip_id}", headers={"Range": "bytes=100-1099"})  # a browser's seek
    assert r.status_code == 206 and r.headers["content-range"] == f"bytes 100-1099/{size}"
    assert r.content == member(ingested / shard, offset)[100:1100]
    assert [n for m, p, n in s3_proxy.bodies if m == "GET"] == [1000]
    assert view.get(f"/clip?id={clip_id}").status_code == 200


def test_thumbnails_equal_the_local_roots(s3_view, ingested, tmp_path):
    """The first frame, read from the shard object, is the picture the viewer makes over the local root."""
    import shutil

    view, _root = s3_view
    local = tmp_path / "local"
    shutil.copytree(ingested, local)
    ref = TestClient(build_app(local), base_url=BASE, raise_server_exceptions=False)
    try:
        ids = [r[0] for r in sql(ingested, "SELECT clip_id FROM clips WHERE status = 'ok' ORDER BY rotation DESC, 1")]
        for clip_id in ids[:3]:
            got, want = view.get(f"/media/thumb?id={clip_id}"), ref.get(f"/media/thumb?id={clip_id}")
            assert got.status_code == want.status_code == 200 and got.content == want.content, clip_id
    finally:
        ref.app.state.store.close()


def test_a_root_in_s3_without_a_catalog_or_a_bucket_is_one_line(s3_server, s3_root, tmp_path, monkeypatch):
    monkeypatch.setenv("REELCACHE_S3_MIRROR", str(tmp_path / "mirror"))
    with pytest.raises(UserError) as e:
        build_app(s3_root)
    assert str(e.value).endswith(f"run `reelcache catalog merge --root {s3_root}` first")
    with pytest.raises(UserError) as e:
        build_app("s3://no-such-bucket-here/root")
    assert str(e.value).startswith("s3://no-such-bucket-here: no such bucket at ")
