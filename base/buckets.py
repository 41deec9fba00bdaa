"""Open-Sora 1.2 buckets: which (resolution, frame count, aspect ratio) each clip trains at.

A bucket config (``configs/buckets/*.toml``) maps resolution -> {num_frames: [keep probability,
per-GPU batch size]}, the shape of Open-Sora 1.2's ``bucket_config``. Resolutions are pixel
budgets (240p = 102,240 = 240 x 426); each has its own table of aspect keys (H/W, two decimals) and
their exact (H, W), Open-Sora 1.2's numbers (base/aspect_tables.py, source and commit named
there): 144p-1080p have the 17 keys 0.38 .. 2.08 ("0.56" is 9:16, 240 x 426 at 240p; 0.75 is
276 x 368 there), and 256, 512, 1024, 2048 PixArt's 40 keys 0.25 .. 4.00 with sizes multiples of 16
(16:9 at 512 is "0.57", 384 x 672). The sizes are a table, not a formula: they differ from
round(sqrt(budget x ratio)) by 1-2 px in places.
The cache keeps the centre of that size rounded down to its encoder's spatial
multiple (cache/plan.py: 240 x 426 is stored 240 x 424, the same 53 latent columns); the sizes at
256 .. 2048 are multiples of 16 already and are stored as they are.

Assignment, for a clip of H x W pixels and N frames, trying resolutions from the largest budget
down:

1. the resolution is eligible when H*W >= 0.8 x its budget;
2. lengths are tried from the longest down: a length whose keep probability is a pair
   (p_res, p_t) is tried only when a draw passes p_t (frame-level demotion: B1 offers 102 frames
   to a third of the clips that could take them); the first T with N > T x frame_interval is
   chosen (T = 1, the image bucket, only for single-frame clips);
3. p_res then keeps the clip at (resolution, T) or demotes it to the next resolution; an entry
   with batch size 0 (upstream's ``(0.0, None)``) is a length that is never kept, so a clip that
   reaches it is demoted too. Every draw is a hash of (seed, clip id, resolution, T, which, view):
   assignment is a pure function of (seed, clip id, config, view), reproducible on any node in any
   order;
4. the aspect key is the nearest key of that resolution's table: |H/W - key| smallest, the first
   in upstream's table order among equally near keys (upstream's ``get_closest_ratio``; a 4:3
   clip, H/W = 0.75, is "0.72" at 256: 208 x 288). The bucket is "<resolution>/<T>/<key>".

Every entry is checked as it is read (``Bucket``'s rules: a known resolution, probabilities in
[0, 1], a batch size >= 0), so a bad one is one line naming the file and its key.

Open-Sora 1.2 makes this draw again every epoch (its sampler seeds it with seed + epoch). A cache
with ``views = K`` stores K independent draws per clip: ``view`` v is one more draw by the same
rule from its own hashes (view 0 hashes exactly as a single-draw cache always has, so its buckets
never change), and the loader shows view v(e) at epoch e (train/plan.py).

A clip that fits nowhere gets no bucket and a reason (too_small, too_short, not_kept); the
cache records it instead of losing it. Both the cache (assignment) and the loader (batch sizes)
read the same config.
"""

from __future__ import annotations

import functools
import hashlib
import tomllib
from dataclasses import dataclass
from pathlib import Path

from reelcache import UserError
from reelcache.base.aspect_tables import OPENSORA12_ASPECT
from reelcache.settings import build, check, setting

# resolution -> (pixel budget, {aspect key: (H, W)}): Open-Sora 1.2's own tables (base/aspect_tables.py).
TABLES = OPENSORA12_ASPECT
# Pixel budgets: the 16:9 (or square) size of each resolution (240p = 102,240 = 240 x 426).
RESOLUTIONS = {res: budget for res, (budget, _) in TABLES.items()}


def bucket_hw(resolution: str, ar_key: str) -> tuple[int, int]:
    """(H, W) of an aspect key at a resolution: upstream's table entry (240p/0.75: 276 x 368)."""
    try:
        return TABLES[resolution][1][ar_key]
    except KeyError:
        keys = list(TABLES.get(resolution, (0, {}))[1])
        have = (
            f"{len(keys)} keys at {resolution}, {keys[0]} .. {keys[-1]}" if keys else f"resolutions {', '.join(TABLES)}"
        )
        raise UserError(
            f"bucket size {resolution}/{ar_key}: no such entry in Open-Sora 1.2's tables ({have}). Caches "
            "planned before reelcache took these tables named buckets otherwise: plan them again (docs/DATASETS.md)"
        ) from None


