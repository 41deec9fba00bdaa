"""Ingest onto a root in S3 (SeaweedFS on loopback, tests/s3_local.py) against the same input ingested onto a
local folder (conftest's `ingested`, the reference): the shards and sidecars, downloaded by the test's own
boto3 client, and the catalog rows are equal; a unit that dies mid-upload leaves no object and its rerun
succeeds; faults end byte-identical or fail the unit cleanly; a bad root is one line before any work."""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

import pytest
from s3_local import start_until_hit
from support import catalog_rows, ingest, outputs, plan_ingest, sql

from reelcache.base import s3
from reelcache.cli import main

ARGS = ("--rows-per-unit", "8", "--max-file-mb", "8")  # as support.ingest plans the reference


@pytest.fixture()
def mirror(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("REELCACHE_S3_MIRROR", str(tmp_path / "mirror"))
    return tmp_path / "mirror"


def download(s3_server, root: str, dest: Path) -> list[str]:
    """Every object under the root into `dest` with a plain boto3 client (not the code under test); the keys."""
    u = s3.parse(root)
    c = s3_server.client()
    keys = [o["Key"] for page in c.get_paginator("list_objects_v2").paginate(Bucket=u.bucket, Prefix=u.key + "/")
            for o in page.get("Contents", [])]  # fmt: skip
    for k in keys:
        p = dest / k[len(u.key) + 1 :]
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(c.get_object(Bucket=u.bucket, Key=k)["Body"].read())
    return [k[len(u.key) + 1 :] for k in keys]


def uploads(s3_server, root: str) -> list[str]:
    u = s3.parse(root)
    return [x["Key"] for x in s3_server.client().list_multipart_uploads(Bucket=u.bucket).get("Uploads", [])
            if x["Key"].startswith(u.key + "/")]  # fmt: skip


@pytest.mark.slow  # the whole demo input: five units, and merge, sql
def test_ingest_to_s3_equals_local(s3_server, s3_root, mirror, demo_dataset, ingested, tmp_path, capsys):
    ingest(s3_root, demo_dataset)
    keys = download(s3_server, s3_root, tmp_path / "dl")
    assert not [k for k in keys if k.endswith(".lease") or "tmp" in k], keys  # no lease, no temporary left
    assert outputs(tmp_path / "dl", "raw/openvid") == outputs(ingested, "raw/openvid")  # members and sidecar rows
    for t in (ingested / "raw/openvid").glob("*.tar"):  # the same sizes: only the tar headers' mtime may differ
        assert (tmp_path / "dl/raw/openvid" / t.name).stat().st_size == t.stat().st_size
    local = s3.mirror_dir(s3_root)
    assert local == mirror / s3.parse(s3_root).bucket / s3.parse(s3_root).key  # where the catalog lives
    assert catalog_rows(local, "clips", "clip_id") == catalog_rows(ingested, "clips", "clip_id")
    assert not list((local / "raw/openvid").glob("*.tar"))  # staged shards were uploaded and removed
    assert uploads(s3_server, s3_root) == []
    # merge again: nothing new is downloaded or merged
    assert main(["catalog", "merge", "--root", s3_root]) == 0
    assert catalog_rows(local, "clips", "clip_id") == catalog_rows(ingested, "clips", "clip_id")
    capsys.readouterr()  # the read-only commands take the s3:// root and open its merged catalog
    assert main(["catalog", "sql", "--root", s3_root, "SELECT count(*) AS n FROM clips WHERE status = 'ok'"]) == 0
    ok = sql(ingested, "SELECT count(*) FROM clips WHERE status = 'ok'")[0][0]
    assert f"\n{ok}" in capsys.readouterr().out


def unit_outputs(root: Path, stem: str) -> dict:
    """outputs() of one unit: its shards and its sidecar's rows."""
    return {k: v for k, v in outputs(root, "raw/openvid").items() if k.startswith(stem)}


def unit_rows(root: Path, unit: str) -> list[tuple]:
    import duckdb

    with duckdb.connect(str(root / "catalog.duckdb"), read_only=True) as db:
        cols = [
            c for c in db.sql("SELECT * FROM clips LIMIT 0").columns if c not in ("level", "noun_pct")
        ]  # of all clips
        return db.sql(f"SELECT {', '.join(cols)} FROM clips WHERE unit = ? ORDER BY clip_id", params=[unit]).fetchall()


def same_unit(s3_server, root: str, reference: Path, tmp_path: Path, unit: str) -> None:
    """The unit's objects (downloaded by a plain client) and catalog rows equal the reference's."""
    assert main(["catalog", "merge", "--root", root]) == 0
    download(s3_server, root, tmp_path / "dl")
    stem = unit.split("/")[1]
    assert unit_outputs(tmp_path / "dl", stem) == unit_outputs(reference, stem)
    assert unit_rows(s3.mirror_dir(root), unit) == unit_rows(reference, unit)
    assert uploads(s3_server, root) == []


def test_two_runs_of_a_unit_and_a_run_killed_mid_upload(
    s3_server, s3_proxy, mirror, demo_dataset, ingested, tmp_path, capsys
):
    """A run holds the unit's lease and its shard upload reaches the proxy and goes no further: a second run is
    refused in one line naming it; the first is killed: no shard or sidecar object is left; the rerun takes the
    dead run's lease (its pid is gone on this host), aborts what a killed run's multipart upload left, and ends
    equal to the reference."""
    root = s3_proxy.root
    units = plan_ingest(root, demo_dataset / "OpenVid-demo.csv", demo_dataset / "videos", "--name", "openvid", *ARGS)
    held = s3_proxy.add("hold", lambda m, p: m == "PUT" and "/raw/openvid/000000-" in p)
    cmd = [sys.executable, "-m", "reelcache.cli", "ingest", "run", "--root", root, units[0]]
    proc = start_until_hit(cmd, held, 60, "uploaded its shard")
    try:
        capsys.readouterr()
        assert main(["ingest", "run", "--root", root, units[0]]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "openvid/000000 is being run by host" in err[0] and f"pid {proc.pid}" in err[0]
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    s3_proxy.clear()
    left = [o["Key"].rsplit("/", 1)[-1] for o in s3.list_objects(f"{root}/raw/openvid/")]
    assert "000000.lease" in left and not [k for k in left if k.startswith("000000-") or k == "000000.parquet"], left
    u = s3.parse(root)
    s3_server.client().create_multipart_upload(Bucket=u.bucket, Key=f"{u.key}/raw/openvid/000000-00.tar")
    assert uploads(s3_server, root)
    assert main(["ingest", "run", "--root", root, units[0]]) == 0
    same_unit(s3_server, root, ingested, tmp_path, units[0])


def test_faults_end_byte_identical(s3_server, s3_proxy, mirror, demo_dataset, ingested, tmp_path):
    """Every fault of the proxy at once, on the requests of one unit's run: its lease's create (SlowDown with
    Retry-After, then a lost response), its shard's PUT (500, SlowDown without Retry-After), its reads of the
    lease (a reset body, a short body), the sidecar's PUT (lost): the unit ends equal to the reference."""
    root = s3_proxy.root
    units = plan_ingest(root, demo_dataset / "OpenVid-demo.csv", demo_dataset / "videos", "--name", "openvid", *ARGS)
    on = lambda method, name: lambda m, p: m == method and f"/raw/openvid/{name}" in p  # noqa: E731
    s3_proxy.add("slowdown", on("PUT", "000000.lease"), retry_after=0)
    s3_proxy.add("lost", on("PUT", "000000.lease"))
    s3_proxy.add("error500", on("PUT", "000000-00.tar"))
    s3_proxy.add("slowdown", on("PUT", "000000-00.tar"))
    s3_proxy.add("reset", on("GET", "000000.lease"))
    s3_proxy.add("short", on("GET", "000000.lease"))
    s3_proxy.add("lost", on("PUT", "000000.parquet"))
    assert main(["ingest", "run", "--root", root, units[0]]) == 0
    assert [f.hits for f in s3_proxy.faults] == [1] * 7
    s3_proxy.clear()
    same_unit(s3_server, root, ingested, tmp_path, units[0])


def test_a_shard_that_cannot_be_uploaded_fails_the_unit_cleanly(
    s3_server, s3_proxy, mirror, demo_dataset, ingested, tmp_path, capsys
):
    root = s3_proxy.root
    units = plan_ingest(root, demo_dataset / "OpenVid-demo.csv", demo_dataset / "videos", "--name", "openvid", *ARGS)
    s3_proxy.add("error500", lambda m, p: m == "PUT" and "/raw/openvid/000001-" in p, times=1000)
    capsys.readouterr()
    assert main(["ingest", "run", "--root", root, units[1]]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "raw/openvid/000001-00.tar" in err[0], err
    s3_proxy.clear()
    left = [o["Key"].rsplit("/", 1)[-1] for o in s3.list_objects(f"{root}/raw/openvid/")]
    assert not [k for k in left if k.startswith("000001")], left  # no shard, no sidecar, no lease
    assert main(["ingest", "run", "--root", root, units[1]]) == 0
    same_unit(s3_server, root, ingested, tmp_path, units[1])


@pytest.mark.parametrize("what", ["bucket", "credentials", "endpoint"])
def test_a_bad_root_is_one_line_before_any_work(s3_server, s3_root, mirror, demo_dataset, monkeypatch, capsys, what):
    from s3_local import BAD_ROOTS, bad_root

    root, expect = bad_root(what, s3_root, monkeypatch), BAD_ROOTS[what]
    capsys.readouterr()
    args = ["--source", "openvid", "--meta", str(demo_dataset / "OpenVid-demo.csv"), "--videos", str(demo_dataset)]
    assert main(["ingest", "plan", "--root", root, *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expect in err[0], err
    assert not mirror.exists() or not list(mirror.rglob("*.parquet"))  # no work was done
    assert main(["catalog", "merge", "--root", root]) == 2
    assert expect in capsys.readouterr().err


def test_a_run_whose_lease_was_taken_over_publishes_nothing(s3_server, s3_proxy, mirror, demo_dataset):
    """Two runs of one unit at once, the first frozen past its lease's TTL (held at its check of the lease before
    its shard goes up) while another host took the lease over: the first loses, in one line, and publishes no
    shard and no sidecar; the lease stays the new holder's."""
    root = s3_proxy.root
    units = plan_ingest(root, demo_dataset / "OpenVid-demo.csv", demo_dataset / "videos", "--name", "openvid", *ARGS)
    frozen = s3_proxy.add("hold", lambda m, p: m == "GET" and "/raw/openvid/000000.lease" in p)
    cmd = [sys.executable, "-m", "reelcache.cli", "ingest", "run", "--root", root, units[0]]
    proc = start_until_hit(cmd, frozen, 60, "checked its lease")
    try:
        u = s3.parse(f"{root}/raw/openvid/000000.lease")
        body = b'{"host": "gpu-node-3", "boot_id": "b", "pid": 7, "pid_start": 1, "started_at": "t", "token": "new"}'
        s3_server.client().put_object(Bucket=u.bucket, Key=u.key, Body=body)  # the other host's takeover
        frozen.release.set()
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
        proc.wait()
    lines = [line for line in err.decode().splitlines() if "error" in line]
    assert proc.returncode == 2 and len(lines) == 1 and "lost the lease" in lines[0], err.decode()
    left = [o["Key"].rsplit("/", 1)[-1] for o in s3.list_objects(f"{root}/raw/openvid/")]
    assert not [k for k in left if k.startswith("000000-") or k == "000000.parquet"], left
    assert json.loads(s3.get(f"{root}/raw/openvid/000000.lease"))["token"] == "new"


def test_a_stalled_lease_check_fails_the_unit_in_one_line(
    s3_server, s3_proxy, mirror, demo_dataset, monkeypatch, capsys
):
    """The store stalls on the unit's check of its lease before its shard goes up: the unit fails in one line naming
    the lease's object (not a lost lease: it could not be read), publishes nothing, and its rerun succeeds."""
    root = s3_proxy.root
    units = plan_ingest(root, demo_dataset / "OpenVid-demo.csv", demo_dataset / "videos", "--name", "openvid", *ARGS)
    monkeypatch.setenv("REELCACHE_S3_STALL_S", "0.5")
    s3.forget_clients()
    s3_proxy.add("stall", lambda m, p: m == "GET" and "/raw/openvid/000000.lease" in p, stall_s=30)
    capsys.readouterr()
    assert main(["ingest", "run", "--root", root, units[0]]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"reading {root}/raw/openvid/000000.lease: no byte for 0.5 s" in err[0], err
    left = [o["Key"].rsplit("/", 1)[-1] for o in s3.list_objects(f"{root}/raw/openvid/")]
    assert not [k for k in left if k.startswith("000000")], left  # no shard, no sidecar, the lease released
    assert main(["ingest", "run", "--root", root, units[0]]) == 0
