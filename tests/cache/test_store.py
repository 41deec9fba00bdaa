"""The content-addressed latent store (cache/store.py): captions stored once, latents reused across caches
and re-plans, encoders called only for what is new, gc; each checked against counts from the catalog or a
fresh encode in another root, never against the store's own index."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
from support import cache_config, cache_plan, sql

from reelcache.cli import main

SHORT = "[buckets.144p]\n9 = [1.0, 2]\n"  # 9-frame windows at 144p: quick units on CPU
SOME = "hash(clip_id) % 3 = 0"  # about a third of the demo's clips: quick tests


@pytest.fixture()
def counted(monkeypatch):
    """Clips the VAE encodes and captions the text encoder encodes (the real methods, wrapped)."""
    from reelcache.cache.encoders import TextEncoder, VideoEncoder

    seen = {"clips": 0, "texts": []}
    venc, tenc = VideoEncoder.encode, TextEncoder.encode

    def video(self, frames):
        seen["clips"] += len(frames)
        return venc(self, frames)

    def text(self, texts):
        seen["texts"] += list(texts)
        return tenc(self, texts)

    monkeypatch.setattr(VideoEncoder, "encode", video)
    monkeypatch.setattr(TextEncoder, "encode", text)
    return seen


def _run(root, config, seen=None) -> None:
    if seen is not None:
        seen["clips"], seen["texts"] = 0, []
    units = cache_plan(root, config)
    assert main(["cache", "run", "--root", str(root), *units]) == 0
    assert main(["catalog", "merge", "--root", str(root)]) == 0


def _manifest(root, name, where):
    from reelcache.catalog.manifest import make_manifest

    make_manifest(root, name, where)


def _members(root: Path, kind: str) -> int:
    """Members of the store's shards of `kind`, counted in the tars themselves."""
    n = 0
    for p in (root / "store" / kind).rglob("*.tar"):
        with tarfile.open(p) as t:
            n += sum(1 for m in t if m.isfile())
    return n


@pytest.mark.slow  # end to end over the ingested demo
def test_each_caption_is_stored_once_and_every_sample_reads_it(fresh_root, tmp_path):
    """A K = 2 cache over clips sharing captions across units: caption embeddings in the store = distinct
    captions of the clips it planned a latent for, counted from the catalog; each row reads its own."""
    import torch

    from reelcache.base.latents import read_latent
    from reelcache.cache.encoders import TextEncoder
    from reelcache.cache.spec import EncoderSpec
    from reelcache.catalog.db import open_catalog

    con = open_catalog(fresh_root, write=True)
    try:  # three captions over every clip: each used in several units
        con.execute(
            "UPDATE clips SET text = "
            "['a dog runs', 'a red car at night', 'rain'][(1 + hash(clip_id || 'c') % 3)::BIGINT]"
        )
    finally:
        con.close()
    _manifest(fresh_root, "m", SOME)
    (tmp_path / "b.toml").write_text(SHORT)
    cfg = cache_config(tmp_path, "m", clips_per_unit=4, buckets=tmp_path / "b.toml")
    cfg.write_text(cfg.read_text().replace("batch_size = 2", "batch_size = 2\nviews = 2"))
    _run(fresh_root, cfg)
    ((pairs,),) = sql(
        fresh_root,
        "SELECT count(DISTINCT c.text) FROM clips c JOIN latents l USING (clip_id) WHERE l.bucket IS NOT NULL",
    )
    assert pairs >= 2 and _members(fresh_root, "text") == pairs
    rows = sql(
        fresh_root,
        "SELECT l.shard, l.shard_offset, l.text_shard, l.text_offset, c.text FROM latents l JOIN clips c "
        "USING (clip_id) WHERE l.status = 'ok'",
    )
    text = TextEncoder(EncoderSpec("t5", tiny=True, dtype="float32"))
    want = {c: text.encode([c])[0] for c in ("a dog runs", "a red car at night", "rain")}
    assert len(rows) > pairs  # captions shared by samples
    for shard, off, ts, to, caption in rows:
        got = read_latent(fresh_root, {"shard": shard, "shard_offset": off, "text_shard": ts, "text_offset": to})
        assert torch.equal(got["text"], want[caption]) and "mean" in got


