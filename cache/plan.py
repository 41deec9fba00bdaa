"""``cache plan``: assign buckets, freeze the work, fix the cache's identity, print units.

Reads a cache config (``configs/cache/*.toml``) and the catalog manifest it names; assigns every
clip a bucket (base/buckets.py: a pure function of seed, clip id and bucket config) and a
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

The store (cache/store.py, cache/reuse.py). Latents and caption embeddings are stored once under the
root, addressed by content; the plan looks every draw and caption up in the store's indexes and plans
only what no cache of the root has encoded with the same identity, printing new vs reused encodes,
bytes (cache format 1, where each sample held its caption, vs the store) and GPU-hours for the new
encodes (cache/costs.py). A cache may be re-planned over another manifest (a superset, changed
captions): cache.json's manifest fingerprint follows it, finished units whose clips and draws are
unchanged stay valid, the others run again and encode only what is new. Anything else that differs
(encoders, buckets, seed, views, store) is refused as before. A manifest that does not exist is one
line naming it.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from reelcache import UserError
from reelcache.base import s3
from reelcache.base.aspect_tables import SOURCE as BUCKET_SIZES
from reelcache.base.buckets import BucketConfig
from reelcache.cache.costs import measured, report, view_costs
from reelcache.cache.decode import RESIZES, WINDOWS, window_start
from reelcache.cache.reuse import plan_id, plan_store
from reelcache.cache.spec import TINY_VIDEO, EncoderSpec, spatial_multiple, spec_identity, temporal_ratio
from reelcache.catalog.manifest import read_manifest, resolve_manifest
from reelcache.files import atomic_path
from reelcache.log import say
from reelcache.settings import NAME, TEXT, build, load_toml, setting

CACHE_VERSION = 2  # 2: the content-addressed store (cache/store.py); 1: each sample held its caption
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


def load_cache(root, name: str) -> tuple[CacheConfig, dict, dict]:
    """A planned cache: (the CacheConfig it was planned with, its plan.json, its cache.json identity): the
    config first and then the plan, as ingest's ``load_plan`` returns them."""
    cdir = cache_dir(root, name)
    try:
        plan = json.loads((cdir / "_plan" / "plan.json").read_text())
        ident = json.loads((cdir / "cache.json").read_text())
    except FileNotFoundError:
        raise UserError(f"no cache {name!r} under {root}: run `reelcache cache plan` first") from None
    return CacheConfig.from_dict(plan["config"], str(cdir / "_plan" / "plan.json")), plan, ident


def _checked_buckets(cfg: CacheConfig) -> BucketConfig:
    buckets = BucketConfig.from_toml(cfg.buckets)
    ratio = temporal_ratio(cfg.video_encoder)
    bad = sorted({t for _, t, *_ in buckets.table if t > 1 and (t - 1) % ratio})
    if bad:
        raise UserError(
            f"{cfg.video_encoder.kind} encodes 1 + a multiple of {ratio} frames; bucket frame counts "
            f"{bad} in {cfg.buckets} are not (e.g. {[1 + ratio * ((t - 1) // ratio) for t in bad]})"
        )
    return buckets


def _check_existing(cdir: Path, cfg: CacheConfig, ident: dict) -> None:
    """Refuse to mix latents: an existing cache.json, and the plan of finished units, may differ from
    this plan only in the manifest (a re-plan over another manifest reuses what the store holds)."""
    if (cdir / "cache.json").exists():
        old = json.loads((cdir / "cache.json").read_text())
        if d := [x for x in diff(old, ident) if not x.startswith("manifest_fingerprint:")]:
            raise UserError(
                f"cache {cfg.name!r} exists with another identity; refusing to mix latents. "
                f"Differences (existing != new):\n  "
                + "\n  ".join(d[:12])
                + "\nUse a new cache name (latents the store holds with the same identity are reused), or delete "
                "the cache folder to rebuild it."
            )
    old_plan = cdir / "_plan" / "plan.json"
    if old_plan.exists() and any(cdir.glob("[0-9]*.parquet")):
        prev = json.loads(old_plan.read_text())["config"]
        prev.setdefault("resize", "area")  # a plan made before the option resized by area
        prev.setdefault("views", 1)  # a plan made before views drew once
        prev.setdefault("window", "uniform")  # a plan made before the option drew from every start
        now = json.loads(json.dumps(dataclasses.asdict(cfg), default=str))
        if d := [x for x in diff(prev, now) if not x.startswith("manifest:")]:
            raise UserError(
                f"cache {cfg.name!r} has finished units planned with another configuration "
                "(unit boundaries would move):\n  " + "\n  ".join(d[:12])
            )


def _draws(table, cfg: CacheConfig, buckets: BucketConfig, upto: int) -> list[tuple[dict, list[dict]]]:
    """(manifest row, [draw of view 0 .. upto-1]) per clip: bucket, encoded size, window, same_as."""
    mult = spatial_multiple(cfg.video_encoder)
    out = []
    for r in table.to_pylist():
        first: dict = {}  # (bucket, window) -> the first view that drew it
        clip_draws = []
        for v in range(upto):
            a = buckets.assign(r["clip_id"], r["height"], r["width"], r["num_frames"], cfg.seed, view=v)
            span = (a.num_frames - 1) * buckets.frame_interval + 1 if a.bucket else 0
            rule = {"rule": cfg.window, "interval": buckets.frame_interval}
            start = window_start(r["clip_id"], cfg.seed, r["num_frames"], span, view=v, **rule) if a.bucket else None
            same_as = first.setdefault((a.bucket, start), v) if a.bucket else None
            clip_draws.append(
                {
                    "clip_id": r["clip_id"],
                    "view": v,
                    "bucket": a.bucket,
                    "num_frames": a.num_frames,
                    "height": a.height and a.height - a.height % mult,
                    "width": a.width and a.width - a.width % mult,
                    "window_start": start,
                    "no_bucket": a.reason,
                    "same_as": same_as if same_as != v else None,
                }
            )
        out.append((r, clip_draws))
    return out