def bucket_geometry(bucket: str) -> tuple[int, int, int]:
    """(pixel frames, pixel height, pixel width) of a bucket name "<resolution>/<T>/<ar key>"."""
    parts = str(bucket).split("/")
    if len(parts) != 3 or not parts[1].isdigit():
        raise UserError(f"bucket {bucket!r}: expected <resolution>/<frames>/<aspect key>, e.g. 240p/51/0.56")
    res, t, ar = parts
    h, w = bucket_hw(res, ar)
    return int(t), h, w


def nearest_ratio(height: int, width: int, resolution: str) -> str:
    """Upstream's ``get_closest_ratio`` over the resolution's table: the key k with |H/W - float(k)|
    smallest, the first in table order among equally near ones (256, 4:3 -> "0.72": 208 x 288)."""
    ar = height / width
    return min(TABLES[resolution][1], key=lambda k: abs(float(k) - ar))


def _uniform(seed: int, clip_id: str, resolution: str, frames: int, which: str = "", view: int = 0) -> float:
    # view 0 keeps the key of a single-draw cache (no view in it): those caches keep their buckets
    key = f"{seed}|{clip_id}|{resolution}|{frames}{which}" + (f"|view{view}" if view else "")
    h = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(h, "big") / 2**64


def _row(res, t, spec) -> tuple:
    """One TOML entry ``T = batch | [keep, batch] | [[p_res, p_t], batch]`` of ``[buckets.<res>]``."""
    key = f"buckets.{res}.{t}"
    if not str(t).isdigit():
        raise UserError(f"{key}: the keys of [buckets.{res}] are frame counts")
    keep, batch = spec if isinstance(spec, (list, tuple)) else (1.0, spec)
    if isinstance(spec, (list, tuple)) and (len(spec) != 2 or isinstance(keep, (list, tuple)) and len(keep) != 2):
        raise UserError(f"{key} = {spec!r}: expected a batch size, [keep, batch] or [[p_res, p_t], batch]")
    p_res, p_t = keep if isinstance(keep, (list, tuple)) else (keep, 1.0)
    if batch is None:
        batch = 0  # upstream's (0.0, None): never kept
    b = build(Bucket, {"resolution": str(res), "num_frames": int(t), "keep": p_res, "keep_t": p_t, "batch": batch}, key)
    # floats as floats (the table's repr is part of fingerprints); a never-kept length demotes every
    # clip that reaches it, whatever its keep probability says
    return b.resolution, b.num_frames, float(b.keep) if b.batch > 0 else 0.0, float(b.keep_t), b.batch


@dataclass(frozen=True)
class Assignment:
    bucket: str | None  # "<resolution>/<T>/<ar key>", None when the clip fits no bucket
    resolution: str | None = None
    num_frames: int | None = None
    height: int | None = None
    width: int | None = None
    reason: str | None = None  # too_small | too_short | not_kept, when bucket is None


@dataclass(frozen=True)
class Bucket:
    """One (resolution, num_frames) entry of a bucket config: a row of ``BucketConfig.table``."""

    resolution: str = setting("240p", "pixel budget (RESOLUTIONS)", choices=RESOLUTIONS)
    num_frames: int = setting(1, "frames T (1: the image bucket)", ge=1)
    keep: float = setting(1.0, "p_res: probability to keep a clip at this resolution, else demote it", ge=0, le=1)
    keep_t: float = setting(1.0, "p_t: probability that this length is offered at all", ge=0, le=1)
    batch: int = setting(0, "per-GPU batch size; 0: never kept (upstream's (0.0, None))", ge=0)