@pytest.mark.slow  # end to end over the ingested demo
def test_growth_reuse_and_gc(fresh_root, ingested, tmp_path, counted):
    """A superset manifest encodes exactly the new clips and their new captions; a changed caption exactly
    one text; a new text encoder text only; a second cache reuses latents bit-equal to a fresh encode of
    the same draws in another root; gc finds what nothing references."""
    import torch

    from reelcache.base.buckets import BucketConfig
    from reelcache.base.latents import read_latent
    from reelcache.catalog.db import open_catalog
    from reelcache.train.loader import LatentLoader

    (tmp_path / "b.toml").write_text(SHORT)
    b = tmp_path / "b.toml"
    half = f"{SOME} AND hash(clip_id) % 2 = 0"
    _manifest(fresh_root, "m1", half)
    _run(fresh_root, cache_config(tmp_path, "m1", name="a", clips_per_unit=4, buckets=b), counted)
    old = dict(sql(fresh_root, "SELECT clip_id, text FROM clips WHERE clip_id IN (SELECT clip_id FROM latents)"))
    ((first,),) = sql(fresh_root, "SELECT count(*) FROM latents WHERE status = 'ok'")
    assert counted["clips"] == first > 0 and sorted(counted["texts"]) == sorted(set(old.values()))

    _manifest(fresh_root, "m2", SOME)  # the superset: cache "a" re-planned over it
    _run(fresh_root, cache_config(tmp_path, "m2", name="a", clips_per_unit=4, buckets=b), counted)
    new = sql(fresh_root, "SELECT clip_id, text FROM clips WHERE clip_id IN (SELECT clip_id FROM latents)")
    new = {c: t for c, t in new if c not in old}
    ((ok,),) = sql(fresh_root, "SELECT count(*) FROM latents WHERE status = 'ok' AND cache = 'a'")
    assert new and counted["clips"] == ok - first == len(new)  # views = 1: a latent per new clip
    assert sorted(counted["texts"]) == sorted(set(new.values()) - set(old.values()))

    clip = sorted(old)[0]
    con = open_catalog(fresh_root, write=True)
    try:
        con.execute("UPDATE clips SET text = 'a brand new caption' WHERE clip_id = ?", [clip])
    finally:
        con.close()
    _manifest(fresh_root, "m3", SOME)
    _run(fresh_root, cache_config(tmp_path, "m3", name="a", clips_per_unit=4, buckets=b), counted)
    assert counted["clips"] == 0 and counted["texts"] == ["a brand new caption"]
    assert main(["catalog", "manifest", "--root", str(fresh_root), "--name", "lat", "--cache", "a"]) == 0

    # a new text encoder (its seed): text only; the same identity under another name: nothing at all
    cfg = cache_config(tmp_path, "m1", name="t5b", clips_per_unit=4, buckets=b)
    cfg.write_text(cfg.read_text().replace('kind = "t5"', 'kind = "t5"\nseed = 1'))
    _run(fresh_root, cfg, counted)
    assert counted["clips"] == 0 and sorted(counted["texts"]) == sorted(set(old.values()))
    _run(fresh_root, cache_config(tmp_path, "m1", name="c", clips_per_unit=4, buckets=b), counted)
    assert counted["clips"] == 0 and counted["texts"] == []

    other = tmp_path / "other"  # the same draws encoded afresh in another root
    shutil.copytree(ingested, other)
    _manifest(other, "m1", half)
    _run(other, cache_config(tmp_path, "m1", name="c", clips_per_unit=4, buckets=b), counted)
    assert counted["clips"] == first
    q = "SELECT clip_id, shard, shard_offset, text_shard, text_offset, reused FROM latents WHERE cache = 'c' ORDER BY 1"
    here, there = sql(fresh_root, q), sql(other, q)
    assert [r[0] for r in here] == [r[0] for r in there] and all(r[5] for r in here if r[1])
    for h, t in zip(here, there):
        if h[1] is None:
            continue
        cols = ("shard", "shard_offset", "text_shard", "text_offset")
        x, y = (read_latent(root, dict(zip(cols, r[1:5]))) for root, r in ((fresh_root, h), (other, t)))
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)

    # gc: cache c (over m1, made before the change) still uses the old caption: nothing is garbage. Dropping
    # caches t5b and c leaves t5b's captions and the old caption unreferenced.
    from reelcache.cache.gc import gc

    assert gc(fresh_root)["entries"] == 0
    shutil.rmtree(fresh_root / "latents" / "t5b")
    shutil.rmtree(fresh_root / "latents" / "c")
    texts = _members(fresh_root, "text")
    got = gc(fresh_root, delete=True)
    dropped = len(set(old.values()))
    assert got["entries"] == 1 + dropped and _members(fresh_root, "text") == texts - dropped
    assert gc(fresh_root)["entries"] == 1  # the old caption shares its shard with live ones: kept
    assert main(["cache", "gc", "--root", str(fresh_root)]) == 0
    loader = LatentLoader(["lat"], BucketConfig.from_toml(b), root=fresh_root)  # cache a still loads whole
    assert sum(len(x["clip_id"]) for x in loader) == ok


