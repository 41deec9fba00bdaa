"""What a plan finds in the store (cache/store.py) before anything runs.

For every (clip, view) draw of the manifest: its caption's ``text_key`` and, when the clip's raw bytes
were hashed before by any cache of the root (the video indexes map raw locations to content hashes),
its ``video_key``. A key the store holds is reused: the plan row carries the existing location
(``reuse_shard``, ``reuse_offset``, ``reuse_shape``; ``text_shard``, ``text_offset``, ``text_len``)
and the unit encodes nothing for it. Each caption the store lacks goes to the first unit that uses it
(``encode_text``). A re-planned cache keeps each finished unit whose clips and draws are unchanged and
whose captions are all stored (its sidecar stays valid); the others run again, reusing their latents.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pyarrow.parquet as pq

from reelcache.base.latents import text_key
from reelcache.cache.store import known_content, raw_stamp_of, read_index, text_digest, video_digest, video_key

# What a unit's rows mean (the rest is where things are and who encodes them): equal -> its sidecar holds.
WHAT = (
    "clip_id",
    "view",
    "bucket",
    "num_frames",
    "height",
    "width",
    "window_start",
    "raw_shard",
    "raw_offset",
    "file_size",
    "text",
)


def _indexes(root) -> tuple[dict, dict]:
    v = read_index(root, "video", ["video_key", "shard", "shard_offset", "shape"])
    t = read_index(root, "text", ["text_key", "shard", "shard_offset", "text_len"])
    video = {k: (s, o, sh) for k, s, o, sh in zip(*(v[c].to_pylist() for c in v.column_names))}
    text = {k: (s, o, n) for k, s, o, n in zip(*(t[c].to_pylist() for c in t.column_names))}
    return video, text


def plan_store(root, cfg, ident: dict, clips: list, raw_root=None) -> tuple[list[dict], list, list[int]]:
    """(plan rows of views 0..K-1, the cost table's draws, finished units to run again) for `clips`
    (cache/plan.py: _draws), each draw marked ``reused`` when the store holds its latent."""
    tdig, vdig = text_digest(ident), video_digest(ident)
    content = known_content(root)
    video, text = _indexes(root)
    stamps: dict = {}
    rows, draws = [], []
    for i, (r, clip_draws) in enumerate(clips):
        if r["shard"] not in stamps:
            try:
                stamps[r["shard"]] = raw_stamp_of(raw_root or root, r["shard"])  # an s3:// root: its object
            except OSError:
                stamps[r["shard"]] = None
        stamp = stamps[r["shard"]]
        chash = content.get((r["shard"], r["shard_offset"], r["file_size"], stamp))
        tkey = text_key(tdig, r["text"] or "")
        tloc = text.get(tkey, (None, None, None))
        for d in clip_draws:
            vkey = video_key(vdig, chash, d, cfg.resize, cfg.store, cfg.seed) if chash and d["bucket"] else None
            hit = video.get(vkey) if vkey and d["same_as"] is None else None
            d["reused"] = hit is not None
            if d["view"] >= cfg.views:  # drawn for the cost table only
                continue
            hit = hit or (None, None, None)
            rows.append(
                {
                    "clip_id": r["clip_id"],
                    "raw_shard": r["shard"],
                    "raw_offset": r["shard_offset"],
                    "file_size": r["file_size"],
                    "fps": r.get("fps"),
                    "text": r["text"],
                }
                | {k: v for k, v in d.items() if k != "reused"}
                | {"unit": i // cfg.clips_per_unit, "raw_stamp": stamp, "content_hash": chash, "video_key": vkey}
                | {"reuse_shard": hit[0], "reuse_offset": hit[1], "reuse_shape": hit[2]}
                | {"text_key": tkey, "text_shard": tloc[0], "text_offset": tloc[1], "text_len": tloc[2]}
                | {"encode_text": False}
            )
        draws.append((r["text"], tkey, tkey in text, clip_draws))
    keep, stale = kept_units(Path(root) / "latents" / cfg.name, rows, text)
    owned: set = set()
    for row in rows:  # each caption the store lacks: encoded once, by the first unit (not kept) using it
        if row["bucket"] and row["text_shard"] is None and row["unit"] not in keep and row["text_key"] not in owned:
            row["encode_text"] = True
            owned.add(row["text_key"])
    return rows, draws, stale


def kept_units(cdir: Path, rows: list[dict], text: dict) -> tuple[set[int], list[int]]:
    """(finished units whose sidecars stay valid, finished units to run again) when re-planning."""
    old = cdir / "_plan" / "input.parquet"
    done = sorted(int(p.stem) for p in cdir.glob("[0-9]*.parquet"))
    if not done or not old.exists():
        return set(), []
    f = pq.ParquetFile(old)
    by_unit: dict = {}
    for r in rows:
        by_unit.setdefault(r["unit"], []).append({k: r[k] for k in WHAT})
    keep = set()
    for u in done:
        if u >= f.num_row_groups or u not in by_unit:
            continue
        was = [{k: r.get(k) for k in WHAT} for r in f.read_row_group(u).to_pylist()]
        side = pq.read_table(cdir / f"{u:06d}.parquet")
        if "text_key" not in side.column_names or was != by_unit[u]:
            continue
        if all(k in text for k, s in zip(side["text_key"].to_pylist(), side["status"].to_pylist()) if s == "ok"):
            keep.add(u)
    return keep, [u for u in done if u not in keep]


def plan_id(rows: list[dict]) -> str:
    """8 hex digits of what the plan's units hold: the name of their store shards (a re-plan that
    changes them never overwrites shards an older plan's rows reference)."""
    h = hashlib.sha256()
    for r in rows:
        h.update(json.dumps([r[k] for k in WHAT], default=str).encode())
    return h.hexdigest()[:8]