@dataclass(frozen=True)
class BucketConfig:
    table: tuple = setting((), "(resolution, num_frames, keep, keep_t, batch) rows, sorted", rows=Bucket)
    frame_interval: int = setting(1, "pixel frames between two sampled frames", ge=1)
    default_batch_size: int | None = setting(None, "batch size of a bucket the table lacks (None: an error)", ge=1)

    def __post_init__(self):
        check(self)

    @classmethod
    def from_dict(cls, buckets: dict, frame_interval: int = 1, default_batch_size: int | None = None):
        """{resolution: {T: batch | [keep, batch] | [[p_res, p_t], batch]}}; batch 0 = never kept."""
        if not isinstance(buckets, dict):
            raise UserError(f"buckets = {buckets!r}: expected a table {{resolution: {{frames: batch size}}}}")
        rows = []
        for res, frames in buckets.items():
            if not isinstance(frames, dict):
                raise UserError(f"buckets.{res} = {frames!r}: expected a table {{frames: batch size}}")
            for t, spec in frames.items():
                rows.append(_row(res, t, spec))
        if not any(r[4] > 0 for r in rows):
            raise UserError("the bucket config has no (resolution, num_frames) with a batch size > 0")
        return cls(tuple(sorted(rows)), frame_interval, default_batch_size)

    @classmethod
    def from_toml(cls, path) -> BucketConfig:
        """A bucket config file; a bad value is one line naming the file and the key. A missing
        file raises FileNotFoundError (its readers decide what that means)."""
        with open(path, "rb") as f:
            try:
                doc = tomllib.load(f)
            except tomllib.TOMLDecodeError as e:
                raise UserError(f"{path}: {e}") from None
        try:
            if unknown := sorted(set(doc) - {"buckets", "frame_interval", "default_batch_size"}):
                raise UserError(f"unknown keys {unknown}; known: buckets, frame_interval, default_batch_size")
            if "buckets" not in doc:
                raise UserError("no [buckets] table")
            return cls.from_dict(doc["buckets"], doc.get("frame_interval", 1), doc.get("default_batch_size"))
        except UserError as e:
            raise UserError(f"{path}: {e}") from None

    @staticmethod
    def path_from(config_file, value: str) -> str:
        """A stage config's ``buckets = "..."``: relative to the working directory, else to that
        config file's folder (so configs/cache/x.toml may say "../buckets/y.toml")."""
        p = Path(value)
        beside = Path(config_file).resolve().parent / p
        if value and not p.is_absolute() and not p.exists() and beside.exists():
            return str(beside)
        return value

    def key(self) -> str:
        return repr((self.table, self.frame_interval, self.default_batch_size))

    def batch_size(self, bucket: str) -> int:
        parts = bucket.split("/")
        for res, t, _, _, b in self.table:
            if len(parts) >= 2 and parts[0] == res and parts[1] == str(t) and b > 0:
                return b
        if self.default_batch_size:
            return self.default_batch_size
        raise ValueError(
            f"bucket {bucket!r} has no batch size in the bucket config "
            f"(resolutions {sorted({r for r, *_ in self.table})}) and no default_batch_size"
        )

    @functools.cached_property
    def _by_resolution(self) -> list[tuple[str, list[tuple[int, float, float]]]]:
        """[(resolution, [(T, p_res, p_t), ...] longest first), ...], largest resolution first: the
        order assign() tries them in, built once (assign runs once per clip of a manifest)."""
        by_res: dict[str, list] = {}
        for res, t, keep, keep_t, _ in self.table:
            by_res.setdefault(res, []).append((t, keep, keep_t))
        return [(res, sorted(by_res[res], reverse=True)) for res in sorted(by_res, key=lambda r: -RESOLUTIONS[r])]

    def assign(
        self, clip_id: str, height: int, width: int, num_frames: int, seed: int = 0, view: int = 0
    ) -> Assignment:
        """The clip's bucket in draw `view` (0: the one draw of a single-view cache; see the module doc)."""
        sized = fitted = False
        for res, lengths in self._by_resolution:
            if height * width < 0.8 * RESOLUTIONS[res]:
                continue
            sized = True
            chosen = None
            for t, keep, keep_t in lengths:
                fits = (t == 1 and num_frames == 1) or (t > 1 and num_frames > t * self.frame_interval)
                if not fits:
                    continue
                fitted = True
                if keep_t >= 1.0 or _uniform(seed, clip_id, res, t, "/t", view) < keep_t:
                    chosen = (t, keep)
                    break
            if chosen is None:
                continue
            t, keep = chosen
            if keep >= 1.0 or _uniform(seed, clip_id, res, t, view=view) < keep:
                ar = nearest_ratio(height, width, res)
                h, w = bucket_hw(res, ar)
                return Assignment(f"{res}/{t}/{ar}", res, t, h, w)
        return Assignment(None, reason="not_kept" if fitted else "too_short" if sized else "too_small")