# -- one clip, two views in one bucket: the store read directly -------------------------------------
ONE = "clip_id = (SELECT min(clip_id) FROM clips WHERE status = 'ok')"  # one clip: quick units on CPU


def _config(tmp_path, name: str, views: int = 2, seed: int = 0) -> Path:
    (tmp_path / "b.toml").write_text(SHORT)  # one bucket, 9 frames: two views differ in their window only
    cfg = cache_config(tmp_path, "one", name=name, seed=seed, clips_per_unit=4, buckets=tmp_path / "b.toml")
    cfg.write_text(cfg.read_text().replace("batch_size = 2", f"batch_size = 2\nviews = {views}"))
    return cfg


def _plan(root, cfg) -> list[str]:
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["cache", "plan", "--root", str(root), "--config", str(cfg)]) == 0
    return out.getvalue().split()


def _sidecar(root: Path, cache: str) -> list[dict]:
    import pyarrow.parquet as pq

    return [r for p in sorted((root / "latents" / cache).glob("[0-9]*.parquet")) for r in pq.read_table(p).to_pylist()]


def stored(root: Path, shard: str, offset: int) -> tuple[str, dict]:
    """The store entry at (shard, offset), read with tarfile and safetensors, not reelcache: the tar
    member whose data starts there, its name and its tensors."""
    from safetensors.torch import load

    with tarfile.open(root / shard) as t:
        (m,) = [m for m in t if m.isfile() and m.offset_data == offset]
        return m.name, load(t.extractfile(m).read())


def assert_readable(root: Path, rows: list[dict]) -> None:
    """Every `ok` row's latent and caption embedding are in the store where the row says, under its keys."""
    ok = [r for r in rows if r["status"] == "ok"]
    assert ok
    for r in ok:
        name, got = stored(root, r["shard"], r["shard_offset"])
        assert name == f"{r['video_key']}.safetensors" and list(got["mean"].shape) == list(r["shape"]), r
        name, got = stored(root, r["text_shard"], r["text_offset"])
        assert name == f"{r['text_key']}.safetensors" and got["text"].shape[0] == r["text_len"], r


