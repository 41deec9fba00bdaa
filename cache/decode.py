"""Decode exactly the frames a bucket needs: one container, a window, resized inside swscale.

For a clip assigned to bucket (T frames at H x W) with frame interval k, the window is
L = (T - 1) k + 1 consecutive source frames starting at a frame drawn from (seed, view, clip id),
so every node picks the same window. Decoding:

- one PyAV container per clip, closed explicitly, ``thread_type="AUTO"`` (frame threads: 1.3-1.6x
  over the default slice threading at 720p-1080p);
- a frame's index is its position in presentation order (what ``ffmpeg -fps_mode passthrough``
  outputs), so a variable-frame-rate clip is cut by frames, like the probe counts them;
- seek (to the keyframe before the window) only when the window starts beyond the first second
  and the stream is constant-rate (average rate == real base rate), where pts x rate is the
  index; decoding straight through a short clip is cheaper than a seek. A seek can land past the
  window's first frame (open-GOP leading B-frames, an index by dts, coarse MPEG-TS seeking): then
  it seeks again from further back, and finally decodes from the start, counting frames. A gap in
  the indices (a frame missing from a "constant-rate" stream) also falls back to counting. No
  frame is ever repeated to fill a window: a window the clip cannot fill is an error;
- the picture is the DISPLAYED one: the sample aspect ratio stretches the width (as
  ``scale=iw*sar:ih``) and the display matrix rotates it, before the cover resize and centre crop;
- every k-th frame of the window is converted to RGB by swscale at its final scale (area filter:
  resize inside the conversion is nearly free; one resize also does the SAR stretch), then
  rotated and centre-cropped to (H, W) in uint8. Nothing is converted to float here; decoding
  stops after the window's last frame.

``resize="opensora"`` (the cache config's ``resize``) resizes as Open-Sora 1.2's training data
does instead (``resize_crop_to_fill`` in its ``datasets/video_transforms.py``): the frame is
converted to RGB at its coded size (``frame.to_rgb()``, as its reader) and rotated, then resized with
``torch.nn.functional.interpolate(mode="bilinear", align_corners=False)`` (no antialias: a
downscale samples 2 x 2 source pixels per output pixel, so it aliases where area averages) to
cover the bucket's EXACT size (upstream's table, base/buckets.py: 240 x 426, not 424; Python's
``round`` on the side that overflows), and centre-cropped to it; the cache then keeps the centre
(H, W) of that crop (H, W: rounded down to the encoder's spatial multiple; the sizes of 256 .. 2048
are multiples of 16 already, so there the cache keeps upstream's whole picture, e.g. 384 x 672).
Only the kept pixels are computed: bilinear reads 2 x 2 taps per output pixel, so cropping first
is exact. The interpolation is numpy (this
module stays without torch), with torch's CPU arithmetic: float32 scale in/out, source index
(i + 0.5) x scale - 0.5 rounded once, clamped at 0; it agrees with torch 2.x to ~3e-5 of a level
before rounding to uint8. It costs an RGB conversion at full size per frame, so it is slower than
the area path at 1080p. With ``window = "opensora"`` too (window starts drawn from upstream's range,
window_start), a cache's samples are drawn and resized as upstream's (frame interval 1, as
Open-Sora 1.2 trains).

Raw shards are read in place: the video member of ``raw/<source>/NNNNNN-KK.tar`` is opened as a
file-like window at its byte offset, so the cache needs neither the original files nor a copy.
"""

from __future__ import annotations

import hashlib
import io
import math
from multiprocessing import shared_memory
from pathlib import Path

import av
import numpy as np

from reelcache.base.buckets import bucket_geometry
from reelcache.media import sample_aspect_ratio, video_stream

# `cache run`'s decode workers are spawned processes that import this module (to unpickle
# decode_clip_shared) and no other of the cache: keep it to numpy and PyAV, without torch or pyarrow
# (base/buckets.py is the standard library only).

RESIZES = ("area", "opensora")  # the cache config's `resize`: swscale area, or Open-Sora 1.2's bilinear
WINDOWS = ("uniform", "opensora")  # the cache config's `window`: every valid start, or Open-Sora 1.2's range


class FileSlice(io.RawIOBase):
    """A read-only, seekable view of bytes [offset, offset + size) of a file."""

    def __init__(self, path: str, offset: int, size: int):
        self.f = open(path, "rb")
        self.offset, self.size, self.pos = offset, size, 0

    def readable(self):
        return True

    def seekable(self):
        return True

    def seek(self, pos, whence=io.SEEK_SET):
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size}[whence]
        self.pos = max(0, min(self.size, base + pos))
        return self.pos

    def tell(self):
        return self.pos

    def readinto(self, buf):
        n = min(len(buf), self.size - self.pos)
        if n <= 0:
            return 0
        self.f.seek(self.offset + self.pos)
        got = self.f.readinto(memoryview(buf)[:n])
        self.pos += got
        return got

    def close(self):
        self.f.close()
        super().close()


