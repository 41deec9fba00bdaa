"""What a cache unit writes besides its latents (cache/run.py runs it): the sidecar's schema, the unit's
outcome rows before any work (draws the store holds are ok from the start, cache/reuse.py), and its
caption shard: the captions the plan gave the unit (``encode_text``), each encoded once into
``ROOT/store/text/<cache>/<unit>-<plan>-KK.tar`` (cache/store.py)."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import torch

from reelcache import UserError
from reelcache.cache.encoders import TextEncoder
from reelcache.cache.store import store_dir
from reelcache.catalog.latents import LATENT_EXT, encode
from reelcache.catalog.shards import ShardWriter

SIDECAR = pa.schema(
    [
        ("clip_id", pa.string()),
        ("cache", pa.string()),
        ("unit", pa.string()),
        ("status", pa.string()),
        ("reject_reason", pa.string()),
        ("reject_detail", pa.string()),
        ("bucket", pa.string()),
        ("num_frames", pa.int32()),
        ("height", pa.int32()),
        ("width", pa.int32()),
        ("window_start", pa.int64()),
        ("shape", pa.list_(pa.int32())),
        ("text_len", pa.int32()),
        ("shard", pa.string()),
        ("shard_offset", pa.int64()),
        ("view", pa.int32()),
        ("video_key", pa.string()),
        ("reused", pa.bool_()),
        ("text_key", pa.string()),
        ("text_shard", pa.string()),
        ("text_offset", pa.int64()),
    ]
)


def planned_rows(rows: list[dict], name: str, unit: str) -> dict:
    """The unit's outcome rows before any work: rejected until encoded or reused."""
    out = {}
    for r in rows:
        r["key"] = (r["clip_id"], r["view"])
        out[r["key"]] = {
            "clip_id": r["clip_id"],
            "view": r["view"],
            "cache": name,
            "unit": unit,
            "status": "rejected",
            "reject_reason": f"no_bucket:{r['no_bucket']}" if not r["bucket"] else None,
            "bucket": r["bucket"],
            "num_frames": r["num_frames"],
            "height": r["height"],
            "width": r["width"],
            "window_start": r["window_start"],
            "text_key": r["text_key"],
            "text_shard": r["text_shard"],
            "text_offset": r["text_offset"],
            "text_len": r["text_len"],
        }
        if r["bucket"] and r["same_as"] is None and r["reuse_shard"] is not None:  # the store holds it
            out[r["key"]].update(
                status="ok",
                reject_reason=None,
                shape=r["reuse_shape"],
                shard=r["reuse_shard"],
                shard_offset=r["reuse_offset"],
                video_key=r["video_key"],
                reused=True,
            )
    return out


def encode_captions(root, rows, cfg, device, name: str, stem: str) -> tuple[dict, list[dict], int]:
    """The captions this unit owns (the plan's ``encode_text``), each encoded once into the unit's caption
    shard: ({text_key: (shard, offset, tokens)}, their index rows, tokens)."""
    todo = list({r["text_key"]: r["text"] or "" for r in rows if r["encode_text"]}.items())
    if not todo:
        return {}, [], 0
    text = TextEncoder(cfg.text_encoder, device)
    d = store_dir(root, "text", name)
    d.mkdir(parents=True, exist_ok=True)
    writer = ShardWriter(d, stem, int(cfg.shard_mb * 1e6))
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
