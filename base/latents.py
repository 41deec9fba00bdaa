"""The latent sample format: the contract between ``cache`` (writer) and ``train`` (reader).

A latent shard is a webdataset tar like the raw shards (base/shards.py), one member per
sample. Since the content-addressed store (cache/store.py, cache format 2) a sample is two members
in two shards, each stored once under the root however many views, caches and stages use it:

- the video latent, ``ROOT/store/video/<cache>/<unit>-<plan>-KK.tar``, member ``<video_key>.safetensors``:
  ``mean`` and ``logvar`` (the VAE posterior, sampled at load time so every epoch sees fresh noise),
  or ``sample`` when the cache stores one frozen draw; bf16, shape [C, T, H, W]; metadata
  ``video_key``, ``bucket``;
- the caption embedding, ``ROOT/store/text/<cache>/<unit>-<plan>-KK.tar``, member
  ``<text_key>.safetensors``: ``text``, the embedding trimmed to its real tokens, bf16, [L, D];
  metadata ``text_key``. One per (text encoder identity, exact caption): ``text_key``.

A loader manifest is a parquet with at least ``clip_id, bucket, shard, shard_offset`` (shard: a
path relative to ROOT, an absolute path, or any URL webdataset opens; shard_offset: where the
member's data starts) and, for a store sample, ``text_shard, text_offset``: where its caption
embedding starts. A manifest of a cache of K views also has ``view`` (0 .. K-1; a row per view a
clip has a latent for, two views that drew the same bucket and window at the same shard and
offset) and ``views`` (K); without them a manifest is one view per clip.

Today's format before the store (cache format 1, ``ROOT/latents/<cache>/NNNNNN-KK.tar``): one
member ``<clip_id>[-v<v>].safetensors`` holding the latent and ``text`` together, and manifests
without ``text_shard``. It still loads as it is: ``read_latent`` takes the caption from the sample
when the row names no text shard. No migration is needed.

``read_latent(root, row)`` is the one public reader of a sample (the loader, the validation loss
and the viewer use it): the video tensors and ``text`` of a manifest or ``latents`` catalog row.
"""

from __future__ import annotations

import hashlib
import os
import tarfile
from pathlib import Path

# safetensors.torch (torch) is imported by encode and decode: the loader reads MANIFEST_COLUMNS while it
# plans, and `reelcache loader simulate` plans without torch.

LATENT_EXT = "safetensors"
MANIFEST_COLUMNS = ("clip_id", "bucket", "shard", "shard_offset")
VIEW_COLUMNS = ("view", "views")  # optional: a cache of several views (see above)
TEXT_COLUMNS = ("text_shard", "text_offset")  # a store sample's caption embedding (see above)


def encode(tensors: dict, **meta: str) -> bytes:
    from safetensors.torch import save

    return save({k: v.contiguous() for k, v in tensors.items()}, metadata={k: str(v) for k, v in meta.items()})


def decode(data: bytes) -> dict:
    from safetensors.torch import load

    return load(data)


def text_key(encoder_digest: str, caption: str) -> str:
    """The store's name of a caption embedding: (text encoder identity digest, exact caption)."""
    return hashlib.sha256(f"{encoder_digest}\0{caption}".encode()).hexdigest()[:32]


def shard_path(root, shard: str) -> str:
    """A manifest's shard as a readable location: URLs, ``pipe:`` commands and absolute paths as
    they are, other paths relative to the data root."""
    if "://" in shard or shard.startswith("pipe:") or os.path.isabs(shard) or root is None:
        return shard
    if str(root).startswith("s3://"):  # a root in object storage (docs/STORAGE.md)
        return f"{str(root).rstrip('/')}/{shard}"
    return str(Path(root) / shard)


def read_member(path: str, offset: int) -> bytes:
    """A tar member's data: a ranged read at its offset (files), exact ranged GETs (``s3://``: base/s3fetch.py), or
    a scan of the stream (other URLs)."""
    if path.startswith("s3://"):
        from reelcache.base import s3fetch

        return s3fetch.read_member(path, offset)
    if "://" in path or path.startswith("pipe:"):
        import webdataset as wds

        with wds.gopen(path, "rb") as stream, tarfile.open(fileobj=stream, mode="r|") as tar:
            for m in tar:
                if m.offset_data == offset:
                    return tar.extractfile(m).read()
        raise ValueError(f"no member at offset {offset} in {path}")
    with open(path, "rb", buffering=0) as f:
        head = os.pread(f.fileno(), 512, offset - 512)
        size = tarfile.TarInfo.frombuf(head, tarfile.ENCODING, "surrogateescape").size
        return os.pread(f.fileno(), size, offset)


def shard_problem(path: str, last_offset: int) -> str | None:
    """Why a local shard cannot serve a member whose data starts at `last_offset` (None: it can): missing,
    or too short to hold that member (its header says how long it is). URLs and pipes are not checked."""
    if "://" in path or path.startswith("pipe:"):
        return None
    try:
        with open(path, "rb", buffering=0) as f:
            size = os.fstat(f.fileno()).st_size
            head = os.pread(f.fileno(), 512, last_offset - 512) if last_offset >= 512 else b""
    except FileNotFoundError:
        return "is missing"
    except OSError as e:
        return f"cannot be read ({e.strerror or e})"
    if size < last_offset:
        return f"is short: {size} bytes, but a member starts at byte {last_offset}"
    try:
        need = last_offset + tarfile.TarInfo.frombuf(head, tarfile.ENCODING, "surrogateescape").size
    except tarfile.HeaderError:
        return f"holds no tar member at byte {last_offset} (rewritten since the manifest was made?)"
    if size < need:
        return f"is short: {size} bytes, but its member at byte {last_offset} ends at byte {need}"
    return None


def read_latent(root, row: dict, read=read_member) -> dict:
    """One latent sample of a manifest or ``latents`` row (``shard``, ``shard_offset`` and, for a store
    sample, ``text_shard``, ``text_offset``): {'mean', 'logvar'} or {'sample'}, and 'text' [L, D]. `read(path,
    offset)`: a member's bytes (the loader passes one that takes what it fetched ahead)."""
    sample = decode(read(shard_path(root, row["shard"]), int(row["shard_offset"])))
    if row.get("text_shard") is not None:  # a store sample: its caption lives once, in a caption shard
        sample["text"] = decode(read(shard_path(root, row["text_shard"]), int(row["text_offset"])))["text"]
    return sample