def clip_seed(purpose: str, seed: int, clip_id: str) -> int:
    """A 64-bit seed from a full-width hash of the WHOLE clip id (and seed, purpose): ids that share a
    long prefix (``<source>/<dir>/...``) still get independent draws."""
    h = hashlib.blake2b(f"{purpose}|{seed}|{clip_id}".encode(), digest_size=32).digest()
    return int(np.random.SeedSequence(int.from_bytes(h, "big")).generate_state(1, np.uint64)[0])


def window_start(
    clip_id: str, seed: int, num_frames: int, span: int, view: int = 0, rule: str = "uniform", interval: int = 1
) -> int:
    """First source frame of the window, a pure function of (seed, view, clip id). View 0 is the one
    window of a single-view cache (its key has no view, so those caches keep their windows); view v >= 1
    of a ``views = K`` cache draws again.

    `rule` (the cache config's ``window``): "uniform" draws from all num_frames - span + 1 valid starts;
    "opensora" from Open-Sora 1.2's range (its ``TemporalRandomCrop``: ``randint(0, max(0, N - T k -
    1))`` for a window of T k frames, T = the bucket's frames, k = `interval`), which never takes the
    last valid start. For k = 1 (Open-Sora 1.2's setting) upstream's frames are then this window's;
    for k > 1 upstream spreads T frames over T k with ``linspace``, where the cache keeps every k-th."""
    if rule not in WINDOWS:
        raise ValueError(f"window = {rule!r}: expected one of {', '.join(map(repr, WINDOWS))}")
    # upstream's window is T k = span + k - 1 frames: its last start N - T k is never drawn
    room = max(0, num_frames - span - interval) if rule == "opensora" else max(0, num_frames - span)
    return clip_seed("window" if view == 0 else f"window/{view}", seed, clip_id) % (room + 1)


class _Fallback(Exception):
    """Seek-based indexing cannot be trusted for this clip: decode from the start, counting."""


def decode_window(
    source,
    *,
    frames: int,
    interval: int,
    height: int,
    width: int,
    start: int = 0,
    fps: float | None = None,
    out: np.ndarray | None = None,
    resize: str = "area",
    fit: tuple[int, int] | None = None,
) -> np.ndarray:
    """uint8 [frames, height, width, 3]: frames start, start+interval, ... resized and centre-cropped.

    `source` is a path or a seekable file-like object (FileSlice). `out`, if given, receives the
    frames (e.g. a shared-memory array). `resize`: "area" or "opensora" (module docstring); with
    "opensora", `fit` is the bucket's exact (H, W) that Open-Sora crops to (default: (height,
    width)). Raises ValueError if the clip cannot fill the window.
    """

    if resize not in RESIZES:
        raise ValueError(f"resize = {resize!r}: expected one of {', '.join(map(repr, RESIZES))}")
    fit = None if resize == "area" else fit or (height, width)
    assert fit is None or (fit[0] >= height and fit[1] >= width), (fit, height, width)
    wanted = [start + i * interval for i in range(frames)]
    if out is None:
        out = np.empty((frames, height, width, 3), dtype=np.uint8)
    container, vs = _open(source)
    try:
        rate = float(vs.average_rate or vs.guessed_rate or fps or 25)
        if start / rate > 1.0 and _constant_rate(vs):
            back = 1.0
            while start / rate - back > 0.0:
                container.seek(
                    (vs.start_time or 0) + int((start / rate - back) / vs.time_base), stream=vs, backward=True
                )
                try:
                    got = _fill(container.decode(vs), out, wanted, height, width, _sar(vs), _pts_index(vs, rate), fit)
                except _Fallback:
                    break
                if got is not None:
                    _complete(got, frames, start)
                    return out
                back *= 4  # landed past the window's first frame: seek further back
            container.close()  # the seeks failed: count frames from the start, freshly opened
            if hasattr(source, "seek"):
                source.seek(0)
            container, vs = _open(source)
        got = _fill(container.decode(vs), out, wanted, height, width, _sar(vs), None, fit)
        _complete(got, frames, start)
        return out
    finally:
        container.close()


class FrameBufferError(OSError):
    """The worker could not create the shared memory for a window: our own output failed."""


