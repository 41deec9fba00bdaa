"""The viewer's own files under ROOT/view-cache/: thumbnails, and previews of what the model sees.

- a thumbnail: the first frame of a clip, read in place from its raw shard (no extraction), as
  displayed (sample aspect ratio and rotation applied), as a JPEG at most 192 px on a side;
- a view's window: the frames the cache decoded for it (cache/decode.py's ``decode_clip``, the same
  window, resize and crop), as an H.264 mp4 at the clip's rate divided by the frame interval, so it
  lasts as long as the window does in the clip;
- a view's latent decoded back to pixels by the cache's own VAE (cache/encoders.py's
  ``VideoEncoder.decode``, built from the cache's plan like eval builds it, its identity checked
  against cache.json), from the posterior mean (no sampling noise), as an mp4 of the same rate.

Each is made once on the first request, written atomically, and served from its file after that;
one lock per file keeps two requests from making it twice. Latent samples are read by
``read_latent`` alone, so a change of the sample format touches one function here.
"""

from __future__ import annotations

import hashlib
import threading
from contextlib import contextmanager
from pathlib import Path

import av

from reelcache import UserError
from reelcache.cache.decode import decode_clip, raw_member
from reelcache.catalog.withdrawn import VIEW_CACHE, view_cache_key
from reelcache.files import atomic_path
from reelcache.media import write_mp4

# torch, diffusers and the cache's encoders (cache/encoders.py) are imported when the
# first latent preview is made: the pages start and serve without torch.

CACHE_DIR = VIEW_CACHE  # every file of a clip here is named view_cache_key(clip id)...: a takedown deletes them
THUMB = 192

_locks: dict[str, list] = {}  # key -> [lock, holders and waiters]: gone when the last one leaves
_locks_guard = threading.Lock()
_encoders: dict[str, object] = {}


@contextmanager
def _lock(key: str):
    """One lock per key while anyone holds or waits for it; removed after, so a server that makes a
    thumbnail of every clip of a large catalog does not keep a lock for each."""
    with _locks_guard:
        entry = _locks.setdefault(key, [threading.Lock(), 0])
        entry[1] += 1
    try:
        with entry[0]:
            yield
    finally:
        with _locks_guard:
            entry[1] -= 1
            if entry[1] == 0:
                del _locks[key]


def _name(*parts) -> str:
    return hashlib.sha1("|".join(map(str, parts)).encode()).hexdigest()[:24]


def _key(latent: dict, ident: dict) -> str:
    """A view's preview file name: the clip's view_cache_key (a takedown deletes by it), then the view's."""
    rest = _name(latent["cache"], ident.get("name"), latent["clip_id"], latent["view"], latent["shard_offset"])
    return f"{view_cache_key(latent['clip_id'])}-{rest}"


def read_latent(root, latent: dict) -> dict:
    """The video latent of a ``latents`` row (its shard and offset; its caption shard is not read):
    base/latents.py's reader, the loader's own, which knows every form of a sample."""
    from reelcache.base.latents import read_latent as read

    return read(root, {"shard": latent["shard"], "shard_offset": latent["shard_offset"]})


def _made(path: Path, make) -> Path:
    """``path``, made by ``make(tmp)`` once (atomically) if it does not exist yet."""
    if path.exists():
        return path
    with _lock(str(path)):
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            make(path)
    return path


def _job(clip: dict) -> dict:
    """The clip's raw member as cache/decode.py names it (shard, offset, size)."""
    return {"raw_shard": clip["shard"], "raw_offset": clip["shard_offset"], "file_size": clip["file_size"]}


