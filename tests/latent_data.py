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
) -> Path:
    """n samples over the buckets, several shards; returns the loader manifest's path.
    With fps=True the manifest also has an ``fps`` column (24, 25 or 30000/1001 per clip)."""
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
    rows = []
    for i in range(n):
        clip = hashlib.blake2b(f"{name}/{i}".encode(), digest_size=10).hexdigest()
        bucket = buckets[int(rng.integers(len(buckets)))]
        t, h, w = BUCKETS.get(bucket, (5, 4, 6))
        length = int(rng.integers(3, 12))
        tensors = {"text": torch.randn(length, 8, generator=g).bfloat16()}
        if posterior:
            tensors["mean"] = torch.randn(4, t, h, w, generator=g).bfloat16()
            tensors["logvar"] = (torch.randn(4, t, h, w, generator=g) - 3).bfloat16()
        else:
            tensors["sample"] = torch.randn(4, t, h, w, generator=g).bfloat16()
        shard, offsets = writer.write_sample(clip, [(LATENT_EXT, encode(tensors, clip_id=clip, bucket=bucket), None)])
        rows.append(
            {"clip_id": clip, "bucket": bucket, "shard": f"latents/{name}/{shard}", "shard_offset": offsets[LATENT_EXT]}
        )
        if fps:
            rows[-1]["fps"] = [24.0, 25.0, 30000 / 1001][i % 3]
    writer.close()
    path = Path(root) / "manifests" / f"{name}.parquet"
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path
