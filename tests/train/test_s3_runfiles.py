"""train/runfiles.py RunFiles.publish against the real SeaweedFS through the fault proxy (tests/s3_local.py, which
counts the requests): each rank publishes its own files of the run folder, whole, and at the next publish only
what was written or changed since; a part written once (the consumed log's, the metrics') is not looked at again
once published (a long run holds tens of thousands: bench/bench_runfiles.py measures the walk)."""

from __future__ import annotations

import os
from urllib.parse import parse_qs, urlsplit

from reelcache.base import s3
from reelcache.train import runfiles
from reelcache.train.runfiles import RunFiles


def _objects(s3_server, url: s3.Url) -> dict[str, bytes]:
    c = s3_server.client()
    out = {}
    for page in c.get_paginator("list_objects_v2").paginate(Bucket=url.bucket, Prefix=url.key + "/"):
        for o in page.get("Contents", []):
            out[o["Key"][len(url.key) + 1 :]] = c.get_object(Bucket=url.bucket, Key=o["Key"])["Body"].read()
    return out


def _write(run, rel: str, data: bytes, append: bool = False) -> None:
    (run / rel).parent.mkdir(parents=True, exist_ok=True)
    with open(run / rel, "ab" if append else "wb") as f:
        f.write(data)


def _puts(proxy) -> list[str]:
    return sorted(p.split("/root/runs/r/", 1)[1].split("?")[0] for m, p in proxy.requests if m == "PUT")


def test_each_rank_publishes_its_files_and_then_only_what_changed(s3_server, s3_proxy, tmp_path, monkeypatch):
    run = tmp_path / "runs" / "r"
    remote = s3.parse(s3_proxy.root) / "runs" / "r"
    files = {
        "config.json": b"{}",
        "ranks/rank00000.json": b"0",
        "ranks/rank00001.json": b"1",
        "consumed/rank00000-g000-e0000-s000000000.parquet": b"c00",
        "consumed/rank00000-g000-e0000-s000000004.parquet": b"c04",
        "consumed/rank00001-g000-e0000-s000000000.parquet": b"c10",
        "metrics/g000-s000000000-000000003.parquet": b"m0",
        "log/rank00000.log": b"l0\n",
        "log/rank00001.log": b"l1\n",
        "bad_steps.jsonl": b"{}\n",
        "ckpt-00000004/state.json": b"ck",  # the checkpoint writer's
        "wandb/offline-run/x": b"w",
        "run.lease": b"lease",
        "consumed/.rank00000-g000-e0000-s000000008.parquet.tmp1": b"partial",
    }
    for rel, data in files.items():
        _write(run, rel, data)
    r0, r1 = RunFiles(run, remote, 0), RunFiles(run, remote, 1)
    rank1 = {"ranks/rank00001.json", "consumed/rank00001-g000-e0000-s000000000.parquet", "log/rank00001.log"}
    published = {k for k in files if not k.startswith(("ckpt-", "wandb/", "run.", "consumed/."))}
    s3_proxy.clear()
    assert r1.publish() == 3 and _puts(s3_proxy) == sorted(rank1)
    s3_proxy.clear()
    assert r0.publish() == 7 and _puts(s3_proxy) == sorted(published - rank1)
    assert _objects(s3_server, remote) == {k: files[k] for k in published}
    assert r0.publish() == 0 and r1.publish() == 0  # nothing changed

    # a checkpoint's interval: new parts, logs grown, bad_steps appended, a new folder (stacks)
    stats, real_stat = [], os.stat
    new = {
        "consumed/rank00000-g000-e0000-s000000008.parquet": b"c08",
        "consumed/rank00001-g000-e0000-s000000004.parquet": b"c14",
        "metrics/g000-s000000004-000000007.parquet": b"m1",
        "stacks/rank00001.txt": b"stack",
    }
    for rel, data in new.items():
        _write(run, rel, data)
    _write(run, "log/rank00000.log", b"more\n", append=True)
    _write(run, "bad_steps.jsonl", b"{}\n", append=True)
    s3_proxy.clear()
    with monkeypatch.context() as m:  # which paths the publishes look at (stat)
        m.setattr(runfiles.os, "stat", lambda p, *a, **k: stats.append(str(p)) or real_stat(p, *a, **k))
        assert r0.publish() == 4 and r1.publish() == 2
    assert _puts(s3_proxy) == sorted([*new, "log/rank00000.log", "bad_steps.jsonl"])
    files.update(new)
    files["log/rank00000.log"] += b"more\n"
    files["bad_steps.jsonl"] += b"{}\n"
    assert _objects(s3_server, remote) == {k: files[k] for k in {*published, *new}}
    # the parts published at the first publish were not looked at again (written once: no stat of them)
    looked = {p.split("/runs/r/", 1)[1] for p in stats if "/runs/r/" in p}
    assert set(new) <= looked
    assert not looked & {k for k in published if k.startswith(("consumed/", "metrics/"))}, sorted(looked)

    # a restart (a fresh publisher, resumed from the mirror) sends nothing S3 already holds: the same size, written
    # before the object's Last-Modified (whole seconds: the files are dated back 2 s, as files of a past run are)
    for f in run.rglob("*"):
        if f.is_file():
            t = f.stat().st_mtime - 2
            os.utime(f, (t, t))
    s3_proxy.clear()
    assert RunFiles(run, remote, 0).publish() == 0
    lists = [parse_qs(urlsplit(p).query).get("prefix", [""])[0] for m, p in s3_proxy.requests if "list-type=2" in p]
    assert lists and all(q.startswith(f"{remote.key}/") and q != f"{remote.key}/" for q in lists), lists
    # what a rank asks of S3 at its start holds its own files, not another rank's (a listing of its own parts, a
    # HEAD of each top-level file)
    assert not [q for q in lists if f"{remote.key}/consumed/rank00001-g000-e0000-s000000000.parquet".startswith(q)]
    assert RunFiles(run, remote, 1).publish() == 0
    assert _puts(s3_proxy) == []
