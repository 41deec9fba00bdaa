"""A loader manifest as a ``Source`` (train/plan.py), and the reads of its rows.

A manifest (``catalog manifest --cache``) has a row per clip, or per (clip, view) for a cache of K
views, naming the shard and offset of the clip's latent and, for a cache in the content-addressed
store (cache/store.py), of its caption embedding. ``load_source`` keeps the rows that have latents
(loudly, when many lack them), in clip-id order, with the columns the plan and the reads need;
``read_row`` reads one row with ranged reads (base/latents.py's ``read_latent``). The loader
(train/loader.py) and the validation loss (eval/valloss.py) read through these.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from reelcache import UserError
from reelcache.base.buckets import bucket_geometry
from reelcache.base.latents import (
    MANIFEST_COLUMNS,
    TEXT_COLUMNS,
    VIEW_COLUMNS,
    decode,
    read_latent,
    read_member,
    shard_path,
    shard_problem,
)
from reelcache.catalog.manifest import fingerprint
from reelcache.train.plan import Source, clip_keys

# what other stages may use (train/__init__.py: PUBLIC)
__all__ = ["check_shards", "load_source", "read_row", "source_row"]


def load_source(path, weight: float = 1.0, min_kept: float = 0.5, view: int | None = None) -> Source:
    """A loader manifest -> Source. Rows without latents (no bucket/shard) are dropped, loudly.

    A manifest of a cache of K views has a row per (clip, view) and the columns ``view`` and ``views``
    (base/latents.py); `view` keeps one view's rows only (e.g. 0: a fixed set for validation)."""
    table = pq.read_table(path)
    missing = [c for c in MANIFEST_COLUMNS if c not in table.column_names]
    if missing:
        raise ValueError(f"{path} is not a loader manifest: missing {missing} (needs {list(MANIFEST_COLUMNS)})")
    columns = list(MANIFEST_COLUMNS) + [c for c in VIEW_COLUMNS if c in table.column_names]
    # a store's manifest names each caption's shard; format 1 (captions in the samples) has none, or all null
    if all(c in table.column_names for c in TEXT_COLUMNS) and table["text_shard"].null_count < table.num_rows:
        columns += list(TEXT_COLUMNS)
        table = table.filter(pc.is_valid(table["text_shard"]))
    table = table.select(columns + (["fps"] if "fps" in table.column_names else []))
    total = table.num_rows
    table = table.filter(pc.and_(pc.is_valid(table["bucket"]), pc.is_valid(table["shard"])))
    views = _views(path, table)
    if view is not None:
        table = table.filter(pc.equal(table["view"], view)) if "view" in table.column_names else table
        views = 1
    table = table.sort_by([("clip_id", "ascending")] + ([("view", "ascending")] if "view" in columns else []))
    for bucket in pc.unique(table["bucket"]).to_pylist():  # a cache planned before Open-Sora's bucket tables
        try:
            bucket_geometry(bucket)
        except UserError as e:
            raise UserError(f"{path}: {e}") from None
    if table.num_rows == 0:
        raise ValueError(f"{path}: none of its {total} clips has latents (bucket and shard are empty)")
    if table.num_rows < min_kept * total:
        warnings.warn(
            f"{path}: only {table.num_rows} of {total} clips have latents "
            f"({100 * table.num_rows / total:.1f}%); the rest are skipped",
            stacklevel=2,
        )
    # fps is what the model conditions on, not what selects samples: it stays out of the fingerprint.
    fps = (
        table["fps"].to_numpy(zero_copy_only=False).astype(np.float64)
        if "fps" in table.column_names
        else np.full(table.num_rows, np.nan)
    )
    table = table.select(columns)
    clip_id = np.asarray(table["clip_id"].to_pylist(), dtype=object)
    several = views > 1
    return Source(
        fingerprint(table),
        clip_id,
        np.asarray(table["bucket"].to_pylist(), dtype=object),
        np.asarray(table["shard"].to_pylist(), dtype=object),
        table["shard_offset"].to_numpy().astype(np.int64),
        float(weight),
        fps,
        table["view"].to_numpy().astype(np.int32) if several else None,
        views,
        clip_keys(clip_id) if several else None,
        np.asarray(table["text_shard"].to_pylist(), dtype=object) if "text_shard" in columns else None,
        table["text_offset"].to_numpy().astype(np.int64) if "text_shard" in columns else None,
    )


