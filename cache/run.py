"""``cache run UNIT``: decode one unit's clips for their buckets and encode them, once.

Decoding runs in isolated worker processes (a deadline and an optional memory cap per clip; a
clip that fails to decode becomes a recorded reject), reading the video straight out of the raw
shard; a worker runs ``cache/decode.py``'s ``decode_clip_shared`` and imports that module only, not
this one (torch, pyarrow). Each worker decodes a window straight into a shared-memory block named by
the parent (``/dev/shm``); only the block's name crosses the pipe, never the frames (pickling a
10-140 MB window through a pipe costs two copies and blocks the worker until the parent reads it). A
feeder thread keeps the workers busy, so decoding continues while the main thread encodes: the
parent batches clips of one bucket and runs the VAE, validates every output (shape, dtype, finite),
hashes the clip's raw bytes once and appends ``<video_key>.safetensors`` latents to size-capped
store shards (cache/store.py: ``ROOT/store/video/<cache>/<unit>-<plan>-KK.tar``). Before decoding,
the unit encodes the captions the plan gave it (``encode_text``: captions the store lacks, each
given to one unit) into its caption shard. Draws and captions the store already holds are not
touched: their rows point at the existing entries. The store indexes of what the unit wrote, then
the sidecar parquet (one row per planned clip and view with its bucket, latent shape, shard and
offset, caption key and location, or its reject reason) are written last; a view whose draw repeats
an earlier view's (the plan's ``same_as``) is not encoded again and its row points at that view's
latent.

A unit whose sidecar exists is skipped; one killed at any moment is cleaned and redone; a unit
another live run holds (catalog/shards.py: the lease) is refused. Reading a source may reject a
clip; writing our own outputs (latent shards, the sidecar, the shared-memory frames) may not:
such a failure is an OutputError, the unit fails with no sidecar and no store shards, and its re-run
gives the clean result. Before any work the unit checks that its encoders have the identity in
cache.json.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import queue
import threading
import time
from collections import defaultdict
from multiprocessing import shared_memory
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from reelcache import UserError
from reelcache.cache.decode import (
    FrameBufferError,
    clip_seed,
    decode_clip,  # noqa: F401 - tests and bench/ import it from here
    decode_clip_shared,
)
from reelcache.cache.encoders import VideoEncoder, default_device
from reelcache.cache.outputs import SIDECAR, encode_captions, planned_rows
from reelcache.cache.plan import CacheConfig, cache_dir, diff, identity, load_cache, projection
from reelcache.cache.store import (
    clear_store_unit,
    content_hash,
    raw_stamp,
    store_dir,
    video_digest,
    video_key,
    write_index,
)
from reelcache.catalog.buckets import BucketConfig
from reelcache.catalog.latents import LATENT_EXT, encode
from reelcache.catalog.shards import OutputError, ShardWriter, atomic_path, begin_unit, end_unit, parse_unit, unit_rows
from reelcache.isolate import Failed, isolated_map
from reelcache.progress import bar, say

_CALLS = itertools.count()


class SharedFrames:
    """The parent's handle on a decoded window in shared memory; `release` frees it."""

    def __init__(self, name: str, shape):
        self.shm = shared_memory.SharedMemory(name=name)
        self.array = np.ndarray(shape, np.uint8, buffer=self.shm.buf)

    def release(self):
        self.array = None
        self.shm.close()
        self.shm.unlink()


def _unlink_shared(name: str) -> None:
    try:
        shared_memory.SharedMemory(name=name).unlink()
    except (FileNotFoundError, OSError):
        pass


def decoded(
    jobs: list[dict], root: str, *, workers: int, timeout: float, memory_mb: int | None, prefetch: int | None = None
):
    """Yield (job, SharedFrames | Failed | exception) in job order, decoding ahead in isolated workers.

    A feeder thread drives the workers, so they keep decoding (up to `prefetch` windows ahead)
    while the caller encodes; only shared-memory names cross the pipe. Closing the generator
    stops the workers and frees every block not yet handed out.
    """
    tag = f"rc{os.getpid()}-{next(_CALLS)}"
    jobs = [dict(j, shm=f"{tag}-{i}") for i, j in enumerate(jobs)]
    q: queue.Queue = queue.Queue(maxsize=prefetch or max(2, workers))
    stop = threading.Event()
    END = object()

    def feed():
        gen = isolated_map(
            functools.partial(decode_clip_shared, root=str(root)),
            jobs,
            workers=workers,
            timeout=timeout,
            memory_mb=memory_mb,
        )
        try:
            for item in gen:
                while not stop.is_set():
                    try:
                        q.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    break
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, which re-raises it
            q.put(("feeder", e))
        finally:
            gen.close()
            q.put(END)

    t = threading.Thread(target=feed, name="cache-decode-feeder", daemon=True)
    t.start()
    handed = set()
    try:
        while (item := q.get()) is not END:
            if item[0] == "feeder":
                raise item[1]
            job, res = item
            if isinstance(res, Failed):
                _unlink_shared(job["shm"])
            elif isinstance(res, tuple):
                res = SharedFrames(*res)
                handed.add(job["shm"])
            yield job, res
    finally:
        stop.set()
        while t.is_alive() or not q.empty():  # drained, so the feeder's last put returns
            try:
                q.get(timeout=0.1)
            except queue.Empty:
                continue
        t.join()
        # The workers are gone now. A block they wrote that was not handed out (queued here, still in
        # the pipe, finished out of order, being written when its worker was stopped or killed) has
        # only its name left: a shared-memory block outlives its process, so remove each such name.
        for job in jobs:
            if job["shm"] not in handed:
                _unlink_shared(job["shm"])


