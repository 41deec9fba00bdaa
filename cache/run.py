"""``cache run UNIT``: decode one unit's clips for their buckets and encode them, once.

The cache's part of the unit runner (base/units.py). Before any work the unit checks that its
encoders have the identity in cache.json, and encodes the captions the plan gave it (``encode_text``:
captions the store lacks, each given to one unit) into its caption shard. Then, for each planned
(clip, view) row:

1. before: ``no_bucket``: a clip that fits no bucket is recorded with the plan's reason, never decoded;
   draws the store already holds, and views that repeat an earlier view's draw (the plan's
   ``same_as``), are not decoded either: their rows point at the existing latent;
2. work: ``decoded``: the window is decoded in isolated worker processes (a deadline and an optional
   memory cap per clip; a clip that fails is a recorded reject), read straight out of the raw shard;
   a worker runs ``cache/decode.py``'s ``decode_clip_shared`` and imports that module only, not this
   one (torch, pyarrow). Each worker decodes into a shared-memory block named by the parent
   (``/dev/shm``); only the block's name crosses the pipe, never the frames (pickling a 10-140 MB
   window costs two copies and blocks the worker until the parent reads it). A feeder thread keeps the
   workers busy, so decoding continues while the main thread encodes;
3. steps (``Latents``): a ``Batch`` of one bucket's clips is encoded by the VAE; ``draw`` (``store =
   "sample"``: one seeded draw), ``finite`` (a NaN or inf is ``invalid_latent``), and ``store``: the
   clip's raw bytes are hashed once and its ``<video_key>.safetensors`` latent appended to size-capped
   store shards (cache/store.py: ``ROOT/store/video/<cache>/<unit>-<plan>-KK.tar``).

Then the store indexes of what the unit wrote, and last the sidecar parquet (one row per planned clip
and view with its bucket, latent shape, shard and offset, caption key and location, or its reject
reason: reelcache/rejects.py: Reason) are written.

A unit whose sidecar exists is skipped; one killed at any moment is cleaned and redone; a unit
another live run holds (base/units.py: its lease) is refused. Reading a source may reject a
clip; writing our own outputs (latent shards, the sidecar, the shared-memory frames) may not:
such a failure is an OutputError, the unit fails with no sidecar and no store shards, and its re-run
gives the clean result.
"""

from __future__ import annotations

import _posixshmem
import functools
import itertools
import json
import os
import queue
import threading
import time
from multiprocessing import shared_memory
from pathlib import Path

import numpy as np
import torch

from reelcache import UserError
from reelcache.base import s3, units
from reelcache.base.buckets import BucketConfig
from reelcache.base.latents import LATENT_EXT, encode
from reelcache.base.s3 import S3Error
from reelcache.base.shards import ShardWriter, content_hash
from reelcache.base.units import Batch, Reject, Unit, claimed, parse_unit, unit_rows
from reelcache.cache import outputs
from reelcache.cache.captions import encode_captions
from reelcache.cache.costs import projection
from reelcache.cache.decode import (
    FrameBufferError,
    clip_seed,
    decode_clip_shared,
)
from reelcache.cache.encoders import VideoEncoder, default_device
from reelcache.cache.outputs import no_bucket, planned_rows, repeat_views
from reelcache.cache.plan import CacheConfig, cache_dir, diff, identity, load_cache, local_root
from reelcache.cache.store import (
    clear_store_unit,
    raw_stamp_of,
    store_dir,
    video_digest,
    video_key,
    write_index,
)
from reelcache.files import OutputError
from reelcache.isolate import Failed, isolated_map
from reelcache.log import say
from reelcache.rejects import Reason

_CALLS = itertools.count()


class SharedFrames:
    """The parent's handle on a decoded window in shared memory; `release` frees it."""

    def __init__(self, name: str, shape, content_hash: str | None = None):
        self.content_hash = content_hash  # of the raw bytes, when the worker read them from S3
        self.shm = shared_memory.SharedMemory(name=name)
        self.array = np.ndarray(shape, np.uint8, buffer=self.shm.buf)

    def release(self):
        self.array = None
        self.shm.close()
        self.shm.unlink()


