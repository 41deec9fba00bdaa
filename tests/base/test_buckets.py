"""Bucket sizes, aspect keys and window starts against Open-Sora 1.2's own (opensora/datasets/aspect.py,
bucket.py, video_transforms.py at hpcaitech/Open-Sora@4b2b47b): its numbers, the issue's examples,
and its rules written again here from their description."""

from __future__ import annotations

import dataclasses
import hashlib
import json

import pyarrow.parquet as pq
import pytest
from support import TOL, decode_job, reference, write_clip_file

from reelcache import UserError
from reelcache.base.aspect_tables import OPENSORA12_ASPECT
from reelcache.base.buckets import RESOLUTIONS, BucketConfig, bucket_geometry, bucket_hw, nearest_ratio

# sha256 of {resolution: [budget, [[key, H, W], ...]]} (JSON, no spaces, upstream's order) for the ten
# resolutions, computed by executing upstream's aspect.py at 4b2b47b and reading its ASPECT_RATIOS.
UPSTREAM_SHA256 = "0714006ad70a48da2464f72d5b283fb69e89c52c3f60b57ed92395c0d975bf94"
P_RES = ("144p", "240p", "360p", "480p", "720p", "1080p")
PIXART = ("256", "512", "1024", "2048")


def upstream_closest(height: int, width: int, keys) -> str:
    """Open-Sora 1.2's get_closest_ratio, from its description: the key k (upstream's order) with
    |H/W - float(k)| least; a later key replaces an earlier one only when strictly nearer."""
    ar, best = height / width, None
    for k in keys:
        if best is None or abs(float(k) - ar) < abs(float(best) - ar):
            best = k
    return best


def test_tables_are_open_soras_numbers():
    doc = {r: [b, [[k, h, w] for k, (h, w) in t.items()]] for r, (b, t) in OPENSORA12_ASPECT.items()}
    assert list(doc) == [*P_RES, *PIXART]
    assert hashlib.sha256(json.dumps(doc, separators=(",", ":")).encode()).hexdigest() == UPSTREAM_SHA256
    budgets = (36_864, 102_240, 230_400, 409_920, 921_600, 2_073_600, 65_536, 262_144, 1_048_576, 4_194_304)
    assert RESOLUTIONS == dict(zip((*P_RES, *PIXART), budgets))
    assert all(len(OPENSORA12_ASPECT[r][1]) == 17 for r in P_RES)
    assert all(len(OPENSORA12_ASPECT[r][1]) == 40 for r in PIXART)
    assert all(h % 16 == 0 and w % 16 == 0 for r in PIXART for h, w in OPENSORA12_ASPECT[r][1].values())
    # read off upstream's file: the issue's 240p/0.75, and a few more
    assert bucket_hw("240p", "0.75") == (276, 368) and bucket_hw("240p", "0.56") == (240, 426)
    assert bucket_hw("1080p", "0.56") == (1080, 1920) and bucket_hw("480p", "1.33") == (740, 555)
    assert bucket_hw("144p", "2.08") == (277, 132) and bucket_hw("2048", "4.00") == (4096, 1024)
    assert bucket_hw("512", "0.57") == (384, 672) and bucket_hw("256", "0.72") == (208, 288)


@pytest.mark.parametrize(
    "res,h,w,frames,bucket,hw",
    [
        ("240p", 480, 640, 60, "240p/51/0.75", (276, 368)),  # the issue's 240p/0.75 (was 277 x 369)
        ("512", 1080, 1920, 60, "512/51/0.57", (384, 672)),  # 16:9 at 512 (was 384 x 683, stored 384 x 680)
        ("256", 480, 640, 60, "256/51/0.72", (208, 288)),  # 4:3 at 256: 0.72 and 0.78 tie, the first wins
        ("256", 640, 480, 60, "256/51/1.29", (288, 224)),  # portrait 3:4: 1.29 (|1.333 - 1.29| < 0.05)
        ("1024", 1080, 1080, 1, "1024/1/1.00", (1024, 1024)),
    ],
)
def test_the_issues_examples_are_upstreams_buckets(res, h, w, frames, bucket, hw):
    cfg = BucketConfig.from_dict({res: {1: [1.0, 8], 51: [1.0, 2]}})
    a = cfg.assign("clip", h, w, frames)
    assert (a.bucket, (a.height, a.width)) == (bucket, hw)
    assert bucket_geometry(bucket)[1:] == hw


