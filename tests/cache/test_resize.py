"""The cache's ``resize = "opensora"`` against Open-Sora 1.2's own transform, and the option in the
cache identity.

Reference: Open-Sora 1.2's ``resize_crop_to_fill`` (``opensora/datasets/video_transforms.py``, the
"resize_crop" transform of its video datasets), written out below from its source with torch's
``F.interpolate`` (torchvision is not needed): frames decoded by PyAV at their coded size
(``frame.to_rgb()``), uint8 -> float / 255, bilinear (align_corners=False, no antialias) to cover
the bucket's exact (th, tw) with Python's ``round``, crop (th, tw) at the floor of half the excess.
The cache keeps the centre (H, W) of that crop, H and W rounded down to the encoder's multiple.

Tolerance: |cache - 255 x reference| <= 0.5 + 1e-3 levels for every pixel: the cache stores uint8,
so it may differ from the float reference by the rounding (0.5) plus float error (measured ~3e-5:
its numpy bilinear reproduces torch's CPU arithmetic). The default (area) path scores a mean
error of 10-15 levels on these noise frames (a downscale without antialias aliases), also
asserted, so the comparison tells the two resizes apart, as it does a crop one pixel off (~200
levels). The area path itself is pinned bit for bit by test_cache.py's
``test_decoded_window_equals_frames_of_a_full_decode``.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from support import REPO, TOL, decode_job, reference, write_clip_file


@pytest.mark.parametrize(
    "size,rotation,bucket,crop",
    [
        ((640, 360), 0, "240p/5/0.56", (240, 424)),  # downscale; the width overflows (427) and 426 -> 424
        ((160, 96), 0, "240p/5/0.56", (240, 424)),  # upscale
        ((480, 272), 0, "240p/5/0.56", (240, 424)),  # the height overflows by 241.4: round, not ceil
        ((360, 640), 0, "240p/5/1.78", (424, 240)),  # portrait: the height overflows
        ((640, 360), 90, "240p/5/1.78", (424, 240)),  # coded landscape, displayed portrait
    ],
)
def test_opensora_resize_is_open_sora_12s_resize_crop_to_fill(tmp_path, size, rotation, bucket, crop):
    from reelcache.base.buckets import bucket_geometry
    from reelcache.cache.decode import decode_clip

    p = write_clip_file(tmp_path, *size, rotation=rotation)
    got = decode_clip(decode_job(p, bucket, *crop, resize="opensora"), str(tmp_path))
    ref = reference(p, [7 + 3 * k for k in range(5)], bucket_geometry(bucket)[1:], *crop)
    assert got.dtype == np.uint8 and got.shape == ref.shape
    err = np.abs(got - ref)
    assert err.max() <= TOL, float(err.max())
    # the area resize (the default, also when a job names none) is a different picture: 10-15 levels
    area = decode_clip(decode_job(p, bucket, *crop), str(tmp_path))
    assert np.abs(area - ref).mean() > 5


def test_decode_window_takes_the_exact_size_to_cover(tmp_path):
    """decode_window's `fit`: without it the crop is covered directly (Open-Sora at a bucket of (H, W))."""
    from reelcache.cache.decode import decode_window

    p = write_clip_file(tmp_path, 640, 360)
    kw = dict(frames=2, interval=1, height=240, width=424, start=3, resize="opensora")
    wanted = [3, 4]
    assert np.abs(decode_window(str(p), **kw) - reference(p, wanted, (240, 424), 240, 424)).max() <= TOL
    got = decode_window(str(p), fit=(240, 426), **kw)
    assert np.abs(got - reference(p, wanted, (240, 426), 240, 424)).max() <= TOL
    with pytest.raises(ValueError, match="resize = 'bicubic'"):
        decode_window(str(p), frames=1, interval=1, height=240, width=424, resize="bicubic")


# -- identity ---------------------------------------------------------------------------------
def cache_config(buckets: Path, **over):
    from reelcache.cache.plan import CacheConfig

    doc = dict(
        name="r",
        manifest="m",
        buckets=str(buckets),
        clips_per_unit=4,
        batch_size=2,
        workers=1,
        video_encoder=dict(kind="ltx", tiny=True, dtype="float32"),
        text_encoder=dict(kind="t5", tiny=True, dtype="float32"),
    )
    return CacheConfig.from_dict(doc | over, "test")


