"""A cache unit's outcome rows (cache/outputs.py): the one reject vocabulary (reelcache/rejects.py) is the
names catalogs already hold, ``no_bucket`` (a step before any work) records the plan's reason, and a view
that repeats an earlier view's draw gets that view's outcome in the sidecar."""

from __future__ import annotations

from reelcache.base.buckets import BucketConfig
from reelcache.base.units import reject
from reelcache.cache import outputs
from reelcache.cache.outputs import planned_rows, repeat_views
from reelcache.rejects import Reason


def _plan_row(clip_id="c", view=0, bucket="144p/17/0.56", **over) -> dict:
    """A cache plan row (cache/reuse.py: plan_store) with what planned_rows reads."""
    return {
        "clip_id": clip_id,
        "view": view,
        "bucket": bucket,
        "num_frames": 17,
        "height": 144,
        "width": 256,
        "window_start": 3,
        "no_bucket": None if bucket else "too_small",
        "same_as": None,
        "reuse_shard": None,
        "text_key": "k",
        "text_shard": None,
        "text_offset": None,
        "text_len": None,
    } | over


def test_the_reject_vocabulary_is_what_catalogs_already_hold():
    """The one vocabulary (reelcache/rejects.py) is the names rows of existing catalogs carry, latents' (schema.sql's
    comment before the cache had a vocabulary) and clips' (ingest's before the two became one), and each
    reason bucket assignment gives (base/buckets.py) is one of them."""
    from reelcache.cache.outputs import no_bucket

    cache = "no_bucket:too_small no_bucket:too_short no_bucket:not_kept undecodable timeout crashed invalid_latent"
    ingest = "bad_row duplicate_row empty_caption missing_file empty_file too_large no_video_stream undecodable"
    ingest += " truncated too_short timeout crashed"
    assert {r.value for r in Reason} == {*cache.split(), *ingest.split(), "withdrawn"}  # withdrawn: a takedown's
    cfg = BucketConfig.from_dict({"240p": {51: [0.0, 8]}})
    sizes = {"too_small": (100, 100, 60), "too_short": (240, 426, 30), "not_kept": (240, 426, 60)}
    for why, (h, w, t) in sizes.items():
        a = cfg.assign("c", h, w, t)
        assert a.reason == why
        (row,) = planned_rows([_plan_row(bucket=a.bucket, no_bucket=a.reason)], "t", "t/000000")
        assert no_bucket(row) == (Reason(f"no_bucket:{why}"), None)
    (kept,) = planned_rows([_plan_row()], "t", "t/000000")
    assert no_bucket(kept) is None


def test_a_repeated_view_gets_its_earlier_views_outcome_and_keeps_its_own_name():
    rows = planned_rows(
        [_plan_row(view=0), _plan_row(view=1, same_as=0), _plan_row(view=2, window_start=9)], "t", "t/000000"
    )
    rows[0].update(shape=[4, 5, 18, 32], shard="store/video/t/000000-p-00.tar", shard_offset=1536, video_key="v")
    reject(rows[2], Reason.timeout, "no answer within 1 s")
    repeat_views(rows)
    table = outputs.sidecar(rows, {"encoded_clips": 1}).to_pylist()
    assert [(r["view"], r["status"], r["shard_offset"], r["unit"]) for r in table] == [
        (0, "ok", 1536, "t/000000"),
        (1, "ok", 1536, "t/000000"),
        (2, "rejected", None, "t/000000"),
    ]
    assert table[1]["video_key"] == "v" and table[2]["reject_reason"] == "timeout"
