"""Bucket assignment (base/buckets.py: assign): hand-computed buckets, the reasons a clip gets no
bucket, and the keep-probability draws, which are pure functions of (seed, clip id)."""

from __future__ import annotations

import pytest

from reelcache.base.buckets import BucketConfig, bucket_hw

CFG = BucketConfig.from_dict({"720p": {51: [1.0, 2]}, "240p": {51: [1.0, 8], 102: [1.0, 4]}, "144p": {1: [1.0, 64]}})


@pytest.mark.parametrize(
    "h,w,frames,bucket,hw",
    [
        (720, 1280, 120, "720p/51/0.56", (720, 1280)),  # eligible at 720p, 120 > 51
        (360, 640, 110, "240p/102/0.56", (240, 426)),  # 230,400 < 0.8 x 921,600: falls to 240p; 110 > 102
        (1280, 720, 60, "720p/51/1.78", (1280, 720)),  # portrait: H/W = 1.78
        (286, 286, 52, "240p/51/1.00", (320, 320)),  # 81,796 >= 0.8 x 102,240 = 81,792: eligible
        (285, 286, 52, None, None),  # 81,510 < 81,792: too small for 240p; 144p is images only
        (144, 256, 1, "144p/1/0.56", (144, 256)),  # a single frame goes to the image bucket
    ],
)
def test_bucket_assignment_hand_computed(h, w, frames, bucket, hw):
    a = CFG.assign("clip", h, w, frames)
    assert a.bucket == bucket and (hw is None or (a.height, a.width) == hw)
    if bucket is None:
        assert a.reason == "too_short"  # eligible at 144p by size, but only single frames go there


def test_bucket_reasons_interval_and_tables():
    assert CFG.assign("c", 100, 100, 500).reason == "too_small"
    slow = BucketConfig.from_dict({"240p": {51: [1.0, 8]}}, frame_interval=2)
    assert slow.assign("c", 240, 426, 102).reason == "too_short" and slow.assign("c", 240, 426, 103).bucket
    assert bucket_hw("240p", "0.56") == (240, 426) and bucket_hw("720p", "0.56") == (720, 1280)
    assert CFG.batch_size("240p/102/0.56") == 4


def test_keep_probability_is_deterministic_and_demotes():
    cfg = BucketConfig.from_dict({"720p": {51: [0.3, 2]}, "240p": {51: [1.0, 8]}})
    ids = [f"clip{i}" for i in range(4000)]
    a = [cfg.assign(c, 720, 1280, 60, seed=1).bucket for c in ids]
    assert a == [cfg.assign(c, 720, 1280, 60, seed=1).bucket for c in ids]  # pure function
    top = sum(b.startswith("720p") for b in a) / len(a)
    assert 0.27 < top < 0.33 and all(b.startswith(("720p", "240p")) for b in a)  # the rest demoted
    assert a != [cfg.assign(c, 720, 1280, 60, seed=2).bucket for c in ids]


def test_length_keep_probability_and_never_entries_demote_as_open_sora():
    """Open-Sora's bucket.py: a (p_res, p_t) length is tried only when a draw passes p_t, else the
    next shorter length; a (0.0, None) length that a clip reaches demotes it to the next resolution."""
    cfg = BucketConfig.from_dict({"240p": {51: [1.0, 20], 102: [[1.0, 0.33], 10]}})
    got = [cfg.assign(f"c{i}", 240, 426, 150).bucket for i in range(4000)]
    share = sum(b == "240p/102/0.56" for b in got) / len(got)
    assert 0.30 < share < 0.36 and set(got) == {"240p/51/0.56", "240p/102/0.56"}
    assert cfg.assign("c", 240, 426, 60).bucket == "240p/51/0.56"  # 102 does not fit: no draw needed
    never = BucketConfig.from_dict({"480p": {51: [1.0, 5], 102: [0.0, 0]}, "240p": {102: [1.0, 10]}})
    assert never.assign("c", 480, 854, 150).bucket == "240p/102/0.56"  # reaches 480p x 102: demoted
    assert never.assign("c", 480, 854, 60).bucket == "480p/51/0.56"  # stops at 480p x 51: kept
    with pytest.raises(ValueError, match="no batch size"):
        never.batch_size("480p/102/0.56")
