"""``cache plan``: assign buckets, freeze the work, fix the cache's identity, print units.

Reads a cache config (``configs/cache/*.toml``) and the catalog manifest it names; assigns every
clip a bucket (catalog/buckets.py: a pure function of seed, clip id and bucket config) and a
temporal window (from seed and clip id); writes ``ROOT/latents/<name>/_plan/input.parquet`` (one
row group per unit, clips that fit no bucket included, to be recorded as rejects) and
``cache.json``: the encoders' identity (kind, config, dtype, weights hash, versions) and every
preprocessing parameter. A cache.json that exists and differs is an error naming the difference:
a cache is never silently mixed from two encoders.
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from reelcache import UserError
from reelcache.cache.decode import RESIZES, window_start
from reelcache.cache.encoders import TINY_VIDEO, EncoderSpec, spatial_multiple, spec_identity, temporal_ratio
from reelcache.catalog.buckets import BucketConfig
from reelcache.catalog.manifest import read_manifest, resolve_manifest
from reelcache.catalog.shards import atomic_path
from reelcache.progress import say
from reelcache.settings import NAME, TEXT, build, load_toml, setting

CACHE_VERSION = 1
# cache.json's preprocess.resize for each `resize`. "area"'s is the text every cache had before the
# option existed: a default cache keeps its identity (no new key), and one resized otherwise differs.
RESIZE_IDENTITY = {
    "area": "swscale area, cover",
    "opensora": "Open-Sora 1.2 resize_crop_to_fill: rgb24 at coded size, bilinear without antialias "
    "(torch interpolate, align_corners=False), cover the bucket's exact size (round), centre crop to it",
}


@dataclass
class CacheConfig:
    name: str = setting(doc="the cache: ROOT/latents/<name>", pattern=NAME)
    manifest: str = setting(doc="catalog manifest name (ROOT/manifests/<name>-*.parquet) or path", pattern=TEXT)
    buckets: str = setting(doc="bucket config TOML", pattern=TEXT)
    video_encoder: EncoderSpec = setting(doc="[video_encoder]: the VAE")
    text_encoder: EncoderSpec = setting(doc="[text_encoder]: the caption encoder (t5)")
    seed: int = setting(0, "bucket keep-probability draws and temporal windows", ge=0)
    clips_per_unit: int = setting(256, "one unit = one GPU job", ge=1)
    batch_size: int = setting(8, "clips per VAE call (same bucket)", ge=1)
    text_batch_size: int = setting(64, "captions per text-encoder call", ge=1)
    workers: int = setting(4, "decode processes per unit, overlapping decode with encode", ge=1)
    decode_timeout: float = setting(120.0, "seconds per clip", gt=0)
    worker_memory_mb: int | None = setting(None, "address-space cap per decode process (None: no cap)", ge=1)
    shard_mb: float = setting(1000.0, "cap on one latent shard's size", gt=0)
    store: str = setting(
        "posterior", "posterior: mean + logvar (sampled at load); sample: one draw", choices=("posterior", "sample")
    )
    resize: str = setting(
        "area",
        "area: swscale's area filter (antialiased) covering (H, W); opensora: Open-Sora 1.2's bilinear without "
        "antialias, covering and cropping the bucket's exact size (e.g. 240 x 426), then the centre (H, W)",
        choices=RESIZES,
    )
    extra: dict = setting(doc="free-form, recorded with the plan", factory=dict)

    def __post_init__(self):
        if self.video_encoder.kind not in TINY_VIDEO:
            raise UserError(
                f"video_encoder.kind = {self.video_encoder.kind!r}: expected one of {', '.join(map(repr, TINY_VIDEO))}"
            )
        if self.text_encoder.kind != "t5":
            raise UserError(f"text_encoder.kind = {self.text_encoder.kind!r}: expected 't5'")

    @classmethod
    def from_dict(cls, doc: dict, where: str) -> CacheConfig:
        """From a config file's table or the plan's recorded ``config`` (``where`` names it in errors)."""
        return build(cls, doc, source=where)

    @classmethod
    def from_toml(cls, path) -> CacheConfig:
        """A cache config file, every value checked; its bucket file is read too (before any work)."""
        cfg = cls.from_dict(load_toml(path), str(path))
        cfg.buckets = BucketConfig.path_from(path, cfg.buckets)
        try:
            BucketConfig.from_toml(cfg.buckets)
        except FileNotFoundError:
            raise UserError(f"{path}: buckets = {cfg.buckets!r}: no such file") from None
        return cfg


def cache_dir(root, name: str) -> Path:
    return Path(root) / "latents" / name


def identity(cfg: CacheConfig, buckets: BucketConfig, manifest_fp: str) -> dict:
    return {
        "cache_version": CACHE_VERSION,
        "name": cfg.name,
        "video_encoder": spec_identity(cfg.video_encoder),
        "text_encoder": spec_identity(cfg.text_encoder),
        "buckets": {"table": [list(r) for r in buckets.table], "frame_interval": buckets.frame_interval},
        "seed": cfg.seed,
        "store": cfg.store,
        "manifest_fingerprint": manifest_fp,
        "spatial_multiple": spatial_multiple(cfg.video_encoder),
        "preprocess": {
            "decode": "pyav, frames in presentation order, displayed picture (SAR, rotation)",
            "resize": RESIZE_IDENTITY[cfg.resize],
            "crop": "centre",
            "window": "SeedSequence(blake2b-256(window|seed|clip_id))",
            "range": [-1, 1],
            "latent_dtype": "bfloat16",
            "text": "trimmed to real tokens, bfloat16",
        },
    }


def diff(a, b, prefix="") -> list[str]:
    """Human-readable differences between two identity documents."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b)):
            out += diff(a.get(k), b.get(k), f"{prefix}{k}.")
        return out
    return [] if a == b else [f"{prefix.rstrip('.')}: {json.dumps(a)[:80]} != {json.dumps(b)[:80]}"]


