"""``cache run UNIT``: decode one unit's clips for their buckets and encode them, once.

Decoding runs in isolated worker processes (a deadline and an optional memory cap per clip; a
clip that fails to decode becomes a recorded reject), reading the video straight out of the raw
shard. While the workers decode ahead, the parent batches clips of one bucket and runs the VAE,
encodes captions (identical captions once), validates every output (shape, dtype, finite), and
appends ``<clip_id>.safetensors`` samples to size-capped latent shards. The sidecar parquet, one
row per planned clip with its bucket, latent shape, shard and offset or its reject reason, is
written last. A unit whose sidecar exists is skipped; one killed at any moment is cleaned and
redone. Before any work the unit checks that its encoders have the identity in cache.json.
"""

from __future__ import annotations

import functools
import time
from collections import defaultdict
from pathlib import Path

from reelcache import UserError
from reelcache.cache.plan import CacheConfig, cache_dir, diff, identity, load_cache, projection
from reelcache.catalog.buckets import BucketConfig
from reelcache.catalog.shards import ShardWriter, atomic_path, begin_unit, parse_unit, unit_rows
from reelcache.isolate import Failed, isolated_map
from reelcache.progress import bar, say


def decode_clip(job: dict, root: str) -> "object":
    from reelcache.cache.decode import FileSlice, decode_window

    src = FileSlice(str(Path(root) / job["raw_shard"]), job["raw_offset"], job["file_size"])
    try:
        return decode_window(src, frames=job["num_frames"], interval=job["interval"], height=job["height"],
                             width=job["width"], start=job["window_start"], fps=job["fps"])
    finally:
        src.close()


def _preload():
    import av  # noqa: F401
    import numpy  # noqa: F401


