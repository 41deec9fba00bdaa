"""The encoders an evaluation decodes and encodes with: the latent cache's own, found from the
manifests (``made_from``), rebuilt from its plan and checked against its cache.json (``cache_encoders``):
videos decoded by another VAE than the one that made the latents would be wrong without an error."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq

from reelcache import UserError
from reelcache.cache.encoders import TextEncoder, VideoEncoder
from reelcache.cache.plan import diff
from reelcache.cache.spec import spec_identity
from reelcache.log import say


def made_from(manifests: list[Path]) -> str:
    """The latent cache the first of ``manifests`` was made from: its sidecar's ``cache``, else the
    cache folder its first shard lies in (latents/<name>/...)."""
    for m in manifests:
        side = m.with_suffix(".json")
        if side.exists() and (name := json.loads(side.read_text()).get("cache")):
            return name

        shard = pq.read_table(m, columns=["shard"]).column(0)[0].as_py()
        parts = Path(shard).parts
        if "latents" in parts:
            return parts[parts.index("latents") + 1]
    raise UserError("cannot tell which latent cache's encoders to use: pass --cache NAME")


def cache_encoders(cfg, ident: dict, device: str) -> tuple[VideoEncoder, TextEncoder]:
    """(VideoEncoder, TextEncoder) from a cache's CacheConfig, refused when they differ from its
    identity (``ident``, its cache.json) in anything but library versions (those are said)."""
    specs = {"video_encoder": cfg.video_encoder, "text_encoder": cfg.text_encoder}
    for k, spec in specs.items():
        mine, theirs = spec_identity(spec), ident[k]
        if d := diff({**mine, "versions": None}, {**theirs, "versions": None}):
            raise UserError(
                f"the {k} here differs from the cache's cache.json (the videos would be decoded "
                "by another model):\n  " + "\n  ".join(d[:8])
            )
        if d := diff(mine["versions"], theirs["versions"]):
            say(f"  note: {k} library versions differ from the cache's: {'; '.join(d)}")
    say(
        f"  encoders of cache {ident['name']!r}: {specs['video_encoder'].kind} VAE, "
        f"{specs['text_encoder'].kind} text encoder on {device}"
    )
    return VideoEncoder(specs["video_encoder"], device), TextEncoder(specs["text_encoder"], device)