def unlink_shared(name: str) -> None:
    """Remove the block `name` if it exists. A worker killed between creating its block and sizing it
    leaves an empty one, which SharedMemory() refuses to map (and which its resource tracker never
    registered): that one is unlinked by name."""
    try:
        shared_memory.SharedMemory(name=name).unlink()
    except ValueError:  # "cannot mmap an empty file"
        try:
            _posixshmem.shm_unlink("/" + name)
        except FileNotFoundError:
            pass
    except OSError:  # FileNotFoundError: never made, or already removed
        pass


def decoded(
    jobs: list[dict], root: str, *, workers: int, timeout: float, memory_mb: int | None, prefetch: int | None = None
):
    """Yield (job, SharedFrames | Failed | exception) in job order, decoding ahead in isolated workers.
    A worker that could not create a window's shared memory is an OutputError: our own output failed.

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
            if isinstance(res, FrameBufferError):  # our own output (the frames' block) failed: not a reject
                raise OutputError(f"/dev/shm/{job['shm']}", res)
            if isinstance(res, S3Error):  # the store failed reading a raw clip: the unit fails, no clip rejected
                raise res
            if isinstance(res, Failed):
                unlink_shared(job["shm"])
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
                unlink_shared(job["shm"])


def run_unit(root: str, unit: str, device: str | None = None, wait: bool = False) -> dict:
    """Run one unit (module docstring). A root in S3 (docs/STORAGE.md): the unit works in the root's local mirror
    (cache/plan.py: ``local_root``); each raw clip is one ranged read of its member, and every file the unit
    writes (store shards, their indexes, the sidecar last) is uploaded whole through its claim."""
    name, index = parse_unit(unit)
    raw_root, root = root, local_root(root, name)
    remote = s3.parse(raw_root) / "latents" / name if s3.is_url(raw_root) else None
    cfg, plan, ident = load_cache(root, name)
    if not 0 <= index < plan["num_units"]:
        raise UserError(f"{unit}: cache {name!r} has units 0..{plan['num_units'] - 1}")
    buckets = BucketConfig.from_toml(cfg.buckets)
    if d := diff(ident, identity(cfg, buckets, ident["manifest_fingerprint"])):
        raise UserError(
            f"{unit}: this node's encoders or preprocessing differ from cache.json; refusing to mix latents:\n  "
            + "\n  ".join(d[:12])
        )
    cdir = cache_dir(root, name)
    if remote is not None:  # the unit's store folders, where its shards are staged
        for kind in ("video", "text"):
            store_dir(root, kind, name).mkdir(parents=True, exist_ok=True)
    with claimed(cdir, index, wait=wait, remote=remote) as claim:
        if claim is None:
            say(f"{unit}: already done, skipped")
            return {"unit": unit, "skipped": True}
        clear_store_unit(root, name, f"{index:06d}-{plan['plan_id']}", claim)  # what a killed run left
        return _run(root, unit, cfg, plan, buckets, cdir, index, claim, device or default_device(), raw_root)


def finite(row: dict) -> Reject | None:
    """A step: a latent with a NaN or an inf is the encoder's failure on this clip, recorded, never stored."""
    if not all(torch.isfinite(v.float()).all() for v in row["latents"].values()):
        return Reason.invalid_latent, "non-finite values in the encoder output"
    return None