def run_unit(root: str, unit: str, device: str | None = None) -> dict:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch

    from reelcache.cache.encoders import TextEncoder, VideoEncoder, default_device
    from reelcache.catalog.latents import LATENT_EXT, encode

    name, index = parse_unit(unit)
    plan, ident = load_cache(root, name)
    cfg = _config(plan["config"])
    if not 0 <= index < plan["num_units"]:
        raise UserError(f"{unit}: cache {name!r} has units 0..{plan['num_units'] - 1}")
    buckets = BucketConfig.from_toml(cfg.buckets)
    if d := diff(ident, identity(cfg, buckets, ident["manifest_fingerprint"])):
        raise UserError(f"{unit}: this node's encoders differ from cache.json; refusing to mix latents:\n  "
                        + "\n  ".join(d[:12]))
    cdir = cache_dir(root, name)
    stem = f"{index:06d}"
    sidecar = begin_unit(cdir, index)
    if sidecar is None:
        say(f"{unit}: already done, skipped")
        return {"unit": unit, "skipped": True}
    t0 = time.monotonic()
    rows = unit_rows(cdir, index)
    out = {}
    for r in rows:
        out[r["clip_id"]] = {"clip_id": r["clip_id"], "cache": name, "unit": unit, "status": "rejected",
                             "reject_reason": f"no_bucket:{r['no_bucket']}" if not r["bucket"] else None,
                             "bucket": r["bucket"], "num_frames": r["num_frames"], "height": r["height"],
                             "width": r["width"], "window_start": r["window_start"]}
    jobs = [dict(r, interval=buckets.frame_interval) for r in rows if r["bucket"]]

    device = device or default_device()
    video = VideoEncoder(cfg.video_encoder, device)
    text = TextEncoder(cfg.text_encoder, device)
    writer = ShardWriter(cdir, stem, int(cfg.shard_mb * 1e6))
    captions: dict[str, object] = {}
    pending: dict[str, list] = defaultdict(list)
    stats = {"clips": 0, "frames": 0, "bytes": 0, "encode_s": 0.0}

    def reject(clip, reason, detail):
        out[clip].update(status="rejected", reject_reason=reason, reject_detail=str(detail)[:2000])

    def flush(bucket):
        batch, pending[bucket] = pending[bucket], []
        if not batch:
            return
        t = time.monotonic()
        latents = video.encode(np.stack([frames for _, frames in batch]))
        todo = [j["text"] or "" for j, _ in batch if (j["text"] or "") not in captions]
        for i in range(0, len(todo), cfg.text_batch_size):
            chunk = list(dict.fromkeys(todo[i:i + cfg.text_batch_size]))
            captions.update(zip(chunk, text.encode(chunk)))
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        stats["encode_s"] += time.monotonic() - t
        for k, (job, frames) in enumerate(batch):
            tensors = {key: v[k].clone() for key, v in latents.items()}
            if cfg.store == "sample":          # one frozen draw, seeded by (seed, clip id): reruns agree
                g = torch.Generator().manual_seed(int.from_bytes(job["clip_id"].encode()[:8], "big") ^ cfg.seed)
                tensors = {"sample": (tensors["mean"].float() + torch.exp(0.5 * tensors["logvar"].float())
                                      * torch.randn(tensors["mean"].shape, generator=g)).bfloat16()}
            tensors["text"] = captions[job["text"] or ""]
            if not all(torch.isfinite(v.float()).all() for v in tensors.values()):
                reject(job["clip_id"], "invalid_latent", "non-finite values in the encoder output")
                continue
            data = encode(tensors, clip_id=job["clip_id"], bucket=bucket)
            shard, offsets = writer.write_sample(job["clip_id"], [(LATENT_EXT, data, None)])
            shape = list(tensors.get("mean", tensors.get("sample")).shape)
            out[job["clip_id"]].update(status="ok", shape=shape, text_len=int(tensors["text"].shape[0]),
                                       shard=f"latents/{name}/{shard}", shard_offset=offsets[LATENT_EXT])
            stats["clips"] += 1
            stats["frames"] += job["num_frames"]
            stats["bytes"] += len(data)

    fn = functools.partial(decode_clip, root=str(root))
    try:
        with bar(len(rows), unit, "clip") as pbar:
            pbar.update(len(rows) - len(jobs))
            for job, res in isolated_map(fn, jobs, workers=cfg.workers, timeout=cfg.decode_timeout,
                                         memory_mb=cfg.worker_memory_mb, init=_preload):
                pbar.update(1)
                if isinstance(res, Failed):
                    reject(job["clip_id"], res.reason if res.reason in ("timeout", "crashed") else "undecodable",
                           res.detail)
                elif isinstance(res, BaseException):
                    reject(job["clip_id"], "undecodable", f"{type(res).__name__}: {res}")
                else:
                    pending[job["bucket"]].append((job, res))
                    if len(pending[job["bucket"]]) >= cfg.batch_size:
                        flush(job["bucket"])
                        pbar.set_postfix(clips_s=f"{stats['clips'] / max(1e-9, time.monotonic() - t0):.1f}",
                                         MB_s=f"{stats['bytes'] / 1e6 / max(1e-9, time.monotonic() - t0):.1f}")
            for b in list(pending):
                flush(b)
        writer.close()
    except BaseException:
        writer.abort()
        raise

    schema = pa.schema([("clip_id", pa.string()), ("cache", pa.string()), ("unit", pa.string()),
                        ("status", pa.string()), ("reject_reason", pa.string()), ("reject_detail", pa.string()),
                        ("bucket", pa.string()), ("num_frames", pa.int32()), ("height", pa.int32()),
                        ("width", pa.int32()), ("window_start", pa.int64()), ("shape", pa.list_(pa.int32())),
                        ("text_len", pa.int32()), ("shard", pa.string()), ("shard_offset", pa.int64())])
    table = pa.Table.from_pylist(list(out.values()), schema=schema).replace_schema_metadata(
        {"encode_seconds": str(stats["encode_s"]), "encoded_clips": str(stats["clips"])})
    with atomic_path(sidecar) as tmp:
        pq.write_table(table, tmp)
    dt = time.monotonic() - t0
    ok = stats["clips"]
    say(f"{unit}: {len(rows)} clips, {ok} encoded, {len(rows) - ok} rejected; {stats['frames'] / dt:.0f} frames/s, "
        f"{ok / dt:.2f} clips/s, {stats['bytes'] / 1e6 / dt:.1f} MB/s of latents in {dt:.1f} s on {device}")
    say(projection(cdir, plan["num_clips"]))
    return {"unit": unit, "clips": len(rows), "ok": ok, "seconds": dt}


def _config(doc: dict) -> CacheConfig:
    from reelcache.cache.encoders import EncoderSpec

    doc = dict(doc)
    doc["video_encoder"] = EncoderSpec(**doc["video_encoder"])
    doc["text_encoder"] = EncoderSpec(**doc["text_encoder"])
    return CacheConfig(**doc)
