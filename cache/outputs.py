"""What a cache unit writes besides its latents (cache/run.py runs it): its reject vocabulary, the unit's
outcome rows before any work (draws the store holds are ok from the start, cache/reuse.py) and its
sidecar table (the ``latents`` table of catalog/schema.sql), and its caption shard: the captions the plan
gave the unit (``encode_text``), each encoded once into ``ROOT/store/text/<cache>/<unit>-<plan>-KK.tar``
(cache/store.py)."""

from __future__ import annotations

from enum import Enum
from pathlib import Path

import torch

from reelcache import UserError
from reelcache.base.latents import LATENT_EXT, encode
from reelcache.base.shards import ShardWriter
from reelcache.cache.encoders import TextEncoder
from reelcache.cache.store import store_dir
from reelcache.catalog.db import arrow_schema, sidecar_table


class Reason(str, Enum):
    """Why a planned (clip, view) has no latent: the ``reject_reason`` of its ``latents`` row."""

    no_bucket_too_small = "no_bucket:too_small"  # fewer pixels than 0.8 x the smallest resolution's budget
    no_bucket_too_short = "no_bucket:too_short"  # large enough, but fewer frames than any bucket's span
    no_bucket_not_kept = "no_bucket:not_kept"  # it fits buckets, but their keep-probability draws dropped it
    undecodable = "undecodable"  # the window could not be decoded from the raw shard (the decoder's error)
    timeout = "timeout"  # decoding did not finish within decode_timeout; its worker was killed
    crashed = "crashed"  # the decode worker died on it (a decoder crash, worker_memory_mb exceeded)
    invalid_latent = "invalid_latent"  # the VAE gave non-finite values (NaN, inf): nothing stored
    withdrawn = "withdrawn"  # its clip was withdrawn by a takedown (lineage/takedown.py): latent removed


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


def encode_captions(root, rows, cfg, device, name: str, stem: str, claim) -> tuple[dict, list[dict], int]:
    """The captions this unit owns (the plan's ``encode_text``), each encoded once into the unit's caption
    shard (published through the unit's `claim`): ({text_key: (shard, offset, tokens)}, their index rows, tokens)."""
    todo = list({r["text_key"]: r["text"] or "" for r in rows if r["encode_text"]}.items())
    if not todo:
        return {}, [], 0
    text = TextEncoder(cfg.text_encoder, device)
    d = store_dir(root, "text", name)
    d.mkdir(parents=True, exist_ok=True)
    writer = ShardWriter(d, stem, int(cfg.shard_mb * 1e6), claim=claim)
    where, index, tokens = {}, [], 0
    try:
        for i in range(0, len(todo), cfg.text_batch_size):
            chunk = todo[i : i + cfg.text_batch_size]
            for (key, _), emb in zip(chunk, text.encode([c for _, c in chunk])):
                if not torch.isfinite(emb.float()).all():
                    raise UserError(
                        f"{name}: the text encoder gave non-finite values for caption {key}; nothing stored"
                    )
                data = encode({"text": emb}, text_key=key)
                shard, offsets = writer.write_sample(key, [(LATENT_EXT, data, None)])
                rel = str(Path("store", "text", name, shard))
                where[key] = (rel, offsets[LATENT_EXT], int(emb.shape[0]))
                index.append(
                    {"text_key": key, "shard": rel, "shard_offset": offsets[LATENT_EXT]}
                    | {"text_len": int(emb.shape[0]), "bytes": len(data)}
                )
                tokens += int(emb.shape[0])
        writer.close()
    except BaseException:
        writer.abort()
        raise
    return where, index, tokens
