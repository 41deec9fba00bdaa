"""A takedown of a root in S3 (docs/STORAGE.md, lineage/takedown.py's ``Files``): the same steps worked in the
root's mirror, each file uploaded whole once written.

The reference is the same takedown applied to a copy of the same root on a local folder (tests/lineage/
test_lineage.py checks that one against the shards, sidecars and catalog directly): the objects read back by a
plain boto3 client must equal its files (shards byte for byte, sidecar and index rows), and the catalog merged
from S3 its catalog, the takedown's id (its time) aside."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pyarrow.parquet as pq
from support import sql

from reelcache.base import s3
from reelcache.cli import main


def data_files(root: Path) -> list[Path]:
    skip = ("catalog.duckdb", "view-cache", "duckdb-tmp")
    return [p for p in sorted(root.rglob("*")) if p.is_file() and not p.relative_to(root).as_posix().startswith(skip)]


def read_back(s3_server, root: str, dest: Path) -> Path:
    u, c = s3.parse(root), s3_server.client()
    for page in c.get_paginator("list_objects_v2").paginate(Bucket=u.bucket, Prefix=u.key + "/"):
        for o in page.get("Contents", []):
            p = dest / o["Key"][len(u.key) + 1 :]
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(c.get_object(Bucket=u.bucket, Key=o["Key"])["Body"].read())
    return dest


def content(root: Path) -> dict:
    """Every shard's bytes and every parquet file's rows, the takedown ids (they carry the time) made one."""
    out = {}
    for p in data_files(root):
        rel = re.sub(r"\d{8}T\d{6}Z-[0-9a-f]{8}", "ID", p.relative_to(root).as_posix())
        if p.suffix == ".tar":
            out[rel] = p.read_bytes()
        elif p.suffix == ".parquet":
            rows = pq.read_table(p).to_pylist()
            out[rel] = [
                {k: _same_id(v) for k, v in r.items() if k not in ("withdrawn_at", "withdrawn_by")} for r in rows
            ]
    return out


def _same_id(v):
    return re.sub(r"\d{8}T\d{6}Z-[0-9a-f]{8}", "ID", v) if isinstance(v, str) else v


def test_a_takedown_in_s3_equals_the_same_takedown_on_a_folder(
    s3_server, s3_root, cached_demo, tmp_path, monkeypatch, capsys
):
    cached = cached_demo
    monkeypatch.setenv("REELCACHE_S3_MIRROR", str(tmp_path / "mirror"))
    local = tmp_path / "local"
    shutil.copytree(cached, local)
    u, c = s3.parse(s3_root), s3_server.client()
    for p in data_files(cached):
        c.put_object(Bucket=u.bucket, Key=f"{u.key}/{p.relative_to(cached).as_posix()}", Body=p.read_bytes())
    assert main(["catalog", "merge", "--root", s3_root]) == 0
    # a clip with latents (its video and caption embeddings go too, where nothing else uses them)
    clip = sql(cached, "SELECT clip_id FROM latents WHERE status = 'ok' ORDER BY clip_id LIMIT 1")[0][0]
    before = read_back(s3_server, s3_root, tmp_path / "before")

    # a dry run changes nothing in S3
    assert main(["takedown", "--root", s3_root, clip, "--reason", "request 7"]) == 0
    assert content(read_back(s3_server, s3_root, tmp_path / "dry")) == content(before)

    assert main(["takedown", "--root", str(local), clip, "--reason", "request 7", "--apply"]) == 0
    assert main(["takedown", "--root", s3_root, clip, "--reason", "request 7", "--apply"]) == 0
    out = capsys.readouterr().out
    assert "shards rewritten: " in out and "shards rewritten: 0" not in out
    after = read_back(s3_server, s3_root, tmp_path / "after")
    want, got = content(local), content(after)
    assert sorted(got) == sorted(want)  # the record and journal added, nothing else, no lease left
    changed = [k for k in want if k.endswith(".tar") and want[k] != content(cached).get(k)]
    assert any(k.startswith("raw/") for k in changed) and any(k.startswith("store/") for k in changed)
    assert got == want  # shards with the same holes, sidecars and indexes with the same rows
    mirror = s3.mirror_dir(s3_root)
    assert not list(mirror.rglob("*.tar"))  # the mirror keeps no shard
    q = "SELECT clip_id, status, reject_reason, shard FROM clips ORDER BY clip_id"
    assert sql(mirror, q) == sql(local, q)
    q = "SELECT clip_id, cache, view, status, shard, text_shard FROM latents ORDER BY ALL"
    assert sql(mirror, q) == sql(local, q)
    assert sql(mirror, f"SELECT status, reject_reason, shard FROM clips WHERE clip_id = '{clip}'") == [
        ("rejected", "withdrawn", None)
    ]


def test_lineage_in_s3_equals_lineage_on_a_folder(s3_server, s3_root, cached_demo, tmp_path, monkeypatch, capsys):
    """A run's consumed log and checkpoints (written by the trainer's own ConsumedLog) in S3: `lineage --root s3://`
    finds the same manifests, runs, steps and checkpoints as over the same files on a folder."""
    import json

    from reelcache.train.loader import ConsumedLog

    monkeypatch.setenv("REELCACHE_S3_MIRROR", str(tmp_path / "mirror"))
    local = tmp_path / "local"
    shutil.copytree(cached_demo, local)
    clips = [r[0] for r in sql(local, "SELECT clip_id FROM clips WHERE status = 'ok' ORDER BY 1")][:6]
    run = local / "runs/r1"
    for rank in range(2):
        log = ConsumedLog(run / "consumed", rank, every=2)
        for step in range(4):
            log.add(0, step, [clips[(step * 2 + rank) % 6]], "b", pad=False)
        log.flush()
    for gs in (2, 4):
        (run / f"ckpt-{gs:08d}").mkdir()
        (run / f"ckpt-{gs:08d}/state.json").write_text(json.dumps({"global_step": gs, "loader": {"step": gs}}))
    u, c = s3.parse(s3_root), s3_server.client()
    for p in data_files(local):
        c.put_object(Bucket=u.bucket, Key=f"{u.key}/{p.relative_to(local).as_posix()}", Body=p.read_bytes())
    assert main(["catalog", "merge", "--root", s3_root]) == 0
    capsys.readouterr()
    assert main(["lineage", "--root", str(local), "--json", *clips[:3]]) == 0
    want = json.loads(capsys.readouterr().out)
    assert main(["lineage", "--root", s3_root, "--json", *clips[:3]]) == 0
    got = json.loads(capsys.readouterr().out)
    assert [r["run"] for it in want for r in it["runs"]] == ["r1"] * 3 and got == want
