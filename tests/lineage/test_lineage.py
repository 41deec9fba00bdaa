"""`reelcache lineage` and `reelcache takedown` over a real root: the ingested demo, a second source holding a
copy of one video under another name, a tiny cache of 6 clips (2 views, the content-addressed store), its
loader manifest and a training run of 3 steps (checkpoints 2 and 3). Every answer is checked against facts read
without the commands: tar members (tarfile), the consumed log and manifests (pyarrow), the checkpoints'
state.json, the source video files' bytes (hashlib), and a copy of the root taken before a takedown."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from support import CONFIG, REPO, quiet_env, tiny_cache_config, train

from reelcache.cli import main

pytestmark = pytest.mark.slow  # a cache and a training run, once for the module

CKPTS = ["ckpt-00000002", "ckpt-00000003"]


def _rc(*args: str, ok: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run([sys.executable, "-m", "reelcache", *map(str, args)], cwd=REPO, env=quiet_env(),
                       capture_output=True, text=True)  # fmt: skip
    assert (p.returncode == 0) == ok, (p.stdout + p.stderr)[-3000:]
    return p


def _copy_source(root: Path, tmp: Path, name: str, video: Path, caption: str, merge: bool = True) -> None:
    """Ingest one file, a byte copy of `video` under another name, as source `name` (format csv); with
    `merge`, merge the catalog."""
    d = tmp / name
    d.mkdir(parents=True)
    shutil.copyfile(video, d / f"renamed-{name}{video.suffix}")
    (d / "t.csv").write_text(f'path,text\nrenamed-{name}{video.suffix},"{caption}"\n')
    units = _rc("ingest", "plan", "--root", root, "--source", "csv", "--name", name, "--meta", d / "t.csv",
                "--videos", d).stdout.split()  # fmt: skip
    assert main(["ingest", "run", "--root", str(root), *units]) == 0
    if merge:
        assert main(["catalog", "merge", "--root", str(root)]) == 0


@pytest.fixture(scope="module")
def root(ingested, tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("lineage")
    root = base / "root"
    shutil.copytree(ingested, root)
    six = "clip_id IN (SELECT clip_id FROM clips WHERE status = 'ok' AND codec = 'h264' ORDER BY clip_id LIMIT 6)"
    _rc("catalog", "manifest", "--root", root, "--name", "m", "--where", six)
    cfg = tiny_cache_config(root / "cache.toml", "m")
    units = _rc("cache", "plan", "--root", root, "--config", cfg).stdout.split()
    _rc("cache", "run", "--root", root, "--device", "cpu", *units)
    _rc("catalog", "merge", "--root", root)
    _rc("catalog", "manifest", "--root", root, "--name", "lat", "--cache", "t")
    args = ["--run.name=r", '--data.manifests=[{name="lat"}]', "--run.max_steps=3", "--run.epochs=2",
            "--data.workers=0", "--log.wandb_mode=disabled", "--checkpoint.every=2"]  # fmt: skip
    train(root, args, timeout=300)
    assert sorted(p.name for p in (root / "runs/r").glob("ckpt-*")) == CKPTS
    # eval's layout (runs/<run>/eval/ckpt-*/<preset>/sample_<i>.mp4): what lineage lists for a checkpoint
    (root / "runs/r/eval/ckpt-00000002/debug").mkdir(parents=True)
    (root / "runs/r/eval/ckpt-00000002/debug/sample_0.mp4").write_bytes(b"not a video")
    first = _trained(root)[0]
    _copy_source(root, base, "copies", _video(root, first), "another caption")
    return root


def _trained(root: Path) -> list[str]:
    """Clip ids of the consumed log, read with pyarrow, in (step, clip) order."""
    t = pq.read_table(root / "runs/r/consumed").to_pylist()
    return [r["clip_id"] for r in sorted(t, key=lambda r: (r["epoch"], r["step"], r["clip_id"])) if not r["pad"]]


def _clip(root: Path, clip_id: str) -> dict:
    import duckdb

    with duckdb.connect(str(root / "catalog.duckdb"), read_only=True) as db:
        rel = db.execute("SELECT * FROM clips WHERE clip_id = ?", [clip_id])
        return dict(zip([d[0] for d in rel.description], rel.fetchone()))


def _video(root: Path, clip_id: str) -> Path:
    return Path(_clip(root, clip_id)["path"])


def _lineage(root: Path, *args) -> list[dict]:
    return json.loads(_rc("lineage", "--root", root, *args, "--json").stdout)


def _members(path: Path) -> dict[str, tuple[int, bytes]]:
    with tarfile.open(path) as t:
        return {m.name: (m.offset_data, t.extractfile(m).read()) for m in t if m.name != "__withdrawn__"}


def test_lineage_matches_shards_logs_manifests_and_checkpoints(root):
    trained = _trained(root)
    files = sorted((root / "manifests").glob("*.parquet"))
    ids = sorted({c for f in files for c in pq.read_table(f, columns=["clip_id"])["clip_id"].to_pylist()})
    (root / "ids.txt").write_text("\n".join(ids) + "\n")
    items = {it["clip_id"]: it for it in _lineage(root, "--file", root / "ids.txt")}
    assert sorted(items) == ids
    (index,) = (root / "runs/r/lineage").glob("seg-*.json")  # the CLI indexed the log (lineage/index.py)
    assert sorted(json.loads(index.read_text())["parts"]) == sorted(
        p.name for p in (root / "runs/r/consumed").iterdir()
    )
    log = pq.read_table(root / "runs/r/consumed").to_pylist()
    states = {c: json.loads((root / "runs/r" / c / "state.json").read_text())["global_step"] for c in CKPTS}
    manifests = {p: set(pq.read_table(p, columns=["clip_id"])["clip_id"].to_pylist())
                 for p in (root / "manifests").glob("*.parquet")}  # fmt: skip
    for cid, it in items.items():
        row, m = _clip(root, cid), it["member"]
        members = _members(root / m["shard"])
        assert members[f"{cid}.{row['ext']}"] == (m["offset"], _video(root, cid).read_bytes())
        assert it["content_hash"] == hashlib.blake2b(_video(root, cid).read_bytes(), digest_size=32).hexdigest()
        want = sorted(str(p.relative_to(root)) for p, clips in manifests.items() if cid in clips)
        assert sorted(x["path"] for x in it["manifests"]) == want
        for lat in it["latents"]:  # the store's member at that offset is that latent
            with tarfile.open(root / lat["shard"]) as t:
                (name,) = [x.name for x in t if x.offset_data == lat["shard_offset"]]
            assert name == f"{lat['video_key']}.safetensors"
        steps = sorted((r["epoch"], r["step"], r["rank"]) for r in log if r["clip_id"] == cid and not r["pad"])
        got = [s for run in it["runs"] for s in run["steps"]]
        assert sorted((s["epoch"], s["step"], s["rank"]) for s in got) == steps
        for s in got:  # one epoch of 3 steps from step 0: the global step is the epoch's step
            first = min((c for c, g in states.items() if g > s["step"]), key=states.get)
            assert (s["global_step"], s["checkpoint"]) == (s["step"], first)
            assert s["samples"] == (["runs/r/eval/ckpt-00000002/debug/sample_0.mp4"] if first == CKPTS[0] else [])
        assert bool(got) == (cid in trained)
    # the same video under another name (source `copies`), found by its bytes and by --like
    first = trained[0]
    (copy,) = items[first]["same_content"]
    assert _clip(root, copy)["source"] == "copies"
    assert [it["clip_id"] for it in _lineage(root, "--like", _video(root, first))] == sorted([first, copy])
    # a catalog ingested before clips had a content hash (migrated: NULL): --like hashes the raw members
    import duckdb

    old = root.parent / "pre-hash"
    shutil.copytree(root, old)
    with duckdb.connect(str(old / "catalog.duckdb")) as db:
        db.execute("UPDATE clips SET content_hash = NULL")
    assert [it["clip_id"] for it in _lineage(old, "--like", _video(root, first))] == sorted([first, copy])
    shutil.rmtree(old)
    # bad input: one line, exit 2, nothing else
    p = _rc("lineage", "--root", root, "no-such-clip", ok=False)
    assert p.returncode == 2 and p.stderr.strip().splitlines() == [
        f"reelcache: error: no clip 'no-such-clip' in the catalog of {root}"
    ]
    p = _rc("lineage", "--root", root, "--where", "nosuchcolumn = 1", ok=False)
    assert len(p.stderr.strip().splitlines()) == 1 and "--where" in p.stderr


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _tars(root: Path) -> list[Path]:
    return sorted(p for sub in ("raw", "store", "latents") for p in (root / sub).rglob("*.tar"))


def _rows(root: Path, table: str, order: str, drop=()) -> list[dict]:
    import duckdb

    with duckdb.connect(str(root / "catalog.duckdb"), read_only=True) as db:
        rel = db.execute(f"SELECT * FROM {table} ORDER BY {order}")
        cols = [d[0] for d in rel.description]
        return [{k: v for k, v in zip(cols, r) if k not in drop} for r in rel.fetchall()]


@pytest.fixture(scope="module")
def taken(root, tmp_path_factory):
    """A copy of the root before, and a copy after `takedown --like <the first trained clip's video> --apply`."""
    base = tmp_path_factory.mktemp("takedown")
    before, after = base / "before", base / "after"
    shutil.copytree(root, before)
    shutil.copytree(root, after)
    video = _video(root, _trained(root)[0])
    dry = _rc("takedown", "--root", after, "--like", video, "--reason", "removal request #1234")
    assert _snapshot(after) == _snapshot(before)  # a dry run changes nothing
    assert "dry run" in dry.stderr
    out = _rc("takedown", "--root", after, "--like", video, "--reason", "removal request #1234", "--apply", "--json")
    plan = json.loads(out.stdout[out.stdout.index("{") :])
    return before, after, video, plan


def test_takedown_removes_the_clip_everywhere_and_nothing_else(taken):
    before, after, video, plan = taken
    gone = {c["clip_id"] for c in plan["clips"]}
    assert len(gone) == 2  # the clip and its copy under another name
    removed_keys = set(gone)
    for c in plan["latents"]:
        if c["video_key"]:
            removed_keys.add(c["video_key"])
    for tar in _tars(before):
        rel = tar.relative_to(before)
        old, new = _members(tar), _members(after / rel)
        assert (after / rel).stat().st_size == tar.stat().st_size
        assert set(new) <= set(old)
        assert {n: v for n, v in old.items() if n in new} == new  # every other member: same offset, same bytes
        for n in set(old) - set(new):  # what went is the withdrawn clips' samples, their latents and captions
            key = n.split(".")[0]
            assert key in removed_keys or key in plan["text_removed"], n
    # the raw members, latents and the caption only the clip used are gone
    for c in plan["clips"]:
        assert all(not n.startswith(c["clip_id"]) for n in _members(after / c["shard"]))
    assert plan["text_removed"] and plan["latents"]
    # the catalog: the other clips' rows as before (but the difficulty levels, recomputed over ok clips)
    drop = ("level", "noun_pct")
    others = [r for r in _rows(before, "clips", "clip_id", drop) if r["clip_id"] not in gone]
    assert [r for r in _rows(after, "clips", "clip_id", drop) if r["clip_id"] not in gone] == others
    lat_before = [r for r in _rows(before, "latents", "clip_id, view") if r["clip_id"] not in gone]
    assert [r for r in _rows(after, "latents", "clip_id, view") if r["clip_id"] not in gone] == lat_before
    for r in _rows(after, "clips", "clip_id"):
        if r["clip_id"] in gone:
            assert (r["status"], r["reject_reason"], r["shard"]) == ("rejected", "withdrawn", None)
    record = _rows(after, "withdrawn", "clip_id")
    want_hash = hashlib.blake2b(Path(video).read_bytes(), digest_size=32).hexdigest()
    assert [(r["clip_id"], r["content_hash"], r["reason"]) for r in record] == [
        (c, want_hash, "removal request #1234") for c in sorted(gone)
    ]
    # frozen manifests stay as they were; a new one leaves the clips out
    assert all((after / p.relative_to(before)).read_bytes() == p.read_bytes() for p in before.glob("manifests/*"))
    _rc("catalog", "manifest", "--root", after, "--name", "fresh", "--cache", "t")
    (fresh,) = after.glob("manifests/fresh-*.parquet")
    ids = set(pq.read_table(fresh)["clip_id"].to_pylist())
    assert ids and not ids & gone
    # lineage says so, and names the checkpoints that trained on it
    (it,) = [x for x in _lineage(after, *sorted(gone)) if x["runs"]]
    assert it["withdrawn"]["takedown"] == plan["id"] and it["runs"][0]["checkpoints"] == CKPTS
    assert plan["runs"] == {"r": CKPTS}
    # the viewer's Clip page says so too (view/templates/lineage.html), without writing anything
    from starlette.testclient import TestClient

    from reelcache.view.server import build_app

    app = build_app(after)
    try:
        page = TestClient(app, base_url="http://127.0.0.1:8050").get("/clip", params={"id": it["clip_id"]}).text
    finally:
        app.state.store.close()
    assert f"WITHDRAWN by takedown {plan['id']}: removal request #1234" in page
    assert f"Checkpoints that saw it: {', '.join(CKPTS)}" in page
    assert '<section id="clip-lineage">' in page and '<table id="lineage">' in page
    # again: nothing to do, nothing changes
    snap = _snapshot(after)
    out = _rc("takedown", "--root", after, "--like", video, "--reason", "again", "--apply")
    assert "already" in out.stderr and _snapshot(after) == snap


def test_ingest_refuses_the_withdrawn_video_under_another_name(taken, tmp_path):
    _, after, video, plan = taken
    _copy_source(after, tmp_path, "again", video, "yet another caption")
    (row,) = [r for r in _rows(after, "clips", "clip_id") if r["source"] == "again"]
    assert (row["status"], row["reject_reason"]) == ("rejected", "withdrawn")
    assert plan["id"] in row["reject_detail"]


def test_a_killed_takedown_is_finished_by_running_it_again(root, taken, tmp_path):
    """Killed after its journal and record and one rewritten shard, with a half-written temporary beside
    another: every shard is whole, and `takedown --apply` finishes it to the same shards as an uninterrupted one."""
    from reelcache.catalog.sql import read_only_connection
    from reelcache.lineage import holes, takedown

    _, after, video, _ = taken
    work = tmp_path / "root"
    shutil.copytree(root, work)
    with read_only_connection(work) as con:
        j = takedown.plan(con, work, [_trained(root)[0]], "removal request #1234")
    takedown._journal(takedown.Files(work), j)
    takedown._record(takedown.Files(work), j)
    first, second = sorted(j["holes"])[:2]
    holes.punch(work / first, [(s, e) for s, e, _ in j["holes"][first]])
    (work / second).with_name(f".{Path(second).name}.takedown99999").write_bytes(b"half a copy")
    for tar in _tars(work):  # every shard whole: tarfile reads each to its end
        _members(tar)
    from reelcache.base import lease

    held = lease.acquire(work / "withdrawn" / takedown.LEASE)  # another takedown being applied: refused
    try:
        p = _rc("takedown", "--root", work, "--like", video, "--reason", "removal request #1234", "--apply", ok=False)
        (line,) = p.stderr.strip().splitlines()
        assert line.startswith(f"reelcache: error: another takedown is being applied to {work} (host ")
        assert f" pid {os.getpid()} " in line and line.endswith(": wait for it")
        assert (work / second).with_name(f".{Path(second).name}.takedown99999").exists()
    finally:
        held.release()
    _rc("takedown", "--root", work, "--like", video, "--reason", "removal request #1234", "--apply")
    assert not list(work.rglob(".*.takedown*"))
    for tar in _tars(work):
        assert tar.read_bytes() == (after / tar.relative_to(work)).read_bytes(), tar
    drop = ("reject_detail", "level", "noun_pct")
    ingested_since = {"again"}  # a source test_ingest_refuses... added to `after`
    want = [r for r in _rows(after, "clips", "clip_id", drop) if r["source"] not in ingested_since]
    assert _rows(work, "clips", "clip_id", drop) == want


def test_a_takedown_keeps_what_a_frozen_plan_uses_and_withdraws_copies_unmerged_or_merged_since(root, tmp_path):
    """A caption embedding only a frozen cache plan still uses (another clip's, same caption) is kept; copies of
    the video in ingest units not yet merged are withdrawn: one sharded before `takedown --apply` (merged before
    planning), one sharded after a takedown was planned (found by its finish); the viewer's thumbnail and
    window preview of the clip are deleted, and its input file is not served any more (410)."""
    from starlette.testclient import TestClient

    from reelcache.catalog.sql import read_only_connection
    from reelcache.catalog.withdrawn import view_cache_files
    from reelcache.lineage import takedown
    from reelcache.view.server import build_app

    work = tmp_path / "root"
    shutil.copytree(root, work)
    a = _trained(root)[0]
    ha = _clip(root, a)["content_hash"]
    b = next(c for c in _trained(root) if _clip(root, c)["content_hash"] != ha)
    hashes = {ha, _clip(root, b)["content_hash"]}
    other = next(r for r in _rows(root, "clips", "clip_id") if r["status"] == "ok" and r["content_hash"] not in hashes
                 and r["ext"] == "mp4")  # fmt: skip
    # another video with a's caption, planned (not run) in a second cache: its plan reuses a's caption embedding
    _copy_source(work, tmp_path, "same-text", Path(other["path"]), _clip(root, a)["text"])
    _rc("catalog", "manifest", "--root", work, "--name", "x", "--where", "source = 'same-text'")
    _rc("cache", "plan", "--root", work, "--config", tiny_cache_config(tmp_path / "t2.toml", "x", "t2"))
    (tloc,) = {(r["text_shard"], r["text_offset"], r["text_key"]) for r in _rows(root, "latents", "view")
               if r["clip_id"] == a}  # fmt: skip
    planned = pq.read_table(work / "latents/t2/_plan/input.parquet").to_pylist()
    assert {(r["text_shard"], r["text_offset"]) for r in planned} == {tloc[:2]}
    caption_member = {n: v for n, v in _members(root / tloc[0]).items() if n.startswith(tloc[2])}
    assert caption_member
    # the viewer's files of a, made on request
    videos = [str(Path(_clip(root, a)["path"]).parent), str(tmp_path)]
    client = TestClient(build_app(work, videos=videos), base_url="http://127.0.0.1:8050")
    assert client.get("/media/thumb", params={"id": a}).status_code == 200
    assert client.get("/media/window", params={"id": a, "cache": "t", "view": 0}).status_code == 200
    assert len(view_cache_files(work, a)) == 2
    client.app.state.store.close()
    # b: planned, then a copy is sharded (not merged), then the takedown is applied: the copy goes too
    with read_only_connection(work) as con:
        jb = takedown.plan(con, work, [b], "removal request #2")
    _copy_source(work, tmp_path, "late-b", _video(root, b), "a copy of b", merge=False)
    takedown._journal(takedown.Files(work), jb)
    jb = takedown.finish(work, jb)
    (late_b,) = [r["clip_id"] for r in _rows(work, "clips", "clip_id") if r["source"] == "late-b"]
    (follow,) = jb["followed_by"]
    assert [c["clip_id"] for c in json.loads((work / f"withdrawn/{follow}.json").read_text())["clips"]] == [late_b]
    assert json.loads((work / f"withdrawn/{follow}.json").read_text())["done"]
    # a: a copy sharded before the takedown, not merged: merged before planning, withdrawn with it
    _copy_source(work, tmp_path, "late-a", _video(root, a), "a copy of a", merge=False)
    out = _rc("takedown", "--root", work, "--like", _video(root, a), "--reason", "request #1", "--apply", "--json")
    ja = json.loads(out.stdout[out.stdout.index("{") :])
    (late_a,) = [r["clip_id"] for r in _rows(work, "clips", "clip_id") if r["source"] == "late-a"]
    assert late_a in {c["clip_id"] for c in ja["clips"]} and not ja.get("followed_by")
    for cid in (late_a, late_b, a, b):
        row = _clip(work, cid)
        assert (row["status"], row["reject_reason"], row["shard"]) == ("rejected", "withdrawn", None)
    jf = json.loads((work / f"withdrawn/{follow}.json").read_text())
    for c in jb["clips"] + jf["clips"] + ja["clips"]:  # their raw members are holes
        shard = c["shard"]
        assert not [n for n in _members(work / shard) if n.startswith(c["clip_id"])], (c, shard)
    # a's caption embedding: kept, byte for byte, where t2's plan will read it
    assert tloc[2] in ja["text_kept"] and tloc[2] not in ja["text_removed"]
    assert {n: v for n, v in _members(work / tloc[0]).items() if n.startswith(tloc[2])} == caption_member
    # the viewer: a's previews are gone; its input file (and the copy's) is refused, in one line
    assert view_cache_files(work, a) == [] and (work / "view-cache/thumbs").is_dir()
    client = TestClient(build_app(work, videos=videos), base_url="http://127.0.0.1:8050")
    try:
        for cid in (a, late_a):
            r = client.get("/media/input", params={"id": cid})
            assert r.status_code == 410 and "withdrawn" in r.text and "\n" not in r.text
            page = client.get("/reject", params={"id": cid}).text
            assert "/media/input" not in page and "was withdrawn" in page
    finally:
        client.app.state.store.close()


def test_training_over_a_withdrawn_clip_refuses_then_skips_it_with_resume_exact(taken):
    from support import FakePar

    from reelcache import UserError
    from reelcache.train.config import load_config
    from reelcache.train.loader import LatentLoader

    _, after, _, plan = taken
    gone = {c["clip_id"] for c in plan["clips"]}
    args = ["--run.name=r", '--data.manifests=[{name="lat"}]', "--run.epochs=2", "--data.workers=0",
            "--log.wandb_mode=disabled", "--checkpoint.every=2"]  # fmt: skip
    cfg = load_config(CONFIG, args)
    with pytest.raises(UserError) as e:  # what `reelcache train` says in one line, before any model is built
        cfg.data.build(root=after, par=FakePar(), seed=cfg.run.seed)
    assert plan["id"] in str(e.value) and "--data.skip_withdrawn" in str(e.value) and "\n" not in str(e.value)
    train(after, [*args, "--load", "latest", "--data.skip_withdrawn=true"], timeout=300)
    rows = pq.read_table(after / "runs/r/consumed").to_pylist()
    newest = {}
    for r in rows:
        k = (r["epoch"], r["step"])
        newest[k] = max(newest.get(k, 0), r["generation"])
    trained = [r for r in rows if r["generation"] == newest[(r["epoch"], r["step"])] and not r["pad"]]
    epoch1 = sorted(r["clip_id"] for r in trained if r["epoch"] == 1)
    # every clip of the manifest but the withdrawn one, once, in the order the unchanged plan gives
    loader = LatentLoader(["lat"], cfg.data.bucket_config(), root=after, seed=cfg.run.seed, read=False)
    loader.epoch = 1
    planned = [c for i in range(loader.plan().num_batches) for c in loader.clip_id[loader.plan().batch(i)]]
    assert epoch1 == sorted(c for c in planned if c not in gone)
    assert gone & set(loader.clip_id) and not gone & set(epoch1)
    resumed = [r for r in trained if r["generation"] == 1]
    assert resumed and not gone & {r["clip_id"] for r in resumed}