def load_cache(root, name: str) -> tuple[dict, CacheConfig, dict]:
    """A planned cache: (its plan.json, the CacheConfig it was planned with, its cache.json identity)."""
    cdir = cache_dir(root, name)
    try:
        plan = json.loads((cdir / "_plan" / "plan.json").read_text())
        ident = json.loads((cdir / "cache.json").read_text())
    except FileNotFoundError:
        raise UserError(f"no cache {name!r} under {root}: run `reelcache cache plan` first") from None
    return plan, CacheConfig.from_dict(plan["config"], str(cdir / "_plan" / "plan.json")), ident


def make_plan(root, cfg: CacheConfig) -> list[str]:
    buckets = BucketConfig.from_toml(cfg.buckets)
    ratio = temporal_ratio(cfg.video_encoder)
    bad = sorted({t for _, t, *_ in buckets.table if t > 1 and (t - 1) % ratio})
    if bad:
        raise UserError(
            f"{cfg.video_encoder.kind} encodes 1 + a multiple of {ratio} frames; bucket frame counts "
            f"{bad} in {cfg.buckets} are not (e.g. {[1 + ratio * ((t - 1) // ratio) for t in bad]})"
        )
    mpath = resolve_manifest(root, cfg.manifest)
    table, fp = read_manifest(mpath)
    need = {"clip_id", "shard", "shard_offset", "file_size", "num_frames", "width", "height", "text"}
    if missing := need - set(table.column_names):
        raise UserError(f"{mpath} lacks {sorted(missing)}: make it with `reelcache catalog manifest`")
    ident = identity(cfg, buckets, fp)
    cdir = cache_dir(root, cfg.name)
    if (cdir / "cache.json").exists():
        old = json.loads((cdir / "cache.json").read_text())
        if d := diff(old, ident):
            raise UserError(
                f"cache {cfg.name!r} exists with another identity; refusing to mix latents. "
                f"Differences (existing != new):\n  "
                + "\n  ".join(d[:12])
                + "\nUse a new cache name, or delete the cache folder to rebuild it."
            )
    mult = spatial_multiple(cfg.video_encoder)
    old_plan = cdir / "_plan" / "plan.json"
    if old_plan.exists() and any(cdir.glob("[0-9]*.parquet")):
        prev = json.loads(old_plan.read_text())["config"]
        prev.setdefault("resize", "area")  # a plan made before the option resized by area
        if d := diff(prev, json.loads(json.dumps(dataclasses.asdict(cfg), default=str))):
            raise UserError(
                f"cache {cfg.name!r} has finished units planned with another configuration "
                "(unit boundaries would move):\n  " + "\n  ".join(d[:12])
            )
    rows = []
    for r in table.to_pylist():
        a = buckets.assign(r["clip_id"], r["height"], r["width"], r["num_frames"], cfg.seed)
        span = (a.num_frames - 1) * buckets.frame_interval + 1 if a.bucket else 0
        rows.append(
            {
                "clip_id": r["clip_id"],
                "raw_shard": r["shard"],
                "raw_offset": r["shard_offset"],
                "file_size": r["file_size"],
                "fps": r.get("fps"),
                "text": r["text"],
                "bucket": a.bucket,
                "num_frames": a.num_frames,
                "height": a.height and a.height - a.height % mult,
                "width": a.width and a.width - a.width % mult,
                "window_start": window_start(r["clip_id"], cfg.seed, r["num_frames"], span) if a.bucket else None,
                "no_bucket": a.reason,
            }
        )
    cdir.mkdir(parents=True, exist_ok=True)
    (cdir / "_plan").mkdir(exist_ok=True)
    with atomic_path(cdir / "_plan" / "input.parquet") as tmp:
        pq.write_table(pa.Table.from_pylist(rows), tmp, row_group_size=cfg.clips_per_unit)
    num_units = -(-len(rows) // cfg.clips_per_unit)
    doc = {"config": dataclasses.asdict(cfg), "num_units": num_units, "num_clips": len(rows), "manifest": str(mpath)}
    with atomic_path(cdir / "_plan" / "plan.json") as tmp:
        tmp.write_text(json.dumps(doc, indent=2, default=str))
    if not (cdir / "cache.json").exists():
        with atomic_path(cdir / "cache.json") as tmp:
            tmp.write_text(json.dumps(ident, indent=2))
    _report(rows, cdir, buckets.frame_interval)
    return [f"{cfg.name}/{i:06d}" for i in range(num_units)]


def _report(rows: list[dict], cdir: Path, interval: int) -> None:
    by_bucket = Counter(r["bucket"] for r in rows if r["bucket"])
    lost = Counter(r["no_bucket"] for r in rows if not r["bucket"])
    frames = sum(r["num_frames"] for r in rows if r["bucket"])
    pixels = sum(r["num_frames"] * r["height"] * r["width"] for r in rows if r["bucket"])
    say(
        f"cache plan: {len(rows)} clips, {sum(by_bucket.values())} in {len(by_bucket)} buckets, "
        f"{sum(lost.values())} fit no bucket" + (f" ({', '.join(f'{k} {v}' for k, v in lost.items())})" if lost else "")
    )
    for b, n in sorted(by_bucket.items()):
        say(f"  {b:18s} {n:8d} clips")
    say(f"  {frames:,} frames, {pixels / 1e9:.2f} Gpixels to encode")
    say(projection(cdir, sum(by_bucket.values())))


def projection(cdir: Path, clips: int) -> str:
    """GPU-hours for the whole cache from the rate finished units measured, if any."""
    done = sorted(cdir.glob("[0-9]*.parquet"))
    secs = n = 0
    for p in done:
        meta = pq.read_schema(p).metadata or {}
        if b"encode_seconds" in meta:
            secs += float(meta[b"encode_seconds"])
            n += int(meta[b"encoded_clips"])
    if not n:
        return "  projection: run a unit to measure clips/s per GPU"
    rate = n / secs
    return (
        f"  projection: {rate:.2f} clips/s per GPU measured over {len(done)} unit(s) -> "
        f"{clips / rate / 3600:.1f} GPU-hours for {clips} clips"
    )