def decode_clip(job: dict, root: str, out=None) -> np.ndarray:
    """A cache job's window (cache/run.py builds the job) as uint8 [T, H, W, 3], read in place from
    its raw shard (into `out` when given). job["resize"] (default "area") picks the resize; the
    "opensora" one covers and crops the bucket's exact size, from its name."""
    resize = job.get("resize", "area")
    src = raw_member(job, root)
    try:
        return decode_window(
            src,
            frames=job["num_frames"],
            interval=job["interval"],
            height=job["height"],
            width=job["width"],
            start=job["window_start"],
            fps=job["fps"],
            out=out,
            resize=resize,
            fit=bucket_geometry(job["bucket"])[1:] if resize == "opensora" else None,
        )
    finally:
        src.close()


def raw_member(job: dict, root: str):
    """The clip's video member of its raw shard, as a seekable file: a window of the local shard, or for a root
    in S3 (``s3://``, docs/STORAGE.md) its bytes fetched by one ranged read of the shard object (base/s3.py:
    ``get_range`` checks their length; an object gone since planning is one line naming it). The member's
    blake2b-256 is then taken from those bytes (``job["content_hash"]``): the store needs it, and the parent
    must not read the object a second time."""
    if not str(root).startswith("s3://"):
        return FileSlice(str(Path(root) / job["raw_shard"]), job["raw_offset"], job["file_size"])
    from reelcache.base import s3

    url = s3.parse(root) / job["raw_shard"]
    try:
        data = s3.get_range(url, job["raw_offset"], job["file_size"])
    except s3.S3Error:
        if s3.head(url) is None:  # as a local raw shard that is gone: the clip's reject, naming it
            raise FileNotFoundError(f"{url}: no such object (deleted since the cache was planned?)") from None
        raise  # the store failed (after its retries): the unit fails, the clip is not rejected
    job["content_hash"] = hashlib.blake2b(data, digest_size=32).hexdigest()
    return io.BytesIO(data)


def decode_clip_shared(job: dict, root: str) -> tuple:
    """In a decode worker: decode into the shared-memory block job["shm"]; return (name, shape), and for a root
    in S3 the raw bytes' content hash (``raw_member``)."""
    shape = (job["num_frames"], job["height"], job["width"], 3)
    try:
        shm = shared_memory.SharedMemory(name=job["shm"], create=True, size=int(np.prod(shape)))
    except OSError as e:
        raise FrameBufferError(e.errno, f"cannot create shared memory /dev/shm/{job['shm']}: {e.strerror}") from None
    try:
        decode_clip(job, root, out=np.ndarray(shape, np.uint8, buffer=shm.buf))
    except BaseException:
        shm.close()
        shm.unlink()
        raise
    shm.close()
    return (job["shm"], shape, job["content_hash"]) if "content_hash" in job else (job["shm"], shape)


def _open(source):
    """(container, its video stream as ingest probed it) with threaded decoding."""
    container = av.open(source, metadata_errors="ignore")
    vs = video_stream(container)
    if vs is None:
        container.close()
        raise ValueError("no video stream (only attached pictures or none)")
    vs.thread_type = "AUTO"
    return container, vs


def _constant_rate(vs) -> bool:
    avg, base = vs.average_rate, vs.base_rate
    return bool(avg and base) and abs(float(avg) / float(base) - 1.0) < 1e-3


def _pts_index(vs, rate: float):
    tb, t0 = vs.time_base, vs.start_time or 0

    def index(frame):
        if frame.pts is None:
            raise _Fallback
        x = float((frame.pts - t0) * tb) * rate
        if abs(x - round(x)) > 0.25:  # off the constant-rate grid: not a CFR stream after all
            raise _Fallback
        return round(x)

    return index


def _sar(vs) -> float:
    return float(sample_aspect_ratio(vs))


