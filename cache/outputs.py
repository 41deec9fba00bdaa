"""A cache unit's outcome rows (cache/run.py runs the unit): one per planned (clip, view), made before any
work (draws the store holds are ok from the start, cache/reuse.py), a clip that fits no bucket rejected
with its reason (reelcache/rejects.py: ``Reason``), a view that repeats an earlier view's draw given that
view's sample, and the unit's sidecar: the rows as the ``latents`` table of catalog/schema.sql. The unit's
captions are cache/captions.py's."""

from __future__ import annotations

from reelcache.catalog.db import arrow_schema, sidecar_table
from reelcache.rejects import Reason


def no_bucket(row: dict):
    """A step before any work: a clip that fits no bucket (the plan says why) is recorded, never decoded."""
    if not row["bucket"]:
        return Reason(f"no_bucket:{row['plan']['no_bucket']}"), None
    return None


def planned_rows(rows: list[dict], name: str, unit: str) -> list[dict]:
    """The unit's outcome rows before any work, each with its plan row (``plan``): a draw the store
    holds is ok and reused; the others are ok until a step rejects them."""
    out = []
    for r in rows:
        row = {
            "clip_id": r["clip_id"],
            "view": r["view"],
            "cache": name,
            "unit": unit,
            "status": "ok",
            "reject_reason": None,
            "bucket": r["bucket"],
            "num_frames": r["num_frames"],
            "height": r["height"],
            "width": r["width"],
            "window_start": r["window_start"],
            "text_key": r["text_key"],
            "text_shard": r["text_shard"],
            "text_offset": r["text_offset"],
            "text_len": r["text_len"],
            "plan": r,
        }
        if r["bucket"] and r["same_as"] is None and r["reuse_shard"] is not None:  # the store holds it
            row.update(
                shape=r["reuse_shape"],
                shard=r["reuse_shard"],
                shard_offset=r["reuse_offset"],
                video_key=r["video_key"],
                reused=True,
            )
        out.append(row)
    return out


_OWN = ("clip_id", "view", "unit", "cache")  # a repeated view keeps these; the rest is the earlier view's


def repeat_views(rows: list[dict]) -> None:
    """A view that drew what an earlier view of its clip drew gets that view's outcome: its sample."""
    by_key = {(r["clip_id"], r["view"]): r for r in rows}
    for r in rows:
        if r["bucket"] and (same_as := r["plan"]["same_as"]) is not None:
            src = by_key[(r["clip_id"], same_as)]
            r.update({k: src.get(k) for k in arrow_schema("latents").names if k not in _OWN})


def sidecar(rows: list[dict], metadata: dict):
    """The unit's sidecar: its rows as the ``latents`` table (their plan rows left out), with `metadata`."""
    return sidecar_table("latents", rows, strict=False).replace_schema_metadata(
        {k: str(v) for k, v in metadata.items()}
    )