class Latents:
    """The cache's steps in the parent, once a clip's window is decoded: encode a bucket's batch, draw
    (``store = "sample"``), check (``finite``), store; and ``finish``, the sidecar. Holds the unit's video
    shard writer, the store index rows it wrote and its counts; it publishes every file through the unit's
    ``claim``, which checks the unit's lease first."""

    def __init__(
        self,
        root,
        cfg: CacheConfig,
        cdir: Path,
        stem: str,
        device: str,
        encode: bool,
        captions: tuple,
        claim,
        raw_root=None,
    ):
        self.raw_root = raw_root or root  # where the raw shards are: the root, an s3:// one (root: its mirror)
        self.stamps: dict[str, str] = {}  # raw shard -> its stamp, taken once per unit
        self.root, self.cfg, self.device, self.name, self.stem = root, cfg, device, cdir.name, stem
        self.claim = claim
        self.text_index, self.text = captions  # what encode_captions wrote, and its counts
        self.t0 = time.monotonic()
        self.vdig = video_digest(json.loads((cdir / "cache.json").read_text()))
        self.video = VideoEncoder(cfg.video_encoder, device) if encode else None
        vdir = store_dir(root, "video", self.name)
        vdir.mkdir(parents=True, exist_ok=True)
        self.writer = ShardWriter(vdir, stem, int(cfg.shard_mb * 1e6), claim=claim)
        self.index: list[dict] = []
        self.stats = {"clips": 0, "frames": 0, "bytes": 0, "encode_s": 0.0, "pixels": 0}

    def steps(self) -> list:
        return [Batch(lambda row: row["bucket"], self.cfg.batch_size, self.encode), self.draw, finite, self.store]

    def encode(self, rows: list[dict]) -> None:
        """One VAE call over a bucket's decoded windows; their shared memory is freed first."""
        t = time.monotonic()
        stacked = np.stack([row["frames"].array for row in rows])
        for row in rows:
            row["raw_hash"] = row["frames"].content_hash  # read from S3 by the worker; else None
            row.pop("frames").release()
        latents = self.video.encode(stacked)
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()
        self.stats["encode_s"] += time.monotonic() - t
        for k, row in enumerate(rows):
            row["latents"] = {key: v[k].clone() for key, v in latents.items()}

    def draw(self, row: dict) -> None:
        """``store = "sample"``: one frozen draw of the posterior, seeded by (seed, view, clip id): reruns agree."""
        if self.cfg.store == "sample":
            t = row["latents"]
            purpose = "sample" if row["view"] == 0 else f"sample/{row['view']}"
            g = torch.Generator().manual_seed(clip_seed(purpose, self.cfg.seed, row["clip_id"]))
            noise = torch.randn(t["mean"].shape, generator=g)
            row["latents"] = {"sample": (t["mean"].float() + torch.exp(0.5 * t["logvar"].float()) * noise).bfloat16()}

    def store(self, row: dict) -> None:
        """Append the latent to the unit's store shard under its content key, and index it."""
        job, tensors = row["plan"], row.pop("latents")
        chash = row.pop("raw_hash", None) or content_hash(
            Path(self.raw_root) / job["raw_shard"], job["raw_offset"], job["file_size"]
        )
        if job["raw_shard"] not in self.stamps:
            self.stamps[job["raw_shard"]] = raw_stamp_of(self.raw_root, job["raw_shard"])
        vkey = video_key(self.vdig, chash, job, self.cfg.resize, self.cfg.store, self.cfg.seed)
        data = encode(tensors, video_key=vkey, bucket=row["bucket"])
        shard, offsets = self.writer.write_sample(vkey, [(LATENT_EXT, data, None)])
        shape = list(tensors.get("mean", tensors.get("sample")).shape)
        rel = str(Path("store", "video", self.name, shard))
        row.update(shape=shape, shard=rel, shard_offset=offsets[LATENT_EXT], video_key=vkey, reused=False)
        self.index.append(
            {"video_key": vkey, "shard": rel, "shard_offset": offsets[LATENT_EXT], "shape": shape}
            | {"bytes": len(data), "content_hash": chash, "raw_shard": job["raw_shard"]}
            | {
                "raw_offset": job["raw_offset"],
                "file_size": job["file_size"],
                "raw_stamp": self.stamps[job["raw_shard"]],
            }
        )
        for k, n in (("clips", 1), ("frames", row["num_frames"]), ("bytes", len(data))):
            self.stats[k] += n
        self.stats["pixels"] += row["num_frames"] * row["height"] * row["width"]

    def finish(self, rows: list[dict]):
        """Every row done: repeated views get their outcome, the store indexes of what the unit wrote are
        written, and the sidecar's table is made (its metadata: what was encoded, in how long)."""
        repeat_views(rows)
        if self.index:
            vindex = store_dir(self.root, "video", self.name) / f"{self.stem}.parquet"
            write_index(vindex, self.index, "video", self.claim)
        if self.text_index:
            tindex = store_dir(self.root, "text", self.name) / f"{self.stem}.parquet"
            write_index(tindex, self.text_index, "text", self.claim)
        s = self.stats
        done = {"encode_seconds": s["encode_s"], "encoded_clips": s["clips"], "encoded_pixels": s["pixels"]}
        return outputs.sidecar(rows, done | self.text)

    def postfix(self) -> dict:
        dt = max(1e-9, time.monotonic() - self.t0)
        return {"clips_s": f"{self.stats['clips'] / dt:.1f}", "MB_s": f"{self.stats['bytes'] / 1e6 / dt:.1f}"}


