"""The latent sample format: the contract between ``cache`` (writer) and ``train`` (reader).

A latent shard is a webdataset tar like the raw shards (catalog/shards.py), one member per
sample: ``<clip_id>.safetensors`` holding

- ``mean`` and ``logvar`` (the VAE posterior, sampled at load time so every epoch sees fresh
  noise), or ``sample`` when the VAE exposes no posterior; bf16, shape [C, T, H, W];
- ``text``: the caption embedding trimmed to its real tokens, bf16, shape [L, D];

and string metadata in the safetensors header: ``clip_id``, ``bucket`` (and ``view`` in a cache of
several views, whose view v >= 1 of a clip is the member ``<clip_id>-v<v>.safetensors``). A loader
manifest is a parquet with at least ``clip_id, bucket, shard, shard_offset`` (shard: a path
relative to ROOT, an absolute path, or any URL webdataset opens; shard_offset: where the member's
data starts). A manifest of a cache of K views also has ``view`` (0 .. K-1; a row per view a clip
has a latent for, two views that drew the same bucket and window at the same shard and offset) and
``views`` (K); without them a manifest is one view per clip.
"""

from __future__ import annotations

# safetensors.torch (torch) is imported by encode and decode: the loader reads MANIFEST_COLUMNS while it
# plans, and `reelcache loader simulate` plans without torch.

LATENT_EXT = "safetensors"
MANIFEST_COLUMNS = ("clip_id", "bucket", "shard", "shard_offset")
VIEW_COLUMNS = ("view", "views")  # optional: a cache of several views (see above)


def encode(tensors: dict, **meta: str) -> bytes:
    from safetensors.torch import save

    return save({k: v.contiguous() for k, v in tensors.items()}, metadata={k: str(v) for k, v in meta.items()})


def decode(data: bytes) -> dict:
    from safetensors.torch import load

    return load(data)
