"""The latent store: video latents and caption embeddings addressed by content, each stored once
under the root and referenced by every view, cache and stage that uses it (cache format 2).

Layout (a unit of a cache writes its new entries into shards named by the unit and its plan, so a
re-plan never overwrites shards that older plans' rows reference)::

    ROOT/store/video/<cache>/<unit>-<plan>-KK.tar    <video_key>.safetensors: mean, logvar | sample
    ROOT/store/video/<cache>/<unit>-<plan>.parquet   their index: video_key, shard, shard_offset, shape,
                                                     bytes, content_hash and the raw clip it came from
    ROOT/store/text/<cache>/<unit>-<plan>-KK.tar     <text_key>.safetensors: text
    ROOT/store/text/<cache>/<unit>-<plan>.parquet    their index: text_key, shard, shard_offset, text_len, bytes
    ROOT/latents/<cache>/NNNNNN.parquet              the unit's sidecar: one row per (clip, view), naming its
                                                     video latent and caption embedding (video_key, shard,
                                                     shard_offset, text_key, text_shard, text_offset)

Identity. ``text_key`` = hash(text encoder identity (kind, config, dtype, weights hash, versions,
max tokens) and how it is stored, exact caption). ``video_key`` = hash(VAE identity, preprocessing
identity (decode, resize, crop, range, dtype, window rule, frame interval, spatial multiple), the
clip's content hash, the encoded geometry T x H x W (and the bucket's exact size the "opensora"
resize covers), the window start, the store kind (and for ``store = "sample"``, the seed, view and
clip id its frozen draw comes from)). The content hash is blake2b-256 of the clip's raw bytes, computed
once, by the unit that first encodes the clip (it reads those bytes to decode them anyway), and kept in
the video index beside the raw location it was read from (shard, offset, size and the raw shard's
size:mtime stamp: a re-written shard is a new location). ``cache plan`` maps each manifest clip's raw
location to its content hash through these indexes, so a draw already encoded by any cache of the
root with the same identity is found before anything runs, and reused: its row points at the
existing latent. Only the rest is encoded.

Captions. The plan gives each caption not yet in the store to the first unit whose clips use it;
that unit encodes it once (whether or not its own clips decode) and writes it to its caption shard.
A row whose caption lives in the store already carries its location from the plan; a row whose
caption another unit of the same plan encodes names its ``text_key`` only, and ``catalog merge``
fills ``text_shard, text_offset`` from the caption indexes (table ``captions``). A manifest row
without a caption location is not loaded.

Garbage. ``gc`` lists the store's entries that no cache (unit sidecar or frozen plan) and no manifest
references, with their bytes; ``--delete`` removes each shard all of whose entries are garbage (and
their index rows); a shard that still holds live entries is kept and counted. Shards of a unit that
is running (its lease exists) are left alone, and so is what a unit publishes while gc runs
(cache/gc.py: the order of its reads). Today's format (``ROOT/latents/<cache>/*.tar``) is not
part of the store and is never touched.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from reelcache.base.buckets import bucket_geometry

VIDEO_INDEX = pa.schema(
    [
        ("video_key", pa.string()),
        ("shard", pa.string()),
        ("shard_offset", pa.int64()),
        ("shape", pa.list_(pa.int32())),
        ("bytes", pa.int64()),
        ("content_hash", pa.string()),
        ("raw_shard", pa.string()),
        ("raw_offset", pa.int64()),
        ("file_size", pa.int64()),
        ("raw_stamp", pa.string()),
    ]
)
TEXT_INDEX = pa.schema(
    [
        ("text_key", pa.string()),
        ("shard", pa.string()),
        ("shard_offset", pa.int64()),
        ("text_len", pa.int32()),
        ("bytes", pa.int64()),
    ]
)


def store_dir(root, kind: str, cache: str) -> Path:
    """ROOT/store/<video|text>/<cache>: where a cache's units write their new entries."""
    return Path(root) / "store" / kind / cache