def thumbnail(root: Path, clip: dict, data: str | None = None) -> Path:
    """A JPEG of the clip's first frame, from its shard member. `root`: the local folder of the viewer's files
    (the root, or a root in S3's mirror); `data`: where the shards are (the root or its ``s3://`` URL: the member
    read by one ranged GET)."""

    def make(path: Path) -> None:
        src = raw_member(_job(clip), data or str(root))
        try:
            with av.open(src, metadata_errors="ignore") as container:
                frame = next(container.decode(video=0))
                img, rot = frame.to_image(), int(frame.rotation or 0) % 360
        finally:
            src.close()
        # the displayed picture, as cache/decode.py makes it: the sample aspect ratio, then the display matrix
        sar = (clip.get("sar_num") or 1) / (clip.get("sar_den") or 1)
        if sar != 1:
            img = img.resize((max(1, round(img.width * sar)), img.height))
        if rot:
            img = img.rotate(rot, expand=True)  # counter-clockwise, as np.rot90(k=rot // 90) there
        img.thumbnail((THUMB, THUMB))
        with atomic_path(path) as tmp:
            img.save(tmp, format="JPEG", quality=80)

    return _made(root / CACHE_DIR / "thumbs" / f"{view_cache_key(clip['clip_id'])}.jpg", make)


def cache_doc(root: Path, cache: str) -> tuple[object, dict]:
    """(the cache's CacheConfig, its cache.json)."""
    from reelcache.cache.plan import load_cache

    cfg, _plan, ident = load_cache(root, cache)
    return cfg, ident


def preview_fps(clip: dict, ident: dict) -> float:
    return float(clip["fps"] or 24.0) / int(ident["buckets"].get("frame_interval", 1))


def window_preview(root: Path, clip: dict, latent: dict, data: str | None = None) -> Path:
    """The view's window of the raw clip as the cache decoded it (bucket size, cropped), as mp4."""
    cfg, ident = cache_doc(root, latent["cache"])
    key = _key(latent, ident)

    def make(path: Path) -> None:
        job = {
            **_job(clip),
            "fps": clip["fps"],
            "bucket": latent["bucket"],
            "num_frames": latent["num_frames"],
            "height": latent["height"],
            "width": latent["width"],
            "window_start": latent["window_start"],
            "interval": int(ident["buckets"].get("frame_interval", 1)),
            "resize": cfg.resize,
        }
        write_mp4(decode_clip(job, data or str(root)), path, fps=preview_fps(clip, ident))

    return _made(root / CACHE_DIR / "window" / latent["cache"] / f"{key}.mp4", make)


_imports = threading.Lock()


def import_vae_libraries() -> None:
    """torch, diffusers and the cache's encoders, imported under one lock: diffusers' lazy module is not
    safe to import from two threads at once (server.py warms them in the background at start)."""
    with _imports:
        import diffusers  # noqa: F401

        import reelcache.cache.encoders  # noqa: F401


def _encoder(root: Path, cache: str):
    """The cache's VideoEncoder on CPU, rebuilt from its plan and checked against its cache.json."""
    import_vae_libraries()
    with _lock(f"encoder:{cache}"), _imports:  # building one resolves diffusers' lazy attributes
        if cache not in _encoders:
            from reelcache.cache.encoders import VideoEncoder
            from reelcache.cache.plan import diff
            from reelcache.cache.spec import spec_identity

            cfg, ident = cache_doc(root, cache)
            changed = diff(ident["video_encoder"], spec_identity(cfg.video_encoder))
            if changed:
                raise UserError(f"cache {cache!r}: its VAE differs from cache.json ({'; '.join(changed)})")
            _encoders[cache] = VideoEncoder(cfg.video_encoder, "cpu")
        return _encoders[cache]


def latent_preview(root: Path, clip: dict, latent: dict, data: str | None = None) -> Path:
    """The view's latent (posterior mean) decoded by the cache's VAE, as mp4."""
    _cfg, ident = cache_doc(root, latent["cache"])
    key = _key(latent, ident)

    def make(path: Path) -> None:
        tensors = read_latent(data or root, latent)
        z = tensors["mean"] if "mean" in tensors else tensors["sample"]
        frames = _encoder(root, latent["cache"]).decode(z[None].float(), latent["num_frames"])[0]
        write_mp4(frames, path, fps=preview_fps(clip, ident))

    return _made(root / CACHE_DIR / "latent" / latent["cache"] / f"{key}.mp4", make)
