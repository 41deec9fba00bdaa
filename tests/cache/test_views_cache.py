"""Views end to end (issue 17): a K = 2 cache of the suite's ingested clips, made by the real `cache plan`
and `cache run`, merged, and read by the loader: each distinct (bucket, window) draw is encoded and
stored once, the loader shows each clip once per epoch and each view once over K epochs, resumes on
another world size, refuses another K, and a catalog from before the view column is migrated.
The draws themselves are held to Open-Sora's rule in tests/cache/test_views.py, without video.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from support import sql

from reelcache.cli import main

SEED = 7  # the loader's (run.seed), as in test_views.py

# -- end to end: a K = 2 cache, its manifest, the loader ----------------------------------------------------
# Short windows so the tiny encoders are quick; length 9 is offered to half of the draws.
FAST = "[buckets.144p]\n5 = [1.0, 2]\n9 = [[1.0, 0.5], 2]\n"


@pytest.fixture(scope="module")
def cache2(ingested, tmp_path_factory):
    import shutil

    from reelcache.catalog.manifest import make_manifest

    root = tmp_path_factory.mktemp("views-e2e") / "root"
    shutil.copytree(ingested, root)
    make_manifest(root, "m", "true")
    (root / "fast.toml").write_text(FAST)
    cfg = root / "v2.toml"
    cfg.write_text(
        f'name = "v2"\nmanifest = "m"\nbuckets = "{root / "fast.toml"}"\nseed = 0\nviews = 2\n'
        "clips_per_unit = 100\nworkers = 1\n"
        '[video_encoder]\nkind = "ltx"\ntiny = true\ndtype = "float32"\n'
        '[text_encoder]\nkind = "t5"\ntiny = true\ndtype = "float32"\n'
    )
    assert main(["cache", "plan", "--root", str(root), "--config", str(cfg)]) == 0
    assert main(["cache", "run", "--root", str(root), "v2/000000"]) == 0
    assert main(["catalog", "merge", "--root", str(root)]) == 0
    assert main(["catalog", "manifest", "--root", str(root), "--name", "lat2", "--cache", "v2"]) == 0
    return root


@pytest.mark.slow
def test_a_two_view_cache_stores_each_distinct_draw_once(cache2):

    from reelcache.cache.decode import FileSlice, decode_window
    from reelcache.cache.encoders import VideoEncoder
    from reelcache.cache.spec import EncoderSpec
    from reelcache.train.source import read_sample

    rows = sql(
        cache2,
        "SELECT l.clip_id, l.view, l.bucket, l.window_start, l.shard, l.shard_offset, l.num_frames, l.height, "
        "l.width, c.shard, c.shard_offset, c.file_size FROM latents l JOIN clips c USING (clip_id) "
        "WHERE l.status = 'ok' ORDER BY 1, 2",
    )
    ((ok,),) = sql(cache2, "SELECT count(*) FROM clips WHERE status = 'ok'")
    by = {}
    for r in rows:
        by.setdefault(r[0], []).append(r)
    assert len(by) == ok and all([v[1] for v in rs] == [0, 1] for rs in by.values())
    same = [rs for rs in by.values() if rs[0][2:4] == rs[1][2:4]]
    differ = [rs for rs in by.values() if rs[0][2:4] != rs[1][2:4]]
    assert all(rs[0][4:6] == rs[1][4:6] for rs in same)  # one latent for both views
    assert differ and all(rs[0][4:6] != rs[1][4:6] for rs in differ)
    assert {rs[0][2] != rs[1][2] for rs in differ} == {True, False}  # views differing in bucket, in window only
    # view 1's latent is the encoding of view 1's window (up to the bf16 rounding of another batch), not
    # of view 0's window
    video = VideoEncoder(EncoderSpec("ltx", tiny=True, dtype="float32"))
    rs = next(rs for rs in differ if rs[0][2] == rs[1][2])  # same bucket, another window

    def encoded(r):
        _, _, _, start, _, _, t, h, w, raw, raw_off, size = r
        frames = decode_window(
            FileSlice(str(cache2 / raw), raw_off, size), frames=t, interval=1, height=h, width=w, start=start
        )
        return video.encode(frames[None])["mean"][0].float()

    got = read_sample(str(cache2 / rs[1][4]), rs[1][5])["mean"].float()
    assert (got - encoded(rs[1])).abs().max() < 0.05 < (got - encoded(rs[0])).abs().max()


def _loaders(manifest, root, world, **kw):
    from reelcache.base.buckets import BucketConfig
    from reelcache.train.loader import LatentLoader

    sizes = BucketConfig.from_toml(root / "fast.toml")
    return [
        LatentLoader([manifest], sizes, root=root, rank=r, world_size=world, seed=SEED, read=False, **kw)
        for r in range(world)
    ]


def _epoch(loaders, steps=None) -> list[dict]:
    """One epoch (or `steps` of it) of every rank in lockstep: the real batches, in global order."""
    out = []
    iters = [iter(ld) for ld in loaders]
    for k, batches in enumerate(zip(*iters)):
        out += [b for b in batches if b["weight"] == 1]
        if steps is not None and k + 1 == steps:
            return sorted(out, key=lambda b: b["index"])
    for it in iters:
        for _ in it:
            pass
    return sorted(out, key=lambda b: b["index"])


@pytest.mark.slow
def test_the_loader_shows_each_clip_once_per_epoch_and_each_view_once(cache2, tmp_path):
    import duckdb

    from reelcache.catalog.manifest import resolve_manifest

    manifest = resolve_manifest(cache2, "lat2")
    t = pq.read_table(manifest)
    assert {"view", "views"} <= set(t.column_names) and set(t["views"].to_pylist()) == {2}
    where = {(r["clip_id"], r["view"]): r["bucket"] for r in t.to_pylist()}
    clips = {c for c, _ in where}
    (ld,) = _loaders(manifest, cache2, 1, consumed_log=tmp_path / "consumed", log_every=2)
    seen = []
    for _ in range(2):
        batches = _epoch([ld])
        shown = [(c, v) for b in batches for c, v in zip(b["clip_id"], b["view"])]
        assert sorted(c for c, _ in shown) == sorted(clips)  # every clip once
        assert all(where[c, v] == b["bucket"] for b in batches for c, v in zip(b["clip_id"], b["view"]))
        seen.append(dict(shown))
    assert all({seen[0][c], seen[1][c]} == {0, 1} for c in clips)  # each view once over two epochs
    log = duckdb.sql(f"SELECT epoch, clip_id, view FROM '{tmp_path}/consumed/*.parquet' WHERE NOT pad").fetchall()
    assert sorted(log) == sorted((e, c, v) for e in range(2) for c, v in seen[e].items())


@pytest.mark.slow
def test_views_resume_on_another_world_size_and_another_k_is_refused(cache2, tmp_path):
    from reelcache.catalog.manifest import resolve_manifest

    manifest = resolve_manifest(cache2, "lat2")
    ref = _epoch(_loaders(manifest, cache2, 1))
    ref_order = [(c, v) for b in ref for c, v in zip(b["clip_id"], b["view"])]
    two = _loaders(manifest, cache2, 2)
    head = _epoch(two, steps=2)
    state = two[0].state_dict()
    three = _loaders(manifest, cache2, 3)
    for ld in three:
        ld.load_state_dict(state)
    rest = _epoch(three)
    got = [(c, v) for b in head + rest for c, v in zip(b["clip_id"], b["view"])]
    assert got == ref_order
    # a manifest of another K (the same clips with one view: a single-view cache's view 0) is another dataset
    t = pq.read_table(manifest)
    one = tmp_path / "k1.parquet"
    pq.write_table(t.filter(pc.equal(t["view"], 0)).drop_columns(["view", "views"]), one)
    three_k = tmp_path / "k3.parquet"  # the same rows, said to be views of a K = 3 cache
    pq.write_table(t.set_column(t.column_names.index("views"), "views", pa.array([3] * t.num_rows)), three_k)
    for other in (one, three_k):
        (ld,) = _loaders(other, cache2, 1)
        with pytest.raises(ValueError, match="refusing to resume the data position"):
            ld.load_state_dict(state)


@pytest.mark.slow
def test_simulate_says_which_views_each_epoch_showed(cache2, caplog):
    from reelcache.base.buckets import BucketConfig
    from reelcache.train.simulate import simulate

    table, _, _ = simulate(
        ["lat2"], BucketConfig.from_toml(cache2 / "fast.toml"), root=cache2, world_size=2, seed=SEED, epochs=2
    )
    err = "\n".join(caplog.messages)
    assert "views: 2 per clip" in err and "epoch 1: view 0" in err and "different latents" in err, err
    real = [r for r in table.to_pylist() if not r["pad"]]
    assert {(r["epoch"], r["view"]) for r in real} == {(0, 0), (0, 1), (1, 0), (1, 1)}


@pytest.mark.slow
def test_a_catalog_without_the_view_column_is_migrated_and_merges(cache2, tmp_path):
    """A catalog made before views (schema 3 at most): `latents` has no `view`; merge's open adds it
    (catalog/db.py: MIGRATIONS[4]) and loads the sidecars."""
    import shutil

    from reelcache.catalog.db import open_catalog

    root = tmp_path / "old"
    shutil.copytree(cache2, root)
    con = open_catalog(root, write=True)
    con.execute("DELETE FROM latents")
    con.execute("DELETE FROM units WHERE stage = 'cache'")
    con.execute("ALTER TABLE latents DROP COLUMN view")
    con.execute("UPDATE meta SET value = '3' WHERE key = 'schema_version'")
    con.close()
    assert main(["catalog", "merge", "--root", str(root)]) == 0
    assert sql(root, "SELECT view, count(*) FROM latents GROUP BY 1 ORDER BY 1") == sql(
        cache2, "SELECT view, count(*) FROM latents GROUP BY 1 ORDER BY 1"
    )
