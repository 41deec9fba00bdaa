"""A cache unit's caption shard: the captions the plan gave the unit (``encode_text``: the first unit of
its plan that holds each new caption), each encoded once by the text encoder into
``ROOT/store/text/<cache>/<unit>-<plan>-KK.tar`` (cache/store.py), published through the unit's claim."""

from __future__ import annotations

from pathlib import Path

import torch

from reelcache import UserError
from reelcache.base.latents import LATENT_EXT, encode
from reelcache.base.shards import ShardWriter
from reelcache.cache.encoders import TextEncoder
from reelcache.cache.store import store_dir


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