def test_a_run_that_lost_its_lease_publishes_and_deletes_nothing_in_the_store(tmp_path):
    """Each way a unit writes or deletes in the store, once another run took its lease over and wrote
    its own shards and indexes under the same names: closing a shard and publishing an index raise
    LostLease; aborting the writer and clearing the unit's store files delete nothing but the run's own
    temporary. The store is byte-equal to a copy taken after the takeover."""
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    from reelcache.base.lease import LostLease
    from reelcache.base.shards import ShardWriter
    from reelcache.base.units import begin_unit
    from reelcache.cache.store import VIDEO_INDEX, clear_store_unit, store_dir, write_index

    (tmp_path / "latents" / "t").mkdir(parents=True)
    claim = begin_unit(tmp_path / "latents" / "t", 0)
    stem, dirs = "000000-abcd1234", [store_dir(tmp_path, k, "t") for k in ("video", "text")]
    for d in dirs:
        d.mkdir(parents=True)
    writer = ShardWriter(dirs[0], stem, 1, fsync=False, claim=claim)  # a shard a sample
    for key in ("k0", "k1"):  # shard 00 published, 01 in progress
        writer.write_sample(key, [("safetensors", b"ours", None)])
    lease = claim.sidecar.with_suffix(".lease")  # another node takes the unit over and publishes its own
    lease.write_text(json.dumps(json.loads(lease.read_text()) | {"host": "gpu-node-3", "token": "theirs"}))
    theirs = ShardWriter(dirs[0], stem, 1 << 20, fsync=False)
    theirs.write_sample("k1", [("safetensors", b"theirs", None)])  # their shard 00
    theirs.close()
    row = {"video_key": "k1", "shard": f"store/video/t/{stem}-00.tar", "shard_offset": 512, "shape": [1]}
    pq.write_table(pa.Table.from_pylist([row | {"bytes": 6}], schema=VIDEO_INDEX), dirs[0] / f"{stem}.parquet")
    (dirs[1] / f"{stem}-00.tar").write_bytes(b"their captions")
    files = lambda: {p: p.read_bytes() for p in (tmp_path / "store").rglob("*") if p.is_file()}  # noqa: E731
    before = {p: data for p, data in files().items() if p != writer.tmp}  # all but our shard in progress
    with pytest.raises(LostLease, match="gpu-node-3"):
        writer.close()
    writer.abort()
    with pytest.raises(LostLease, match="lost the lease"):
        write_index(dirs[0] / f"{stem}.parquet", [row | {"video_key": "k0"}], "video", claim)
    clear_store_unit(tmp_path, "t", stem, claim)
    claim.release()
    assert files() == before  # and our temporary is gone
    assert json.loads(lease.read_text())["token"] == "theirs"


@pytest.fixture(scope="module")
def one_clip(ingested, tmp_path_factory):
    """A root with cache "a" (one clip, two views in one bucket, other windows) and cache "b", the same
    identity under another name (so every draw of b is a reuse of a's), both run and merged, manifest
    "lat" over cache a's latents, and cache "c" (another VAE seed) planned, not run."""
    from reelcache.catalog.manifest import make_manifest

    d = tmp_path_factory.mktemp("one-clip")
    root = d / "root"
    shutil.copytree(ingested, root)
    make_manifest(root, "one", ONE)
    for name in ("a", "b"):
        assert main(["cache", "run", "--root", str(root), *_plan(root, _config(d, name))]) == 0
    assert main(["catalog", "merge", "--root", str(root)]) == 0
    make_manifest(root, "lat", "true", cache="a")
    assert _plan(root, _config(d, "c", views=1, seed=1)) == ["c/000000"]
    return root


@pytest.fixture()
def one_root(one_clip, tmp_path) -> Path:
    dst = tmp_path / "root"
    shutil.copytree(one_clip, dst)
    return dst


