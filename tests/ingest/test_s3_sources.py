"""Source videos in S3 (SeaweedFS on loopback, tests/s3_local.py): the demo's videos uploaded by the test's own
boto3 client and ingested with `--videos s3://...` give the catalog rows and the shard members of the same table
ingested from the local files (conftest's `ingested`, the reference), the path aside; a probe reads a small part
of a large object by ranged reads; a missing object is its row's reject naming it, a store failure fails the unit
(in one line naming the object) and its rerun succeeds."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import pytest
from support import plan_ingest

from reelcache.base import s3
from reelcache.cli import main

ARGS = ("--name", "openvid", "--rows-per-unit", "8", "--max-file-mb", "8")  # as support.ingest plans the reference


def upload_videos(s3_server, root: str, videos: Path) -> str:
    """The demo's videos under `<root's parent>/videos/` by a plain boto3 client; the prefix's URL."""
    prefix = s3.parse(root).parent / "videos"
    c = s3_server.client()
    for p in sorted(videos.iterdir()):
        c.put_object(Bucket=prefix.bucket, Key=f"{prefix.key}/{p.name}", Body=p.read_bytes())
    return str(prefix)


def members(tar: Path) -> list[tuple[str, object]]:
    """A shard's members: the video and caption bytes, the .json member as a dict less its `path`."""
    out = []
    with tarfile.open(fileobj=io.BytesIO(tar.read_bytes())) as t:
        for m in t:
            data = t.extractfile(m).read()
            if m.name.endswith(".json"):
                doc = json.loads(data)
                data = {k: v for k, v in doc.items() if k != "path"}
            out.append((m.name, data))
    return out


def rows(root: Path, where: str = "true", videos: tuple[str, str] = ("", ""), less: str = "") -> list[dict]:
    """The catalog's clips less their path (and the columns `less`); `videos` (folder, prefix): where a reject's
    detail names the folder, it names the prefix instead (a missing file's)."""
    import duckdb

    with duckdb.connect(str(root / "catalog.duckdb"), read_only=True) as db:
        rel = db.sql(f"SELECT * EXCLUDE (path{less}) FROM clips WHERE {where} ORDER BY clip_id")
        out = [dict(zip(rel.columns, r)) for r in rel.fetchall()]
    for r in out:
        if videos[0] and r["reject_detail"]:
            r["reject_detail"] = r["reject_detail"].replace(videos[0], videos[1])
    return out


def shards(root: Path, stem: str = "") -> dict[str, list]:
    return {p.name: members(p) for p in sorted((root / "raw/openvid").glob(f"{stem}*.tar"))}


@pytest.mark.slow  # the demo's three units from S3, and merge
def test_videos_in_s3_ingest_as_the_local_files(s3_server, s3_root, demo_dataset, ingested, tmp_path, capsys):
    videos = upload_videos(s3_server, s3_root, demo_dataset / "videos")
    root = tmp_path / "root"
    root.mkdir()
    units = plan_ingest(root, demo_dataset / "OpenVid-demo.csv", videos, *ARGS)
    capsys.readouterr()
    assert main(["ingest", "run", "--root", str(root), *units]) == 0
    err = capsys.readouterr().err
    assert "objects in S3 read" in err, err  # the unit's summary reports the probes' bytes
    assert main(["catalog", "merge", "--root", str(root)]) == 0
    assert shards(root) == shards(ingested) and shards(root)
    got, want = rows(root), rows(ingested, videos=(str((demo_dataset / "videos").resolve()), videos))
    assert [r["clip_id"] for r in got] == [r["clip_id"] for r in want]
    assert got == want
    import duckdb

    with duckdb.connect(str(root / "catalog.duckdb"), read_only=True) as db:
        paths = db.sql("SELECT relpath, path FROM clips WHERE relpath IS NOT NULL").fetchall()
    assert paths and all(p == f"{videos}/{rel}" for rel, p in paths)
    assert not list((root / "raw/openvid").glob(".*tmp*"))  # the objects' local copies are gone


def test_a_probe_reads_a_small_part_of_a_large_object(s3_server, s3_root, demo_dataset):
    """huge_noise.mp4 (15 MB of 9 frames of noise, its moov index at the end): the probe from S3 equals the probe of
    the local file and fetches the header, the index and the first frame's packet (its size by ffprobe), in 256 kB
    blocks: at most four blocks more than that packet, 13% of the object."""
    import subprocess

    from reelcache.ingest.probe import probe

    local = demo_dataset / "videos/huge_noise.mp4"
    url = s3.parse(s3_root) / "big/huge_noise.mp4"
    s3_server.client().put_object(Bucket=url.bucket, Key=url.key, Body=local.read_bytes())
    got = probe(str(url))
    fetched = got.pop("probe_bytes")
    assert got == probe(str(local))
    size = local.stat().st_size
    first = subprocess.run(
        ["ffprobe", "-v", "error", "-select_streams", "v:0", "-show_entries", "packet=size", "-read_intervals",
         "%+#1", "-of", "csv=p=0", str(local)], capture_output=True, text=True, check=True,
    ).stdout.split()[0]  # fmt: skip
    assert size > 10_000_000 and int(first) < fetched <= int(first) + 4 * 256 * 1024, (fetched, first, size)


def test_a_missing_object_is_its_rows_reject_naming_it(s3_server, s3_root, demo_dataset, ingested, tmp_path):
    """An object deleted after planning: its row is a missing_file reject naming the object, as a missing local
    file is; the unit's other rows are the reference's."""
    videos = upload_videos(s3_server, s3_root, demo_dataset / "videos")
    root = tmp_path / "root"
    root.mkdir()
    units = plan_ingest(root, demo_dataset / "OpenVid-demo.csv", videos, *ARGS)
    gone = s3.parse(videos) / "clip_00001.mp4"
    s3_server.client().delete_object(Bucket=gone.bucket, Key=gone.key)
    assert main(["ingest", "run", "--root", str(root), units[0]]) == 0
    assert main(["catalog", "merge", "--root", str(root)]) == 0
    less = ", level, noun_pct, shard_offset"  # of the whole catalog; the shard lacks that clip
    got = {r["clip_id"]: r for r in rows(root, less=less)}
    (hit,) = [r for r in got.values() if r["relpath"] == "clip_00001.mp4"]
    assert (hit["status"], hit["reject_reason"]) == ("rejected", "missing_file")
    assert hit["reject_detail"] == f"{gone} does not exist"
    want = {r["clip_id"]: r for r in rows(ingested, f"unit = '{units[0]}' AND relpath <> 'clip_00001.mp4'", less=less)}
    assert {k: got[k] for k in want} == want


@pytest.mark.parametrize("fault", ["error500", "stall", "stall past the probe's deadline"])
def test_a_store_failure_on_a_source_fails_the_unit_and_its_rerun_succeeds(
    s3_server, s3_proxy, demo_dataset, ingested, tmp_path, monkeypatch, capsys, fault
):
    """Every GET of one source object fails (500, past the retries), or the first stalls past its limit: the unit
    fails in one line naming the object (no row is rejected for it), leaves no shard and no sidecar; its rerun
    after the fault is gone equals the reference. A stall longer than the probe's deadline (`--probe-timeout` 3 s,
    the stall limit left at its default of 120 s) is the store's failure too, not the row's 'timeout' reject: in a
    probe the stall limit is a third of the deadline."""
    videos = upload_videos(s3_server, s3_proxy.root, demo_dataset / "videos")
    root = tmp_path / "root"
    root.mkdir()
    deadline = ("--probe-timeout", "3") if fault.startswith("stall past") else ()
    units = plan_ingest(root, demo_dataset / "OpenVid-demo.csv", videos, *ARGS, *deadline)
    obj = f"{videos}/clip_00001.mp4"
    on = lambda m, p: m == "GET" and p.split("?")[0].endswith("/videos/clip_00001.mp4")  # noqa: E731
    if fault == "stall":
        monkeypatch.setenv("REELCACHE_S3_STALL_S", "0.5")
    else:
        monkeypatch.delenv("REELCACHE_S3_STALL_S", raising=False)
    if fault.startswith("stall"):
        s3_proxy.add("stall", on, stall_s=30)
    else:
        s3_proxy.add("error500", on, times=1000)
    capsys.readouterr()
    assert main(["ingest", "run", "--root", str(root), units[0]]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    expect = {
        "error500": f"reading {obj}: failed 5 times",
        "stall": f"reading {obj}: no byte for 0.5 s",
        "stall past the probe's deadline": f"reading {obj}: no byte for 1 s",
    }[fault]
    assert len(err) == 1 and expect in err[0], err
    assert not list((root / "raw/openvid").glob("000000*"))  # no shard, no sidecar, no lease
    assert not list((root / "raw/openvid").glob(".000000*"))  # no temporary
    s3_proxy.clear()
    assert main(["ingest", "run", "--root", str(root), units[0]]) == 0
    assert main(["catalog", "merge", "--root", str(root)]) == 0
    assert shards(root, "000000") == shards(ingested, "000000")
    less = ", level, noun_pct"  # of the whole catalog
    assert rows(root, f"unit = '{units[0]}'", less=less) == rows(ingested, f"unit = '{units[0]}'", less=less)


def test_a_folder_source_in_s3_plans_as_the_local_folder(s3_server, s3_root, demo_dataset, tmp_path):
    """`--source folder --videos s3://...` lists the prefix's objects: the same input rows as the same files in a
    local folder (relpath, caption from the .txt beside each, a caption that is not UTF-8 the row's error)."""
    import pyarrow.parquet as pq

    local = tmp_path / "clips"
    (local / "sub").mkdir(parents=True)
    for name in ("clip_00001.mp4", "clip_00002.mkv"):
        (local / name).write_bytes((demo_dataset / "videos" / name).read_bytes())
    (local / "sub/clip_00003.avi").write_bytes((demo_dataset / "videos/clip_00003.avi").read_bytes())
    (local / "clip_00001.txt").write_text("a caption\n")
    (local / "sub/clip_00003.txt").write_bytes(b"caf\xe9")  # latin-1: the row's error
    (local / "notes.md").write_text("not a video")
    prefix = s3.parse(s3_root).parent / "clips"
    c = s3_server.client()
    for p in local.rglob("*"):
        if p.is_file():
            c.put_object(Bucket=prefix.bucket, Key=f"{prefix.key}/{p.relative_to(local)}", Body=p.read_bytes())
    tables = []
    for videos, root in ((str(prefix), tmp_path / "a"), (str(local), tmp_path / "b")):
        root.mkdir()
        assert main(["ingest", "plan", "--root", str(root), "--source", "folder", "--videos", videos]) == 0
        t = pq.read_table(root / "raw/folder/_plan/input.parquet").to_pylist()
        tables.append([{k: v for k, v in r.items() if k != "path"} for r in t])
        assert [r["path"] for r in t] == [f"{videos}/{r['relpath']}" for r in t]
    assert tables[0] == tables[1] and len(tables[0]) == 3
    assert [r["row_error"] is not None for r in tables[0]] == [False, False, True]


def test_a_large_object_is_copied_into_the_shard_by_ranged_reads(s3_server, s3_root, demo_dataset, tmp_path):
    """An object over the probe's whole-read size (huge_noise.mp4, 15 MB: two 8 MB ranged reads) is copied into the
    shard byte for byte, its content hash that of the local file (base/shards.py: content_hash), and no temporary
    is left; the same object gone before the copy is the row's missing_file reject naming it."""
    from reelcache.base.shards import ShardWriter, content_hash
    from reelcache.ingest.run import write

    local = demo_dataset / "videos/huge_noise.mp4"
    url = s3.parse(s3_root) / "big/huge_noise.mp4"
    s3_server.client().put_object(Bucket=url.bucket, Key=url.key, Body=local.read_bytes())
    size = local.stat().st_size
    w = ShardWriter(tmp_path, "000000", 100_000_000)
    row = {"clip_id": "c0", "path": str(url), "file_size": size, "text": "noise"}
    assert write(row, writer=w, sdir=tmp_path, withdrawn={}) is None
    (shard,) = w.close()
    assert row["content_hash"] == content_hash(local)
    with tarfile.open(shard) as t:
        assert t.extractfile("c0.mp4").read() == local.read_bytes()
    assert not list(tmp_path.glob(".*"))
    s3_server.client().delete_object(Bucket=url.bucket, Key=url.key)
    row = {"clip_id": "c1", "path": str(url), "file_size": size, "text": "noise"}
    assert write(row, writer=ShardWriter(tmp_path, "000001", 100_000_000), sdir=tmp_path, withdrawn={}) == (
        "missing_file",
        f"{url}: no such object (deleted since it was probed?)",
    )