# A shard a cache unit wrote: store/<kind>/<cache>/<unit>-<plan>-KK.tar (cache/store.py), or format 1's
# latents/<cache>/<unit>-KK.tar; the unit is <cache>/<NNNNNN>, its sidecar latents/<cache>/<NNNNNN>.parquet.
_UNIT_SHARD = re.compile(r"(?:^|/)(?:store/(?:video|text)|latents)/([^/]+)/(\d{6})[^/]*\.tar$")


def check_shards(root, src: Source, manifest, rows=None, threads: int = 8) -> dict:
    """Every shard the rows `rows` of `src` (default all) name, latents and captions, exists and reaches
    past its last member, checked before a run reads any (one header read a local shard, one HEAD an S3 shard,
    on `threads` threads): else a UserError naming the shard, the cache unit that wrote it, and how to write it
    again. Returns each S3 shard's (size, version) by its URL (base/s3fetch.py: shard_heads; the loader's
    ranged reads bound a shard's last member by its size, its local cache keys members by its version)."""
    from reelcache.base.s3fetch import TAR_END, shard_heads

    idx = np.arange(len(src.clip_id)) if rows is None else np.asarray(rows, dtype=np.int64)
    sizes = {}
    for shards, offsets in ((src.shard, src.offset), (src.text_shard, src.text_offset)):
        if shards is None:
            continue
        table = pa.table({"shard": pa.array(shards[idx].tolist(), pa.string()), "offset": offsets[idx]})
        table = table.filter(pc.is_valid(table["shard"]))  # no caption shard: the sample holds its caption
        last = table.group_by("shard").aggregate([("offset", "max"), ("offset", "count")])
        found = list(zip(*(last[c].to_pylist() for c in ("shard", "offset_max", "offset_count"))))
        urls = [shard_path(root, shard) for shard, _, _ in found]
        got = shard_heads([u for u in urls if u.startswith("s3://")], threads)
        sizes.update(got)
        for (shard, offset, n), url in zip(found, urls):
            if url.startswith("s3://"):
                size = got[url][0]
                problem = (
                    "is missing"
                    if size is None
                    else f"is short: {size} bytes, but a member starts at byte {offset}"
                    if size < offset + TAR_END
                    else None
                )
            else:
                problem = shard_problem(url, offset)
            if problem:
                raise UserError(f"{shard_named(root, shard, problem)} (named by {n} of {Path(manifest).name}'s rows)")
    return sizes


def shard_named(root, shard: str, problem: str) -> str:
    """`shard` and its problem, with the cache unit that wrote it and how to write it again."""
    m = _UNIT_SHARD.search(shard)
    if not m:
        return f"latent shard {shard} {problem}: write it again, or make the manifest from a cache that has it"
    cache, index = m.groups()
    r = f" --root {root}" if root is not None else ""
    return (
        f"latent shard {shard} {problem}: it was written by unit {cache}/{index} of cache {cache!r}; write it "
        f"again: delete latents/{cache}/{index}.parquet (the unit's sidecar), run `reelcache cache run{r} "
        f"{cache}/{index}` and `reelcache catalog merge{r}`, then make the manifest again (or re-plan the cache: "
        f"`reelcache cache plan`)"
    )


def _views(path, table) -> int:
    """K of a manifest: its ``views`` column, else 1 + its largest ``view``, else 1; rows checked."""
    if "view" not in table.column_names:
        return 1
    view = table["view"].fill_null(-1).to_numpy(zero_copy_only=False)
    k = int(pc.max(table["views"]).as_py() or 0) if "views" in table.column_names else int(view.max(initial=-1)) + 1
    if len(view) and (view.min() < 0 or view.max() >= max(k, 1)):
        raise ValueError(f"{path}: column view holds values outside 0..{k - 1} (views = {k})")
    if "views" in table.column_names and len(pc.unique(table["views"])) > 1:
        raise ValueError(f"{path}: column views is not one number: {pc.unique(table['views']).to_pylist()}")
    return max(k, 1)


def read_sample(path: str, offset: int) -> dict:
    """One tar member decoded: a ranged read at its offset (files), or a scan of the stream (URLs)."""
    return decode(read_member(path, offset))


def read_row(root, shard, offset, text_shard=None, text_offset=None, read=read_member) -> dict:
    """A manifest row's sample with its ``text`` (base/latents.py: read_latent; `read` as there)."""
    return read_latent(
        root, {"shard": shard, "shard_offset": offset, "text_shard": text_shard, "text_offset": text_offset}, read
    )


def source_row(root, src: Source, i: int) -> dict:
    """Row i of a Source as a sample with its ``text`` (the validation loss reads it so)."""
    ts = src.text_shard[i]
    return read_row(root, src.shard[i], int(src.offset[i]), ts, int(src.text_offset[i]) if ts is not None else None)
