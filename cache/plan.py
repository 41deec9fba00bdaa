"""``cache plan``: assign buckets, freeze the work, fix the cache's identity, print units.

Reads a cache config (``configs/cache/*.toml``) and the catalog manifest it names; assigns every
clip a bucket (catalog/buckets.py: a pure function of seed, clip id and bucket config) and a
temporal window (from seed and clip id); writes ``ROOT/latents/<name>/_plan/input.parquet`` (one
row group per unit, clips that fit no bucket included, to be recorded as rejects) and
``cache.json``: the encoders' identity (kind, config, dtype, weights hash, versions) and every
preprocessing parameter. A cache.json that exists and differs is an error naming the difference:
a cache is never silently mixed from two encoders.

Views. Open-Sora 1.2 draws a clip's bucket again every epoch and its window on every read; a cache
that draws once shows a clip the same way in every epoch. ``views = K`` plans K independent draws
of (bucket, window) per clip, view v drawn by the same rule from (seed, view, clip id); view 0 is
the single draw of a ``views = 1`` cache, so such caches keep their plans and identities. A unit
holds ``clips_per_unit`` clips with all their views (K rows each); a view whose draw equals an
earlier view's (same bucket and window) is not encoded again: its row names that view in
``same_as``, and both rows point at one latent sample. The trade-off is cost: up to K times the
encode and the storage, which ``cache plan`` prints for K = 1 .. max(K, 3) before anything runs.
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
from reelcache.cache.decode import RESIZES, WINDOWS, window_start
from reelcache.cache.encoders import TINY_VIDEO, EncoderSpec, spatial_multiple, spec_identity, temporal_ratio
from reelcache.catalog.aspect_tables import SOURCE as BUCKET_SIZES
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
# ... and the suffix of its preprocess.window for each `window` ("uniform": none, as before the option).
WINDOW_IDENTITY = {"uniform": "", "opensora": " mod (N - T x frame_interval): Open-Sora 1.2's TemporalRandomCrop range"}


@dataclass
class CacheConfig:
    name: str = setting(doc="the cache: ROOT/latents/<name>", pattern=NAME)
    manifest: str = setting(doc="catalog manifest name (ROOT/manifests/<name>-*.parquet) or path", pattern=TEXT)
    buckets: str = setting(doc="bucket config TOML", pattern=TEXT)
    video_encoder: EncoderSpec = setting(doc="[video_encoder]: the VAE")
    text_encoder: EncoderSpec = setting(doc="[text_encoder]: the caption encoder (t5)")
    seed: int = setting(0, "bucket keep-probability draws and temporal windows", ge=0)
    views: int = setting(
        1,
        "independent (bucket, window) draws per clip, each encoded (identical ones once); the loader shows "
        "one per epoch (a permutation per clip), as Open-Sora draws again each epoch. 1: one draw, forever",
        ge=1,
    )
    clips_per_unit: int = setting(256, "one unit = one GPU job", ge=1)
    batch_size: int = setting(8, "clips per VAE call (same bucket)", ge=1)
    text_batch_size: int = setting(64, "captions per text-encoder call", ge=1)
    workers: int = setting(4, "decode processes per unit, overlapping decode with encode", ge=1)
    decode_timeout: float = setting(120.0, "seconds per clip", gt=0)
    worker_memory_mb: int | None = setting(
        None,
        "address-space cap per decode process in MB (None: no cap); at least 1024: below ~400 a worker cannot "
        "decode 1080p and a good clip would fail",
        ge=1024,
    )
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
    window: str = setting(
        "uniform",
        "uniform: a window start drawn from every valid start; opensora: from Open-Sora 1.2's range "
        "(TemporalRandomCrop: never the last valid start)",
        choices=WINDOWS,
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
        "buckets": {
            "table": [list(r) for r in buckets.table],
            "frame_interval": buckets.frame_interval,
            "sizes": BUCKET_SIZES,  # Open-Sora 1.2's (H, W) per (resolution, aspect key)
        },
        "seed": cfg.seed,
        "store": cfg.store,
        "manifest_fingerprint": manifest_fp,
        "spatial_multiple": spatial_multiple(cfg.video_encoder),
        "preprocess": {
            "decode": "pyav, frames in presentation order, displayed picture (SAR, rotation)",
            "resize": RESIZE_IDENTITY[cfg.resize],
            "crop": "centre",
            "window": "SeedSequence(blake2b-256(window|seed|clip_id))" + WINDOW_IDENTITY[cfg.window],
            "range": [-1, 1],
            "latent_dtype": "bfloat16",
            "text": "trimmed to real tokens, bfloat16",
        },
    } | _views_identity(cfg.views)


def _views_identity(views: int) -> dict:
    """Only a cache of several views says so: a single-view cache keeps the identity it always had."""
    if views == 1:
        return {}
    return {
        "views": {
            "count": views,
            "bucket": "BucketConfig.assign(view=v): blake2b(seed|clip_id|resolution|T[/t]|view<v>) for v >= 1",
            "window": "SeedSequence(blake2b-256(window/<v>|seed|clip_id)) for v >= 1",
            "identical draws": "encoded once (same_as)",
        }
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
        prev.setdefault("views", 1)  # a plan made before views drew once
        prev.setdefault("window", "uniform")  # a plan made before the option drew from every start
        if d := diff(prev, json.loads(json.dumps(dataclasses.asdict(cfg), default=str))):
            raise UserError(
                f"cache {cfg.name!r} has finished units planned with another configuration "
                "(unit boundaries would move):\n  " + "\n  ".join(d[:12])
            )
    table_views = max(cfg.views, 3)  # the cost table's K = 1 .. max(K, 3)
    rows, draws = [], []
    for r in table.to_pylist():
        first: dict = {}  # (bucket, window) -> the first view that drew it
        clip_draws = []
        for v in range(table_views):
            a = buckets.assign(r["clip_id"], r["height"], r["width"], r["num_frames"], cfg.seed, view=v)
            span = (a.num_frames - 1) * buckets.frame_interval + 1 if a.bucket else 0
            rule = {"rule": cfg.window, "interval": buckets.frame_interval}
            start = window_start(r["clip_id"], cfg.seed, r["num_frames"], span, view=v, **rule) if a.bucket else None
            same_as = first.setdefault((a.bucket, start), v) if a.bucket else None
            draw = {
                "view": v,
                "bucket": a.bucket,
                "num_frames": a.num_frames,
                "height": a.height and a.height - a.height % mult,
                "width": a.width and a.width - a.width % mult,
                "window_start": start,
                "no_bucket": a.reason,
                "same_as": same_as if same_as != v else None,
            }
            clip_draws.append(draw)
            if v < cfg.views:
                rows.append(
                    {
                        "clip_id": r["clip_id"],
                        "raw_shard": r["shard"],
                        "raw_offset": r["shard_offset"],
                        "file_size": r["file_size"],
                        "fps": r.get("fps"),
                        "text": r["text"],
                    }
                    | draw
                )
        draws.append((r["text"], clip_draws))
    cdir.mkdir(parents=True, exist_ok=True)
    (cdir / "_plan").mkdir(exist_ok=True)
    with atomic_path(cdir / "_plan" / "input.parquet") as tmp:  # a unit's clips with all their views
        pq.write_table(pa.Table.from_pylist(rows), tmp, row_group_size=cfg.clips_per_unit * cfg.views)
    num_clips = len(draws)
    num_units = -(-num_clips // cfg.clips_per_unit)
    costs = view_costs(draws, cfg, ident, _measured(cdir).get("text_tokens"), table_views)
    doc = {
        "config": dataclasses.asdict(cfg),
        "num_units": num_units,
        "num_clips": num_clips,
        "num_encodes": costs[cfg.views - 1]["encodes"],
        "num_pixels": costs[cfg.views - 1]["pixels"],
        "manifest": str(mpath),
    }
    with atomic_path(cdir / "_plan" / "plan.json") as tmp:
        tmp.write_text(json.dumps(doc, indent=2, default=str))
    if not (cdir / "cache.json").exists():
        with atomic_path(cdir / "cache.json") as tmp:
            tmp.write_text(json.dumps(ident, indent=2))
    _report(rows, cdir, num_clips, cfg.views, costs)
    return [f"{cfg.name}/{i:06d}" for i in range(num_units)]


# Latent channels of the real VAEs where their config does not say (cache/encoders.py's kinds).
LATENT_CHANNELS = {"wan": 16, "cogvideox": 16, "hunyuan": 16, "ltx": 128, "opensora-v1.2": 4, "sd-per-frame": 4}
SAMPLE_OVERHEAD = 1536  # bytes per latent sample besides its tensors: tar header and padding, safetensors header


def latent_bytes(cfg: CacheConfig, ident: dict, frames: int, height: int, width: int) -> int:
    """Bytes of one stored latent (bf16; mean and logvar for a posterior) from the encoder's geometry:
    C x t x H/f x W/f, with f its spatial multiple and t its temporal compression of the frames. An
    estimate where a VAE's geometry is not these rules; `cache run` reports the real shapes."""
    spec = cfg.video_encoder
    conf = ident["video_encoder"].get("config") or {}
    channels = conf.get("z_dim") or conf.get("latent_channels") or (4 if spec.tiny else LATENT_CHANNELS[spec.kind])
    if spec.kind == "opensora-v1.2":  # 17-frame chunks, 4x inside each (cache/opensora_vae.py: latent_frames)
        t = sum(-(-min(17, frames - i) // 4) for i in range(0, frames, 17))
    elif spec.kind == "sd-per-frame":
        t = frames
    else:
        t = 1 + (frames - 1) // temporal_ratio(spec)
    f = spatial_multiple(spec)
    return int(channels) * t * (height // f) * (width // f) * 2 * (2 if cfg.store == "posterior" else 1)


def view_costs(
    draws: list, cfg: CacheConfig, ident: dict, tokens: float | None = None, upto: int | None = None
) -> list[dict]:
    """What a cache of K = 1 .. upto views encodes and stores: distinct draws of views 0..K-1, their
    pixels, latent bytes and caption bytes (every sample holds its caption's embedding). `draws`:
    (caption, [draw of view 0, 1, ...]) per clip, `upto` at most as many views as each has (default:
    that many); `tokens`: measured tokens per caption (None: estimated from its words)."""
    conf = ident["text_encoder"].get("config") or {}
    width = 32 if cfg.text_encoder.tiny else int(conf.get("d_model", 4096))
    upto = upto or (len(draws[0][1]) if draws else 1)
    sizes: dict = {}
    per_view = [[0, 0, 0, 0] for _ in range(upto)]  # what view v adds: encodes, pixels, latent and text bytes
    for caption, views in draws:
        n = tokens or min(cfg.text_encoder.max_tokens, 1 + round(1.3 * len((caption or "").split())))
        for v, d in enumerate(views[:upto]):
            if d["bucket"] is None or d["same_as"] is not None:  # no latent, or an earlier view's
                continue
            key = (d["num_frames"], d["height"], d["width"])
            if key not in sizes:
                sizes[key] = latent_bytes(cfg, ident, *key)
            add = per_view[v]
            add[0] += 1
            add[1] += d["num_frames"] * d["height"] * d["width"]
            add[2] += sizes[key] + SAMPLE_OVERHEAD
            add[3] += n * width * 2
    out, total = [], [0, 0, 0, 0]
    for k in range(upto):  # K = k + 1 views: views 0..k
        total = [a + b for a, b in zip(total, per_view[k])]
        encodes, pixels, latent, text = total
        out.append(
            {"views": k + 1, "encodes": encodes, "pixels": pixels, "bytes": latent + text, "text_bytes": text}
            | {"measured_tokens": tokens is not None}
        )
    return out


def _report(rows: list[dict], cdir: Path, clips: int, views: int, costs: list[dict]) -> None:
    by_bucket = Counter(r["bucket"] for r in rows if r["bucket"] and r["same_as"] is None)
    drawn = sum(1 for r in rows if r["bucket"])
    lost = Counter(r["no_bucket"] for r in rows if not r["bucket"])
    frames = sum(r["num_frames"] for r in rows if r["bucket"] and r["same_as"] is None)
    pixels = sum(r["num_frames"] * r["height"] * r["width"] for r in rows if r["bucket"] and r["same_as"] is None)
    shared = sum(1 for r in rows if r["same_as"] is not None)
    what = f"{clips} clips" if views == 1 else f"{clips} clips x {views} views"
    say(
        f"cache plan: {what}, {drawn} in {len(by_bucket)} buckets, "
        f"{sum(lost.values())} fit no bucket"
        + (f" ({', '.join(f'{k} {v}' for k, v in lost.items())})" if lost else "")
        + (f"; {shared} views share an earlier view's latent (same bucket and window)" if views > 1 else "")
    )
    for b, n in sorted(by_bucket.items()):
        say(f"  {b:18s} {n:8d} " + ("clips" if views == 1 else "latents"))
    say(f"  {frames:,} frames, {pixels / 1e9:.2f} Gpixels to encode")
    for line in cost_table(cdir, clips, views, costs):
        say(line)
    say(projection(cdir, costs[views - 1]["encodes"], costs[views - 1]["pixels"]))


def _measured(cdir: Path) -> dict:
    """What finished units measured: encode seconds, encoded samples and their pixels and caption tokens."""
    m = {"units": 0, "seconds": 0.0, "encoded": 0, "pixels": 0, "tokens": 0, "with_pixels": True}
    for p in sorted(cdir.glob("[0-9]*.parquet")):
        meta = pq.read_schema(p).metadata or {}
        if b"encode_seconds" not in meta:
            continue
        m["units"] += 1
        m["seconds"] += float(meta[b"encode_seconds"])
        m["encoded"] += int(meta[b"encoded_clips"])
        if b"encoded_pixels" in meta:  # written since views came: older units count samples only
            m["pixels"] += int(meta[b"encoded_pixels"])
            m["tokens"] += int(meta[b"text_tokens"])
        else:
            m["with_pixels"] = False
    if m["encoded"] and m["with_pixels"]:
        m["text_tokens"] = m["tokens"] / m["encoded"]
    return m


def _gpu_hours(m: dict, encodes: int, pixels: int) -> float | None:
    if not m["encoded"] or not m["seconds"]:
        return None
    if m["with_pixels"] and m["pixels"]:  # the VAE's cost follows pixels, which views change
        return pixels * m["seconds"] / m["pixels"] / 3600
    return encodes * m["seconds"] / m["encoded"] / 3600


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if n < 1000 or unit == "PB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return ""


def cost_table(cdir: Path, clips: int, views: int, costs: list[dict]) -> list[str]:
    """`cache plan`'s table of what K views cost (the planned K marked *)."""
    m = _measured(cdir)
    base = costs[0]
    tokens = "measured" if costs[0]["measured_tokens"] else "estimated from word counts"
    lines = [
        "  what views cost (bytes: latents from the encoder's geometry, and captions, which every sample "
        f"stores; tokens {tokens}):",
        f"    {'K':>3} {'encodes':>10} {'per clip':>8} {'Gpixels':>9} {'x K=1':>6} {'bytes':>10} {'GPU-hours':>10}",
    ]
    for c in costs:
        hours = _gpu_hours(m, c["encodes"], c["pixels"])
        lines.append(
            f"  {'*' if c['views'] == views else ' '} {c['views']:>3} {c['encodes']:>10,} "
            f"{c['encodes'] / max(1, clips):>8.2f} {c['pixels'] / 1e9:>9.2f} "
            f"{c['pixels'] / max(1, base['pixels']):>6.2f} {_size(c['bytes']):>10} "
            f"{'-' if hours is None else f'{hours:.3g}':>10}"
        )
    if not m["encoded"]:
        lines.append("    GPU-hours: run a unit to measure (they scale with the pixels to encode, column 'x K=1')")
    return lines


def projection(cdir: Path, encodes: int, pixels: int | None = None) -> str:
    """GPU-hours for the whole cache (`encodes` latents of `pixels` pixels, None: unknown) from the rate
    finished units measured, if any."""
    m = _measured(cdir)
    if not m["encoded"]:
        return "  projection: run a unit to measure clips/s per GPU"
    rate = m["encoded"] / max(1e-9, m["seconds"])
    hours = _gpu_hours(m, encodes, pixels) if pixels is not None else encodes / rate / 3600
    return (
        f"  projection: {rate:.2f} latents/s per GPU measured over {m['units']} unit(s) -> "
        f"{hours:.3g} GPU-hours for {encodes} latents"
    )
