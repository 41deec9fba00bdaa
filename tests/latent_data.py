"""Latent shards in the cache's format (base/latents.py), written by the tests themselves."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

BUCKETS = {"144p/17/0.56": (5, 4, 6), "144p/33/0.56": (9, 4, 6), "240p/17/1.00": (5, 6, 6), "240p/33/0.56": (9, 6, 8)}


def write_latents(
    root: Path,
    n: int,
    name: str = "test",
    seed: int = 0,
    shard_bytes: int = 48_000,
    buckets=None,
    posterior: bool = True,
    fps: bool = False,
    store: bool = False,
    channels: int = 4,
    text_dim: int = 8,
) -> Path:
    """n samples over the buckets, several shards; returns the loader manifest's path.
    With fps=True the manifest also has an ``fps`` column (24, 25 or 30000/1001 per clip). With store=True each
    sample is two members in two shards, as the content-addressed store writes them (base/latents.py): the
    latent in ``latents/<name>``, its caption embedding in ``latents/<name>-text``, and the manifest has
    ``text_shard, text_offset``. channels, text_dim: the latent's channels and the embedding's width."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch

    from reelcache.base.latents import LATENT_EXT, encode
    from reelcache.base.shards import ShardWriter

    buckets = buckets or list(BUCKETS)
    rng = np.random.default_rng(seed)
    g = torch.Generator().manual_seed(seed)
    out = Path(root) / "latents" / name
    out.mkdir(parents=True, exist_ok=True)
    writer = ShardWriter(out, "000000", shard_bytes)
    if store:
        (Path(root) / "latents" / f"{name}-text").mkdir(parents=True, exist_ok=True)
        texts = ShardWriter(Path(root) / "latents" / f"{name}-text", "000000", shard_bytes)
    rows = []
    for i in range(n):
        clip = hashlib.blake2b(f"{name}/{i}".encode(), digest_size=10).hexdigest()
        bucket = buckets[int(rng.integers(len(buckets)))]
        t, h, w = BUCKETS.get(bucket, (5, 4, 6))
        length = int(rng.integers(3, 12))
        tensors = {"text": torch.randn(length, text_dim, generator=g).bfloat16()}
        if posterior:
            tensors["mean"] = torch.randn(channels, t, h, w, generator=g).bfloat16()
            tensors["logvar"] = (torch.randn(channels, t, h, w, generator=g) - 3).bfloat16()
        else:
            tensors["sample"] = torch.randn(channels, t, h, w, generator=g).bfloat16()
        row = {}
        if store:
            text = {"text": tensors.pop("text")}
            tshard, toffsets = texts.write_sample(clip, [(LATENT_EXT, encode(text, text_key=clip), None)])
            row = {"text_shard": f"latents/{name}-text/{tshard}", "text_offset": toffsets[LATENT_EXT]}
        shard, offsets = writer.write_sample(clip, [(LATENT_EXT, encode(tensors, clip_id=clip, bucket=bucket), None)])
        rows.append(
            {
                "clip_id": clip,
                "bucket": bucket,
                "shard": f"latents/{name}/{shard}",
                "shard_offset": offsets[LATENT_EXT],
                **row,
            }
        )
        if fps:
            rows[-1]["fps"] = [24.0, 25.0, 30000 / 1001][i % 3]
    writer.close()
    if store:
        texts.close()
    path = Path(root) / "manifests" / f"{name}.parquet"
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path