def test_default_identity_is_that_of_caches_made_before_the_option():
    from reelcache.base.buckets import BucketConfig
    from reelcache.cache.plan import diff, identity

    buckets = BucketConfig.from_toml(REPO / "configs/buckets/demo.toml")
    area = identity(cache_config(REPO / "configs/buckets/demo.toml"), buckets, "fp")
    sora = identity(cache_config(REPO / "configs/buckets/demo.toml", resize="opensora"), buckets, "fp")
    # the value every cache.json holds since the first cache: no key added, none changed
    assert area["preprocess"]["resize"] == "swscale area, cover"
    assert set(area) == set(sora) and set(area["preprocess"]) == set(sora["preprocess"])
    (d,) = diff(area, sora)
    assert d.startswith("preprocess.resize: ")


@pytest.fixture()
def planned(tmp_path):
    """A default-resize cache over a 240p bucket (426-wide buckets), planned once over a manifest of
    eight 240p clips written here (planning reads no video)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from reelcache.cache.plan import make_plan

    root = tmp_path / "root"
    (root / "manifests").mkdir(parents=True)
    rows = [
        {"clip_id": f"c{i}", "shard": "raw/x/000000-00.tar", "shard_offset": 512 * (i + 1), "file_size": 1000}
        | {"num_frames": 30, "width": 426, "height": 240, "text": "a dog runs", "fps": 30.0}
        for i in range(8)
    ]
    pq.write_table(pa.Table.from_pylist(rows), root / "manifests" / "m-0000000000000000.parquet")
    (tmp_path / "b.toml").write_text("[buckets.240p]\n9 = [1.0, 2]\n")
    cfg = cache_config(tmp_path / "b.toml")
    return root, cfg, make_plan(root, cfg)


def test_a_cache_is_never_mixed_from_two_resizes(planned):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from reelcache import UserError
    from reelcache.cache.plan import make_plan

    root, cfg, units = planned
    assert units == ["r/000000", "r/000001"]  # 8 clips, 4 per unit
    with pytest.raises(UserError, match="another identity") as e:
        make_plan(root, dataclasses.replace(cfg, resize="opensora"))
    assert "preprocess.resize" in str(e.value)
    # a plan written before the option (no "resize" in its config), with a finished unit: re-planned as it was
    cdir = root / "latents" / cfg.name
    doc = json.loads((cdir / "_plan/plan.json").read_text())
    del doc["config"]["resize"]
    (cdir / "_plan/plan.json").write_text(json.dumps(doc))
    pq.write_table(pa.table({"clip_id": pa.array([], pa.string())}), cdir / "000000.parquet")  # a finished unit
    assert make_plan(root, cfg) == units
    with pytest.raises(UserError, match="another identity"):
        make_plan(root, dataclasses.replace(cfg, resize="opensora"))


@pytest.mark.slow
def test_cache_run_decodes_with_the_planned_resize(fresh_root, tmp_path, monkeypatch):
    """`cache run` hands the plan's resize to its decode workers: the frames it encodes are
    decode_clip's "opensora" frames, not the area ones."""
    import pyarrow.parquet as pq

    from reelcache.base.buckets import bucket_geometry
    from reelcache.cache import run
    from reelcache.cache.decode import decode_clip
    from reelcache.cache.plan import make_plan
    from reelcache.catalog.manifest import make_manifest

    make_manifest(fresh_root, "m", "true")
    (tmp_path / "b.toml").write_text("[buckets.240p]\n9 = [1.0, 2]\n")
    cfg = cache_config(tmp_path / "b.toml", resize="opensora")
    make_plan(fresh_root, cfg)
    table = pq.read_table(fresh_root / "latents/r/_plan/input.parquet").to_pylist()
    n = cfg.clips_per_unit
    unit = next(i // n for i, r in enumerate(table) if r["bucket"])
    rows = [dict(r, interval=1) for r in table[unit * n : (unit + 1) * n] if r["bucket"]]
    seen = []
    encode = run.VideoEncoder.encode
    monkeypatch.setattr(run.VideoEncoder, "encode", lambda self, x: seen.extend(x.copy()) or encode(self, x))
    run.run_unit(str(fresh_root), f"r/{unit:06d}")
    want = [decode_clip(dict(r, resize="opensora"), str(fresh_root)) for r in rows]
    area = [decode_clip(r, str(fresh_root)) for r in rows]
    assert len(seen) == len(rows)
    assert any(bucket_geometry(r["bucket"])[1:] != (r["height"], r["width"]) for r in rows)  # e.g. 426 -> 424
    for f in seen:
        assert any(np.array_equal(f, w) for w in want)
        assert not any(np.array_equal(f, a) for a in area)