def test_two_windows_of_a_clip_in_one_bucket_are_two_entries_and_a_reuse_reads_its_own(one_clip):
    """Views 0 and 1 of a clip share a bucket with other windows: two store entries with two keys, the
    view's latent is the encoding of its own window (an independent decode and encode, compared with
    the store read by tarfile and safetensors), and cache b, reusing a's draws by key, reads for each
    view exactly a's latent of that view."""
    import torch

    from reelcache.cache.decode import FileSlice, decode_window
    from reelcache.cache.encoders import VideoEncoder
    from reelcache.cache.spec import EncoderSpec

    a = {(r["clip_id"], r["view"]): r for r in _sidecar(one_clip, "a")}
    b = {(r["clip_id"], r["view"]): r for r in _sidecar(one_clip, "b")}
    (clip,) = {c for c, _ in a}
    v0, v1 = a[(clip, 0)], a[(clip, 1)]
    assert v0["status"] == v1["status"] == "ok" and v0["bucket"] == v1["bucket"]
    assert v0["window_start"] != v1["window_start"] and v0["video_key"] != v1["video_key"]
    assert a.keys() == b.keys() and all(r["reused"] for r in b.values())
    for key, r in b.items():
        assert torch.equal(stored(one_clip, r["shard"], r["shard_offset"])[1]["mean"],
                           stored(one_clip, a[key]["shard"], a[key]["shard_offset"])[1]["mean"]), key  # fmt: skip
    ((raw, raw_off, size),) = sql(
        one_clip, f"SELECT shard, shard_offset, file_size FROM clips WHERE clip_id = '{clip}'"
    )
    video = VideoEncoder(EncoderSpec("ltx", tiny=True, dtype="float32"))

    def encoded(r):
        frames = decode_window(
            FileSlice(str(one_clip / raw), raw_off, size),
            frames=r["num_frames"], interval=1, height=r["height"], width=r["width"], start=r["window_start"],
        )  # fmt: skip
        return video.encode(frames[None])["mean"][0].float()

    want0, want1 = encoded(v0), encoded(v1)
    for r, want, other in ((b[(clip, 0)], want0, want1), (b[(clip, 1)], want1, want0)):
        got = stored(one_clip, r["shard"], r["shard_offset"])[1]["mean"].float()
        assert (got - want).abs().max() < 0.05 < (got - other).abs().max()  # bf16 of another batch


def test_gc_keeps_what_a_manifest_references(one_root):
    """With every cache gone, manifest "lat" alone references cache a's latents and captions: gc deletes
    none of them and each of its rows still reads from the store; without the manifest they go."""
    import pyarrow.parquet as pq

    from reelcache.cache.gc import gc

    for cache in ("a", "b", "c"):
        shutil.rmtree(one_root / "latents" / cache)
    (lat,) = (one_root / "manifests").glob("lat-*.parquet")
    rows = pq.read_table(lat).to_pylist()
    assert len(rows) == 2 and all(r["text_shard"] for r in rows)
    assert gc(one_root, delete=True)["entries"] == 0
    for r in rows:
        assert stored(one_root, r["shard"], r["shard_offset"])[1]["mean"].shape[0] > 0
        assert stored(one_root, r["text_shard"], r["text_offset"])[1]["text"].shape[0] > 0
    lat.unlink()
    assert gc(one_root, delete=True)["entries"] == 3  # two latents and the caption
    assert not list((one_root / "store").rglob("*.tar"))


@pytest.mark.slow  # a cache unit runs inside gc
@pytest.mark.parametrize("unit", ["new", "a killed one's re-run"])
def test_gc_never_deletes_what_a_unit_publishes_while_it_scans(one_root, monkeypatch, unit):
    """A unit that finishes right after gc's reference scan (landed there by wrapping the scan): a new
    unit, or the re-run of a unit killed after its index was published (its old index and shards are
    garbage when the scan ends, and the re-run publishes the same names again). Every ok row of the
    unit reads from the store afterwards, and a later gc, which sees its sidecar, deletes none of it."""
    from reelcache.cache import gc as gc_mod
    from reelcache.cache.run import run_unit

    scan = gc_mod.references
    if unit != "new":
        run_unit(str(one_root), "c/000000")
        (one_root / "latents/c/000000.parquet").unlink()  # killed after its index, before its sidecar

    def scanning(root):
        refs = scan(root)
        run_unit(str(one_root), "c/000000")
        return refs

    monkeypatch.setattr(gc_mod, "references", scanning)
    gc_mod.gc(one_root, delete=True)
    monkeypatch.undo()
    rows = _sidecar(one_root, "c")
    assert_readable(one_root, rows)
    assert gc_mod.gc(one_root, delete=True)["entries"] == 0
    assert_readable(one_root, rows)


