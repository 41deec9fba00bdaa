"""The content-addressed latent store (cache/store.py): captions stored once, latents reused across caches
and re-plans, encoders called only for what is new, gc; each checked against counts from the catalog or a
fresh encode in another root, never against the store's own index."""

from __future__ import annotations

import shutil
import tarfile
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

    from reelcache.cache.encoders import EncoderSpec, TextEncoder
    from reelcache.catalog.db import open_catalog
    from reelcache.catalog.latents import read_latent

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

    from reelcache.catalog.buckets import BucketConfig
    from reelcache.catalog.db import open_catalog
    from reelcache.catalog.latents import read_latent
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