def _to_encode(row: dict) -> bool:
    """A kept row is decoded and encoded unless it repeats an earlier view's draw or the store holds it."""
    return row["plan"]["same_as"] is None and row["plan"]["reuse_shard"] is None


def _run(root, unit, cfg: CacheConfig, plan, buckets, cdir: Path, index: int, claim, device: str, raw_root) -> dict:
    name, stem = cdir.name, f"{index:06d}-{plan['plan_id']}"
    t0 = time.monotonic()
    rows = planned_rows(unit_rows(cdir, index), name, unit)
    t = time.monotonic()
    try:
        captions, text_index, tokens = encode_captions(root, [r["plan"] for r in rows], cfg, device, name, stem, claim)
    except BaseException:
        clear_store_unit(root, name, stem, claim)
        raise
    text = {"text_seconds": time.monotonic() - t, "encoded_texts": len(captions), "text_tokens": tokens}
    for r in rows:
        if r["text_shard"] is None and r["text_key"] in captions:
            r["text_shard"], r["text_offset"], r["text_len"] = captions[r["text_key"]]
    encode = any(r["bucket"] and _to_encode(r) for r in rows)
    enc = Latents(root, cfg, cdir, stem, device, encode, (text_index, text), claim, raw_root=raw_root)
    decode = functools.partial(
        decoded,
        root=str(raw_root),  # the raw shards: in the root, or objects of an s3:// root
        workers=cfg.workers,
        timeout=cfg.decode_timeout,
        memory_mb=cfg.worker_memory_mb,
        prefetch=cfg.batch_size + cfg.workers,  # a batch ahead, plus a window per worker, while one encodes
    )
    job = {"interval": buckets.frame_interval, "resize": cfg.resize}
    try:
        units.run(
            Unit(
                name=unit,
                rows=rows,
                before=[no_bucket],
                todo=_to_encode,
                work=lambda todo: decode([dict(r["plan"], **job) for r in todo]),
                take=lambda row, frames: row.update(frames=frames),
                steps=enc.steps(),
                writer=enc.writer,
                claim=claim,
                finish=enc.finish,
                reasons=Reason,
                abort=lambda: clear_store_unit(root, name, stem, claim),  # its caption shards and indexes too
                what="clip",
                postfix=enc.postfix,
            )
        )
    finally:
        for r in rows:  # windows decoded but not encoded when the unit failed
            if (frames := r.pop("frames", None)) is not None:
                frames.release()
    dt = time.monotonic() - t0
    _summary(unit, rows, cfg, enc.stats | text, dt, device)
    say(projection(cdir, plan.get("num_encodes", plan["num_clips"]), plan.get("num_pixels")))
    return {"unit": unit, "clips": len({r["clip_id"] for r in rows}), "ok": enc.stats["clips"], "seconds": dt}


def _summary(unit: str, rows: list[dict], cfg: CacheConfig, stats: dict, dt: float, device: str) -> None:
    ok = stats["clips"]
    clips = len({r["clip_id"] for r in rows})
    rejected = sum(1 for r in rows if r["status"] != "ok")
    say(
        f"{unit}: {clips} clips"
        + (f" x {cfg.views} views" if cfg.views > 1 else "")
        + f", {ok} encoded, {sum(1 for r in rows if r.get('reused'))} reused from the store, "
        f"{stats['encoded_texts']} captions encoded, {rejected} rejected; {stats['frames'] / dt:.0f} frames/s, "
        f"{ok / dt:.2f} clips/s, {stats['bytes'] / 1e6 / dt:.1f} MB/s of latents in {dt:.1f} s on {device}"
    )