def _fill(frames_iter, out, wanted, height, width, sar, index, fit=None):
    """Decode into out[k] the frames whose index is wanted[k]; return how many were filled, or
    None when a seek landed past wanted[0]. `index` maps a frame to its index (None: count).
    `fit`: None resizes by area; (H, W) as Open-Sora 1.2 does, cropping that size first."""
    got, k, prev, geometry = 0, 0, None, None
    for frame in frames_iter:
        idx = k if index is None else index(frame)
        k += 1
        if prev is None and idx > wanted[0]:
            return None
        if prev is not None and idx != prev + 1:
            raise _Fallback  # a missing or repeated index: counting is the only truth
        prev = idx
        if idx != wanted[got]:
            continue
        if fit is not None:
            if geometry is None:
                geometry = _bilinear_geometry(frame, height, width, fit, sar)
            out[got] = _bilinear(frame, *geometry)
            got += 1
            if got == len(wanted):
                break
            continue
        if geometry is None:
            geometry = _geometry(frame, height, width, sar)
        sw, sh, rot = geometry
        rgb = frame.reformat(width=sw, height=sh, format="rgb24", interpolation="AREA").to_ndarray()
        if rot:
            rgb = np.rot90(rgb, k=rot // 90)
        y, x = (rgb.shape[0] - height) // 2, (rgb.shape[1] - width) // 2
        out[got] = rgb[y : y + height, x : x + width]
        got += 1
        if got == len(wanted):
            break
    return got


def _complete(got: int, frames: int, start: int) -> None:
    if got < frames:
        raise ValueError(f"clip ended after {got} of {frames} frames of the window starting at frame {start}")


def _geometry(frame, height: int, width: int, sar: float = 1.0) -> tuple[int, int, int]:
    """Scaled coded size (sw, sh) whose displayed picture covers (height, width), and the rotation.

    Displayed = coded width x sample aspect ratio, then rotated by the display matrix."""
    rot = int(frame.rotation or 0) % 360
    pw, ph = frame.width * sar, frame.height
    dw, dh = (ph, pw) if rot in (90, 270) else (pw, ph)
    scale = max(height / dh, width / dw)
    sdw, sdh = max(width, math.ceil(dw * scale - 1e-6)), max(height, math.ceil(dh * scale - 1e-6))
    sw, sh = (sdh, sdw) if rot in (90, 270) else (sdw, sdh)
    return sw, sh, rot


def _bilinear_geometry(frame, height: int, width: int, fit: tuple[int, int], sar: float = 1.0) -> tuple:
    """(rotation, row taps, column taps) of Open-Sora 1.2's resize_crop_to_fill to `fit` = (th, tw),
    restricted to the centre (height, width) of its crop.

    Upstream, on the (T, C, h, w) clip: rh, rw = th / h, tw / w; if rh > rw: (sh, sw) = (th,
    round(w rh)), else (round(h rw), tw); bilinear to (sh, sw); crop (th, tw) at
    (int(round(sh - th) / 2.0), int(round(sw - tw) / 2.0)), i.e. the floor of half the excess.
    Here h, w are the displayed picture's (SAR, rotation), so a non-square SAR is a per-axis scale
    of the same one interpolation (upstream ignores the SAR; for square pixels this is upstream's)."""
    rot = int(frame.rotation or 0) % 360
    pw, ph = frame.width * sar, frame.height
    dw, dh = (ph, pw) if rot in (90, 270) else (pw, ph)
    th, tw = fit
    rh, rw = th / dh, tw / dw
    sh, sw = (th, round(dw * rh)) if rh > rw else (round(dh * rw), tw)
    y = (sh - th) // 2 + (th - height) // 2
    x = (sw - tw) // 2 + (tw - width) // 2
    ih, iw = (frame.width, frame.height) if rot in (90, 270) else (frame.height, frame.width)  # rotated, coded
    return rot, _taps(ih, sh, y, height), _taps(iw, sw, x, width)


def _taps(n_in: int, n_out: int, first: int, count: int) -> tuple:
    """torch's bilinear (align_corners=False) along one axis resized n_in -> n_out, for the outputs
    first .. first + count - 1: (i0, i1, w0, w1), output = w0 x[i0] + w1 x[i1].

    As torch's CPU kernel computes them: scale = float32(n_in) / n_out; source = (i + 0.5) x scale
    - 0.5 with one rounding to float32 (a fused multiply-add), clamped at 0; i0 = floor, i1 = i0 + 1
    within the input; w1 = source - i0."""
    scale = np.float32(n_in) / np.float32(n_out)
    src = ((np.arange(first, first + count) + 0.5) * np.float64(scale) - 0.5).astype(np.float32)
    src = np.maximum(src, np.float32(0.0))
    i0 = np.minimum(src.astype(np.intp), n_in - 1)
    w1 = np.clip(src - i0.astype(np.float32), np.float32(0.0), np.float32(1.0))
    return i0, np.minimum(i0 + 1, n_in - 1), np.float32(1.0) - w1, w1


def _bilinear(frame, rot: int, rows: tuple, cols: tuple) -> np.ndarray:
    """One frame through `_bilinear_geometry`'s taps: uint8 [height, width, 3]."""
    rgb = frame.to_rgb().to_ndarray()  # at its coded size, as upstream's read_video_av
    if rot:
        rgb = np.rot90(rgb, k=rot // 90)
    (r0, r1, a0, a1), (c0, c1, b0, b1) = rows, cols
    b0, b1 = b0[:, None], b1[:, None]
    top, bottom = rgb[r0], rgb[r1]
    # along W, then H: the order of torch's kernel; float32, on 0..255 (upstream: 0..1, the same up to rounding)
    top = top[:, c0] * b0 + top[:, c1] * b1
    bottom = bottom[:, c0] * b0 + bottom[:, c1] * b1
    v = top * a0[:, None, None] + bottom * a1[:, None, None]
    return (v + 0.5).astype(np.uint8)  # round half up: v is a convex combination of 0..255