def test_nearest_key_is_upstreams_rule_at_every_resolution():
    """Every resolution over a grid of shapes (ties included: 4:3 = 0.75 between 0.72 and 0.78 at the
    PixArt sizes), and each table's own sizes: the bucket's key and (H, W) are upstream's."""
    shapes = [(h, w) for h in range(90, 2200, 41) for w in range(90, 2200, 43)]
    shapes += [(3, 4), (4, 3), (9, 16), (16, 9), (1, 1), (1, 4), (4, 1), (1, 8), (8, 1)]
    for res, (budget, table) in OPENSORA12_ASPECT.items():
        cfg = BucketConfig.from_dict({res: {1: [1.0, 8]}})
        for h, w in shapes + list(table.values()):
            want = upstream_closest(h, w, table)
            assert nearest_ratio(h, w, res) == want, (res, h, w)
            k = 1 + budget // (h * w)  # scaled up to be eligible at this resolution
            a = cfg.assign("c", h * k, w * k, 1)
            assert (a.bucket, a.height, a.width) == (f"{res}/1/{want}", *table[want]), (res, h, w)


def test_a_bucket_name_from_before_the_tables_is_one_clear_line():
    assert bucket_geometry("512/1/1.00") == (1, 512, 512)
    with pytest.raises(UserError, match=r"512/0\.56: no such entry.*plan them again") as e:
        bucket_geometry("512/51/0.56")  # reelcache's 16:9 key at 512 before it took upstream's tables
    assert "\n" not in str(e.value)
    with pytest.raises(UserError, match="expected <resolution>/<frames>/<aspect key>"):
        bucket_geometry("512/0.56")


def test_a_manifest_of_a_cache_from_before_the_tables_is_refused_before_training(tmp_path):
    """The loader reads a manifest's buckets before any work: one from before the tables names
    "512/17/0.56", which upstream's 512 table lacks (its 16:9 key there is 0.57)."""
    from latent_data import write_latents

    from reelcache.train.source import load_source

    assert load_source(write_latents(tmp_path, 4, name="now", buckets=["512/17/0.57", "144p/17/0.56"]))
    old = write_latents(tmp_path, 4, name="old", buckets=["512/17/0.56", "144p/17/0.56"])
    with pytest.raises(UserError, match=r"old\.parquet: bucket size 512/0\.56: no such entry.*plan them again"):
        load_source(old)


@pytest.mark.parametrize(
    "size,res,bucket,fit,stored",
    [
        ((640, 360), "512", "512/5/0.57", (384, 672), (384, 672)),  # a multiple of 16: stored whole
        ((640, 480), "240p", "240p/5/0.75", (276, 368), (272, 368)),  # the centre, rounded down to 8
    ],
)
def test_opensora_resize_covers_upstreams_size_of_the_assigned_bucket(tmp_path, size, res, bucket, fit, stored):
    """A clip's bucket (assign) and its frames (decode_clip, resize = "opensora") are Open-Sora 1.2's:
    resize_crop_to_fill (tests/cache/test_resize.py's torch reference) to upstream's size read off its table."""
    import numpy as np

    from reelcache.cache.decode import decode_clip

    a = BucketConfig.from_dict({res: {5: [1.0, 2]}}).assign("c", size[1], size[0], 25)
    assert (a.bucket, (a.height, a.width)) == (bucket, fit)
    p = write_clip_file(tmp_path, *size)
    got = decode_clip(decode_job(p, a.bucket, *stored, resize="opensora"), str(tmp_path))
    assert np.abs(got - reference(p, [7 + 3 * k for k in range(5)], fit, *stored)).max() <= TOL