# What of a root in S3 a cache's plan and runs read, mirrored locally (base/s3.py: sync_down): the manifests, the
# store's indexes (what is encoded already), and the cache's own plan, identity and finished units' sidecars.
def _mirrored(name: str):
    own = re.compile(rf"latents/{re.escape(name)}/(cache\.json|_plan/(plan\.json|input\.parquet)|[0-9]+\.parquet)")
    other = re.compile(r"manifests/[^/]+\.parquet|store/(video|text)/[^/]+/[^/]+\.parquet")
    return lambda rel: own.fullmatch(rel) is not None or other.fullmatch(rel) is not None


def _mirrored_under(name: str) -> tuple[str, ...]:
    """The folders `_mirrored(name)` takes files from, each listed (base/s3.py: sync_down's under)."""
    return ("manifests/", "store/", f"latents/{name}/")


def local_root(root, name: str) -> Path:
    """The folder a cache's plan and units work in: the root, or for a root in S3 (docs/STORAGE.md) its local
    mirror (base/s3.py: ``mirror_dir``), brought up to date with what the plan and the units read."""
    if not s3.is_url(root):
        return Path(root)
    local = s3.mirror_dir(root)
    s3.sync_down(root, local, _mirrored(name), under=_mirrored_under(name))
    return local


def make_plan(root, cfg: CacheConfig) -> list[str]:
    """Plan the cache (module docstring). A root in S3: planned in its local mirror, the raw shards' stamps from
    their objects; then ``_plan/input.parquet``, ``cache.json`` and last ``_plan/plan.json`` are uploaded whole,
    and the sidecars of finished units the plan runs again are deleted."""
    if not s3.is_url(root):
        return _make_plan(root, cfg)
    local = local_root(root, cfg.name)
    out = _make_plan(local, cfg, raw_root=root)
    cdir, remote = cache_dir(local, cfg.name), s3.parse(root) / "latents" / cfg.name
    for rel in ("_plan/input.parquet", "cache.json", "_plan/plan.json"):  # plan.json last: names a whole plan
        s3.upload_file(cdir / rel, remote / rel)
    kept = {p.name for p in cdir.glob("[0-9]*.parquet")}
    for o in s3.list_objects(f"{remote}/"):
        leaf = o["Key"].rsplit("/", 1)[-1]
        if "/" not in o["Key"][len(remote.key) + 1 :] and re.fullmatch(r"[0-9]+\.parquet", leaf) and leaf not in kept:
            s3.delete(s3.Url(remote.bucket, o["Key"]))  # a stale unit's sidecar: it runs again
    # the mirror's copies now carry the objects' times
    s3.sync_down(root, local, _mirrored(cfg.name), under=_mirrored_under(cfg.name))
    return out


def _make_plan(root, cfg: CacheConfig, raw_root=None) -> list[str]:
    buckets = _checked_buckets(cfg)
    try:
        mpath = resolve_manifest(root, cfg.manifest)
    except ValueError as e:
        raise UserError(f"manifest = {cfg.manifest!r}: {e}") from None
    table, fp = read_manifest(mpath)
    need = {"clip_id", "shard", "shard_offset", "file_size", "num_frames", "width", "height", "text"}
    if missing := need - set(table.column_names):
        raise UserError(f"{mpath} lacks {sorted(missing)}: make it with `reelcache catalog manifest`")
    ident = identity(cfg, buckets, fp)
    cdir = cache_dir(root, cfg.name)
    _check_existing(cdir, cfg, ident)
    table_views = max(cfg.views, 3)  # the cost table's K = 1 .. max(K, 3)
    clips = _draws(table, cfg, buckets, table_views)
    rows, draws, stale = plan_store(root, cfg, ident, clips, raw_root=raw_root)
    cdir.mkdir(parents=True, exist_ok=True)
    (cdir / "_plan").mkdir(exist_ok=True)
    for u in stale:  # its clips or draws changed: it runs again, reusing what the store holds
        (cdir / f"{u:06d}.parquet").unlink(missing_ok=True)
    if stale:
        say(f"cache plan: {len(stale)} finished unit(s) changed and will run again (their latents are reused)")
    with atomic_path(cdir / "_plan" / "input.parquet") as tmp:  # a unit's clips with all their views
        pq.write_table(pa.Table.from_pylist(rows), tmp, row_group_size=cfg.clips_per_unit * cfg.views)
    num_clips = len(clips)
    num_units = -(-num_clips // cfg.clips_per_unit)
    costs = view_costs(draws, cfg, ident, measured(cdir).get("text_tokens"), table_views)
    doc = {
        "config": dataclasses.asdict(cfg),
        "num_units": num_units,
        "num_clips": num_clips,
        "num_encodes": costs[cfg.views - 1]["new"],
        "num_pixels": costs[cfg.views - 1]["new_pixels"],
        "manifest": str(mpath),
        "plan_id": plan_id(rows),
    }
    with atomic_path(cdir / "_plan" / "plan.json") as tmp:
        tmp.write_text(json.dumps(doc, indent=2, default=str))
    with atomic_path(cdir / "cache.json") as tmp:  # this manifest's fingerprint (the rest is checked equal)
        tmp.write_text(json.dumps(ident, indent=2))
    report(rows, cdir, num_clips, cfg.views, costs)
    return [f"{cfg.name}/{i:06d}" for i in range(num_units)]