def _digest(doc) -> str:
    return hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()


def text_digest(ident: dict) -> str:
    """The text encoder's identity (and how embeddings are stored) as one digest: half of a text_key."""
    return _digest({"text_encoder": ident["text_encoder"], "stored": ident["preprocess"]["text"]})


def video_digest(ident: dict) -> str:
    """Everything of a cache's identity that determines a latent besides the clip and its draw."""
    return _digest(
        {
            "video_encoder": ident["video_encoder"],
            "preprocess": {k: v for k, v in ident["preprocess"].items() if k != "text"},
            "spatial_multiple": ident["spatial_multiple"],
            "frame_interval": ident["buckets"]["frame_interval"],
            "store": ident["store"],
        }
    )


def video_key(digest: str, content: str, draw: dict, resize: str, store: str, seed: int) -> str:
    """The store's name of a draw's latent (module docstring: Identity)."""
    doc = [digest, content, draw["num_frames"], draw["height"], draw["width"], draw["window_start"]]
    if resize == "opensora":  # it covers the bucket's exact size before cropping to (H, W)
        doc.append(list(bucket_geometry(draw["bucket"])[1:]))
    if store == "sample":  # the frozen draw is seeded by (seed, view, clip id)
        doc += [seed, draw["view"], draw["clip_id"]]
    return hashlib.sha256(json.dumps(doc).encode()).hexdigest()[:32]


def raw_stamp(path) -> str:
    st = os.stat(path)
    return f"{st.st_size}:{st.st_mtime_ns}"


def raw_stamp_of(root, shard: str) -> str:
    """The stamp of raw shard `shard` (root-relative) of `root`: a file's ``raw_stamp``, or for a root in S3 the
    object's size and Last-Modified (a re-written shard is a new object, a new stamp); FileNotFoundError when
    absent."""
    from reelcache.base import s3

    if not s3.is_url(root):
        return raw_stamp(Path(root) / shard)
    url = s3.parse(root) / shard
    if (h := s3.head(url)) is None:
        raise FileNotFoundError(f"{url}: no such object")
    return f"{h['ContentLength']}:{int(h['LastModified'].timestamp()) * 10**9}"


def read_index(root, kind: str, columns: list[str] | None = None) -> pa.Table:
    """Every index of the store's `kind` (video or text), one table; empty when there is none."""
    schema = VIDEO_INDEX if kind == "video" else TEXT_INDEX
    files = sorted((Path(root) / "store" / kind).glob("*/*.parquet"))
    tables = [pq.read_table(p, columns=columns, schema=schema) for p in files]
    if not tables:
        return schema.empty_table().select(columns or schema.names)
    return pa.concat_tables(tables)


def write_index(path: Path, rows: list[dict], kind: str, claim) -> None:
    """A unit's store index, published through the unit's `claim` (base/units.py): renamed into place while
    the unit's lease is still its run's."""
    with claim.publish(path) as tmp:
        pq.write_table(pa.Table.from_pylist(rows, schema=VIDEO_INDEX if kind == "video" else TEXT_INDEX), tmp)


def known_content(root) -> dict:
    """(raw shard, offset, size, raw stamp) -> content hash, from every video index of the root."""
    t = read_index(root, "video", ["content_hash", "raw_shard", "raw_offset", "file_size", "raw_stamp"])
    return {
        (s, o, n, st): h
        for h, s, o, n, st in zip(*(t[c].to_pylist() for c in ("content_hash", *t.column_names[1:])))
        if h is not None
    }


def clear_store_unit(root, cache: str, stem: str, claim) -> None:
    """What a killed or failed run of a unit left in the store: its shards and their indexes (not yet
    referenced), each removed through the unit's `claim`, only while its lease is still this run's (a run
    that lost it leaves these names to the run that took the unit over)."""
    for kind in ("video", "text"):
        d = store_dir(root, kind, cache)
        if d.is_dir():
            claim.clear(d, stem)
            claim.unlink([d / f"{stem}.parquet"])