# -- windows --------------------------------------------------------------------------------------
def upstream_start_range(total: int, frames: int, interval: int) -> range:
    """Open-Sora 1.2's TemporalRandomCrop(T k): randint(0, max(0, total - T k - 1)), both ends included."""
    return range(max(0, total - frames * interval - 1) + 1)


@pytest.mark.parametrize("total,frames,interval", [(20, 5, 1), (52, 51, 1), (40, 5, 3), (2, 1, 1), (103, 51, 2)])
def test_opensora_window_starts_cover_upstreams_range(total, frames, interval):
    from reelcache.cache.decode import window_start

    span = (frames - 1) * interval + 1
    ids = [f"src/dir/clip_{i:05d}.mp4" for i in range(400)]
    sora = {window_start(c, 0, total, span, rule="opensora", interval=interval) for c in ids}
    assert sora == set(upstream_start_range(total, frames, interval))  # never the last valid start
    uniform = {window_start(c, 0, total, span, interval=interval) for c in ids}
    assert uniform == set(range(total - span + 1))  # the default: every valid start, as before
    with pytest.raises(ValueError, match="window = 'last'"):
        window_start("c", 0, total, span, rule="last")


def cache_config(buckets, **over):
    from reelcache.cache.plan import CacheConfig

    doc = dict(
        name="w",
        manifest="m",
        buckets=str(buckets),
        clips_per_unit=4,
        video_encoder=dict(kind="ltx", tiny=True, dtype="float32"),
        text_encoder=dict(kind="t5", tiny=True, dtype="float32"),
    )
    return CacheConfig.from_dict(doc | over, "test")


@pytest.mark.slow
def test_cache_plan_draws_upstreams_windows_and_says_so(fresh_root, tmp_path):
    """`window = "opensora"` plans starts in upstream's range, is part of the cache's identity, and the
    default plans as before; a cache.json from before the tables is refused naming buckets.sizes."""
    from reelcache.cache.plan import make_plan
    from reelcache.cache.run import run_unit
    from reelcache.catalog.manifest import make_manifest, read_manifest, resolve_manifest

    make_manifest(fresh_root, "m", "true")
    (tmp_path / "b.toml").write_text("[buckets.144p]\n17 = [1.0, 2]\n")
    cfg = cache_config(tmp_path / "b.toml", window="opensora")
    make_plan(fresh_root, cfg)
    cdir = fresh_root / "latents/w"
    rows = [r for r in pq.read_table(cdir / "_plan/input.parquet").to_pylist() if r["bucket"]]
    frames = {r["clip_id"]: r["num_frames"] for r in read_manifest(resolve_manifest(fresh_root, "m"))[0].to_pylist()}
    assert len(rows) >= 4 and all(r["window_start"] in upstream_start_range(frames[r["clip_id"]], 17, 1) for r in rows)
    ident = json.loads((cdir / "cache.json").read_text())
    assert ident["buckets"]["sizes"].startswith("Open-Sora 1.2 aspect.py tables")
    assert ident["preprocess"]["window"].endswith("TemporalRandomCrop range")
    with pytest.raises(UserError, match="another identity") as e:
        make_plan(fresh_root, dataclasses.replace(cfg, window="uniform"))
    assert "preprocess.window" in str(e.value)
    # a cache planned before the tables: its cache.json has no buckets.sizes
    del ident["buckets"]["sizes"]
    (cdir / "cache.json").write_text(json.dumps(ident))
    with pytest.raises(UserError, match="another identity") as e:
        make_plan(fresh_root, cfg)
    assert 'buckets.sizes: null != "Open-Sora 1.2 aspect.py tables' in str(e.value)
    with pytest.raises(UserError, match="refusing to mix latents") as e:  # and its planned units, before any work
        run_unit(str(fresh_root), "w/000000")
    assert 'buckets.sizes: null != "Open-Sora 1.2 aspect.py tables' in str(e.value)
    assert not list(cdir.glob("[0-9]*"))