def run_unit(root: str, unit: str, device: str | None = None, wait: bool = False) -> dict:
    name, index = parse_unit(unit)
    plan, cfg, ident = load_cache(root, name)
    if not 0 <= index < plan["num_units"]:
        raise UserError(f"{unit}: cache {name!r} has units 0..{plan['num_units'] - 1}")
    buckets = BucketConfig.from_toml(cfg.buckets)
    if d := diff(ident, identity(cfg, buckets, ident["manifest_fingerprint"])):
        raise UserError(
            f"{unit}: this node's encoders differ from cache.json; refusing to mix latents:\n  " + "\n  ".join(d[:12])
        )
    cdir = cache_dir(root, name)
    sidecar = begin_unit(cdir, index, wait=wait)
    if sidecar is None:
        say(f"{unit}: already done, skipped")
        return {"unit": unit, "skipped": True}
    try:
        clear_store_unit(root, name, f"{index:06d}-{plan['plan_id']}")  # what a killed run left
        return _run(root, unit, plan, cfg, buckets, cdir, index, sidecar, device)
    finally:
        end_unit(sidecar)


def _run(
    root,
    unit: str,
    plan: dict,
    cfg: CacheConfig,
    buckets: BucketConfig,
    cdir: Path,
    index: int,
    sidecar: Path,
    device: str | None,
) -> dict:
    name, stem = cdir.name, f"{index:06d}-{plan['plan_id']}"
    t0 = time.monotonic()
    rows = unit_rows(cdir, index)
    out = planned_rows(rows, name, unit)
    jobs = [
        dict(r, interval=buckets.frame_interval, resize=cfg.resize)
        for r in rows
        if r["bucket"] and r["same_as"] is None and r["reuse_shard"] is None
    ]
    device = device or default_device()
    vdig = video_digest(json.loads((cdir / "cache.json").read_text()))
    stats = {"clips": 0, "frames": 0, "bytes": 0, "encode_s": 0.0, "pixels": 0, "tokens": 0, "texts": 0}
    t = time.monotonic()
    try:
        captions, text_index, stats["tokens"] = encode_captions(root, rows, cfg, device, name, stem)
    except BaseException:
        clear_store_unit(root, name, stem)
        raise
    stats["texts"], stats["text_s"] = len(captions), time.monotonic() - t
    for o in out.values():
        if o["text_shard"] is None and o["text_key"] in captions:
            o["text_shard"], o["text_offset"], o["text_len"] = captions[o["text_key"]]
    video = VideoEncoder(cfg.video_encoder, device) if jobs else None
    vdir = store_dir(root, "video", name)
    vdir.mkdir(parents=True, exist_ok=True)
    writer = ShardWriter(vdir, stem, int(cfg.shard_mb * 1e6))
    video_index: list[dict] = []
    pending: dict[str, list] = defaultdict(list)

    def reject(key, reason, detail):
        out[key].update(status="rejected", reject_reason=reason, reject_detail=str(detail)[:2000])

    def flush(bucket):
        batch, pending[bucket] = pending[bucket], []
        if not batch:
            return
        t = time.monotonic()
        stacked = np.stack([frames.array for _, frames in batch])
        for _, frames in batch:
            frames.release()
        latents = video.encode(stacked)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        stats["encode_s"] += time.monotonic() - t
        for k, (job, _frames) in enumerate(batch):
            tensors = {key: v[k].clone() for key, v in latents.items()}
            if cfg.store == "sample":  # one frozen draw, seeded by (seed, view, clip id): reruns agree
                purpose = "sample" if job["view"] == 0 else f"sample/{job['view']}"
                g = torch.Generator().manual_seed(clip_seed(purpose, cfg.seed, job["clip_id"]))
                tensors = {
                    "sample": (
                        tensors["mean"].float()
                        + torch.exp(0.5 * tensors["logvar"].float()) * torch.randn(tensors["mean"].shape, generator=g)
                    ).bfloat16()
                }
            if not all(torch.isfinite(v.float()).all() for v in tensors.values()):
                reject(job["key"], "invalid_latent", "non-finite values in the encoder output")
                continue
            raw = Path(root) / job["raw_shard"]
            chash = content_hash(raw, job["raw_offset"], job["file_size"])
            vkey = video_key(vdig, chash, job, cfg.resize, cfg.store, cfg.seed)
            data = encode(tensors, video_key=vkey, bucket=bucket)
            shard, offsets = writer.write_sample(vkey, [(LATENT_EXT, data, None)])
            shape = list(tensors.get("mean", tensors.get("sample")).shape)
            rel = str(Path("store", "video", name, shard))
            out[job["key"]].update(
                status="ok", shape=shape, shard=rel, shard_offset=offsets[LATENT_EXT], video_key=vkey, reused=False
            )
            video_index.append(
                {"video_key": vkey, "shard": rel, "shard_offset": offsets[LATENT_EXT], "shape": shape}
                | {"bytes": len(data), "content_hash": chash, "raw_shard": job["raw_shard"]}
                | {"raw_offset": job["raw_offset"], "file_size": job["file_size"], "raw_stamp": raw_stamp(raw)}
            )
            stats["clips"] += 1
            stats["frames"] += job["num_frames"]
            stats["bytes"] += len(data)
            stats["pixels"] += job["num_frames"] * job["height"] * job["width"]

    # decode up to a batch ahead (plus a window per worker) while a batch is being encoded
    frames_in = decoded(
        jobs,
        str(root),
        workers=cfg.workers,
        timeout=cfg.decode_timeout,
        memory_mb=cfg.worker_memory_mb,
        prefetch=cfg.batch_size + cfg.workers,
    )
    try:
        with bar(len(rows), unit, "clip") as pbar:
            pbar.update(len(rows) - len(jobs))
            for job, res in frames_in:
                pbar.update(1)
                if isinstance(res, FrameBufferError):
                    raise OutputError(f"/dev/shm/{job['shm']}", res)
                if isinstance(res, Failed):
                    reject(
                        job["key"],
                        res.reason if res.reason in ("timeout", "crashed") else "undecodable",
                        res.detail,
                    )
                elif isinstance(res, BaseException):
                    reject(job["key"], "undecodable", f"{type(res).__name__}: {res}")
                else:
                    pending[job["bucket"]].append((job, res))
                    if len(pending[job["bucket"]]) >= cfg.batch_size:
                        flush(job["bucket"])
                        pbar.set_postfix(
                            clips_s=f"{stats['clips'] / max(1e-9, time.monotonic() - t0):.1f}",
                            MB_s=f"{stats['bytes'] / 1e6 / max(1e-9, time.monotonic() - t0):.1f}",
                        )
            for b in list(pending):
                flush(b)
        writer.close()
        for r in rows:  # a repeated draw: the earlier view's outcome, its sample
            if r["bucket"] and r["same_as"] is not None:
                src = out[(r["clip_id"], r["same_as"])]
                out[r["key"]].update({k: v for k, v in src.items() if k not in ("view", "unit", "cache")})

        table = pa.Table.from_pylist(list(out.values()), schema=SIDECAR).replace_schema_metadata(
            {
                "encode_seconds": str(stats["encode_s"]),
                "encoded_clips": str(stats["clips"]),
                "encoded_pixels": str(stats["pixels"]),
                "text_seconds": str(stats["text_s"]),
                "encoded_texts": str(stats["texts"]),
                "text_tokens": str(stats["tokens"]),
            }
        )
        if video_index:
            write_index(store_dir(root, "video", name) / f"{stem}.parquet", video_index, "video")
        if text_index:
            write_index(store_dir(root, "text", name) / f"{stem}.parquet", text_index, "text")
        with atomic_path(sidecar) as tmp:  # last: the unit is now visible as finished
            pq.write_table(table, tmp)
    except BaseException:
        writer.abort()  # no sidecar will name its shards: remove them, and its caption shards and indexes
        clear_store_unit(root, name, stem)
        raise
    finally:
        frames_in.close()
        for batch in pending.values():
            for _, frames in batch:
                frames.release()
    dt = time.monotonic() - t0
    ok = stats["clips"]
    clips = len({r["clip_id"] for r in rows})
    rejected = sum(1 for r in out.values() if r["status"] != "ok")
    say(
        f"{unit}: {clips} clips"
        + (f" x {cfg.views} views" if cfg.views > 1 else "")
        + f", {ok} encoded, {sum(1 for o in out.values() if o.get('reused'))} reused from the store, "
        f"{stats['texts']} captions encoded, {rejected} rejected; {stats['frames'] / dt:.0f} frames/s, "
        f"{ok / dt:.2f} clips/s, {stats['bytes'] / 1e6 / dt:.1f} MB/s of latents in {dt:.1f} s on {device}"
    )
    say(projection(cdir, plan.get("num_encodes", plan["num_clips"]), plan.get("num_pixels")))
    return {"unit": unit, "clips": clips, "ok": ok, "seconds": dt}