@pytest.mark.slow  # a cache unit runs with gc inside it
def test_gc_leaves_a_running_units_entries_alone(one_root, monkeypatch):
    """gc --delete while a unit holds its lease, its store shards and indexes published and its sidecar
    not yet: nothing references them, and none is deleted; the unit's rows read from the store."""
    from reelcache.cache import run
    from reelcache.cache.gc import gc

    finish, got = run.Latents.finish, {}

    def finish_then_gc(self, rows):
        table = finish(self, rows)  # the store indexes are written
        assert (one_root / "latents/c/000000.lease").exists() and not (one_root / "latents/c/000000.parquet").exists()
        got.update(gc(one_root, delete=True))
        return table

    monkeypatch.setattr(run.Latents, "finish", finish_then_gc)
    run.run_unit(str(one_root), "c/000000")
    assert got["entries"] == 0 and got["deleted"] == 0
    assert_readable(one_root, _sidecar(one_root, "c"))


# A `cache run` whose lease names another host ("frozen-node") and that freezes itself (SIGSTOP) once
# its first latent is in its open store shard, its captions already published: a node frozen mid-unit.
FROZEN = """
import os, signal, socket, sys
socket.gethostname = lambda: "frozen-node"
from reelcache.cache import run
store = run.Latents.store
def store_then_freeze(self, row):
    store(self, row)
    if len(self.index) == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
run.Latents.store = store_then_freeze
from reelcache.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow  # a frozen `cache run` in its own process, its unit taken over
def test_a_frozen_unit_taken_over_deletes_none_of_the_new_runs_store_files(fresh_root, tmp_path, monkeypatch):
    """A unit frozen mid-run on another node (its lease names another host; SIGSTOP) for longer than the
    lease TTL is taken over by a second run, which finishes it. The first then wakes: it must fail saying
    it lost the lease (not that a write failed), and its cleanup must leave every store shard and index
    of the second run as it was (compared with a copy taken before it woke); each ok row reads."""
    from support import proc_stat, quiet_env

    from reelcache.base import lease as leases
    from reelcache.cache.run import run_unit
    from reelcache.catalog.manifest import make_manifest

    make_manifest(fresh_root, "one", "clip_id IN (SELECT clip_id FROM clips WHERE status = 'ok' ORDER BY 1 LIMIT 2)")
    (unit,) = _plan(fresh_root, _config(tmp_path, "t", views=1))
    env = quiet_env(REELCACHE_LEASE_TTL_S="1")
    first = subprocess.Popen(
        [sys.executable, "-c", FROZEN, "cache", "run", "--root", str(fresh_root), unit],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while (proc_stat(first.pid) or ("Z",))[0] != "T":
            assert first.poll() is None and time.monotonic() < deadline, first.communicate()
            time.sleep(0.02)
        monkeypatch.setattr(leases, "TTL_S", 1.0)  # this run's view: another host's lease is stale after 1 s
        assert run_unit(str(fresh_root), unit, wait=True)["ok"] == 2  # waits out the TTL, takes over, finishes
        store = fresh_root / "store"
        before = {p: p.read_bytes() for p in store.rglob("*") if p.is_file()}
        assert len([p for p in before if p.suffix == ".tar"]) == 2 and len(before) == 4  # video, text; indexes
    finally:
        os.kill(first.pid, signal.SIGCONT)
        _, err = first.communicate(timeout=120)
    assert first.returncode == 2 and "lost the lease" in err, err[-3000:]
    assert "cannot write" not in err and "Traceback" not in err, err[-3000:]
    assert {p: p.read_bytes() for p in store.rglob("*") if p.is_file()} == before
    assert_readable(fresh_root, _sidecar(fresh_root, "t"))
    assert not list((fresh_root / "latents/t").glob("*.lease"))
