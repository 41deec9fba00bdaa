"""Probe a video file from its headers and packets, never by decoding it whole.

One PyAV container per file, closed explicitly in ``finally`` (containers left to the garbage
collector are what froze Open-Sora's loaders). What is read:

- stream headers: codec, pixel format and bit depth, stored size, sample aspect ratio (SAR),
  exact frame rate as a fraction. The video stream is the first one that is not an attached
  picture (cover art in an audio file is a one-frame "video" stream: such a file has no video);
- the first decoded frame only: proves the bitstream decodes and carries the display matrix
  (rotation). The displayed size is ffmpeg's: the stored width times the SAR (height kept, as
  ``scale=iw*sar:ih`` and ffprobe's display_aspect_ratio), then swapped by a 90/270 rotation;
- the frame count: from the MP4/MOV sample table when present (exact, free), otherwise by
  demuxing packets (Matroska, WebM, MPEG-TS carry no count; AVI headers can state one frame
  too many). Demuxing reads bytes but decodes nothing;
- truncation: an MP4 whose sample index points past the end of the file, a missing moov atom,
  or demuxed packets that end well short of the container's stated duration (checked with
  ``verify="decode"`` too: a cut WebM decodes cleanly up to where it stops).

``verify="decode"`` additionally decodes every frame (the Open-Sora recipe's
``ffmpeg -v error -f null -`` check), for users who want certainty before spending GPU hours.
Everything wrong with the file is raised as ``Rejected(reason, detail)``.
"""

from __future__ import annotations

import contextlib
import os
import struct
from fractions import Fraction

import av

from reelcache.ingest.filters import Rejected
from reelcache.media import sample_aspect_ratio, video_stream
from reelcache.rejects import Reason

# An object in S3 this small is read whole by its probe and its bytes handed back (``probe_data``): its copy into
# the shard then needs no request of its own.
WHOLE_BYTES = 1 << 20

# Containers whose sample table gives an exact frame count without reading packets.
INDEXED_FORMATS = ("mov", "mp4")


def _bit_depth(pix_fmt: str | None) -> int | None:
    try:
        return max(c.bits for c in av.VideoFormat(pix_fmt).components)
    except Exception:
        return None


def _frame_rate(stream) -> Fraction | None:
    for rate in (stream.average_rate, stream.guessed_rate, stream.base_rate):
        if rate and rate > 0:
            return Fraction(rate)
    return None


def mp4_cut(path, size: int) -> str | None:
    """For an ISO-BMFF file FFmpeg cannot open: say how it was cut short, reading box headers only.

    A download or copy that stopped early leaves a top-level box (usually mdat) that claims to
    run past the end of the file, and, when the index was to be written last, no moov box.
    `path`: a file's path, or an open seekable file (an object in S3: ``S3File``).
    """
    with open(path, "rb") if isinstance(path, str | os.PathLike) else contextlib.nullcontext(path) as f:
        f.seek(0)
        head = f.read(8)
        if len(head) < 8 or head[4:8] != b"ftyp":
            return None
        pos, boxes = 0, []
        while pos + 8 <= size:
            f.seek(pos)
            box_size, kind = struct.unpack(">I4s", f.read(8))
            if box_size == 1:
                box_size = struct.unpack(">Q", f.read(8))[0]
            elif box_size == 0:
                box_size = size - pos
            if box_size < 8:
                return f"malformed box at byte {pos}"
            boxes.append(kind)
            if pos + box_size > size:
                missing = "" if b"moov" in boxes else ", and the moov index is missing"
                past = pos + box_size - size
                return f"{kind.decode('latin-1')} box at byte {pos} runs {past} bytes past the end{missing}"
            pos += box_size
        if b"moov" not in boxes:
            return "no moov index box: the file ends before its index was written"
    return None


def probe(path: str, *, max_file_mb: float | None = None, verify: str = "header") -> dict:
    """Return the probe columns of `clips` for `path`, or raise Rejected. `path` may be an object in S3
    (``s3://``): ``probe_object``."""
    if path.startswith("s3://"):
        return probe_object(path, max_file_mb=max_file_mb, verify=verify)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise Rejected(Reason.missing_file, f"{path} does not exist") from None
    except OSError as e:
        raise Rejected(Reason.missing_file, f"{path}: {e.strerror}") from None
    if not os.path.isfile(path):
        raise Rejected(Reason.missing_file, f"{path} is not a regular file")
    if st.st_size == 0:
        raise Rejected(Reason.empty_file, "0 bytes")
    if max_file_mb is not None and st.st_size > max_file_mb * 1e6:
        raise Rejected(Reason.too_large, f"{st.st_size / 1e6:.1f} MB > --max-file-mb {max_file_mb:g}")

    try:
        container = av.open(path, metadata_errors="ignore")
    except av.error.FFmpegError as e:
        cut = mp4_cut(path, st.st_size)
        raise Rejected(Reason.truncated if cut else Reason.undecodable, cut or f"cannot open: {e}") from None
    try:
        return _probe_open(container, path, st.st_size, verify)
    finally:
        container.close()


def probe_object(url: str, *, max_file_mb: float | None = None, verify: str = "header") -> dict:
    """``probe`` of an object in S3, read by ranged reads of the blocks FFmpeg asks for (base/s3io.py: ``S3File``),
    never downloaded whole. A missing object is the row's ``missing_file`` reject naming it; a store failure
    (after its retries) or a stall is an ``S3Error``: the unit fails, the row is not rejected. The result also
    holds ``probe_bytes``, the bytes the probe fetched, and for an object of at most WHOLE_BYTES its bytes,
    ``probe_data`` (``take_probe`` moves both out of the row)."""
    from reelcache.base import s3
    from reelcache.base.s3io import S3File

    h = s3.head(url)
    if h is None:
        raise Rejected(Reason.missing_file, f"{url} does not exist")  # as a local file's
    size = int(h["ContentLength"])
    if size == 0:
        raise Rejected(Reason.empty_file, "0 bytes")
    if max_file_mb is not None and size > max_file_mb * 1e6:
        raise Rejected(Reason.too_large, f"{size / 1e6:.1f} MB > --max-file-mb {max_file_mb:g}")
    f = S3File(url, size)
    try:
        container = av.open(f, metadata_errors="ignore")
    except av.error.FFmpegError as e:
        cut = mp4_cut(f, size)
        raise Rejected(Reason.truncated if cut else Reason.undecodable, cut or f"cannot open: {e}") from None
    try:
        out = _probe_open(container, url, size, verify)
    finally:
        container.close()
    if size <= WHOLE_BYTES:  # small: the rest read too (one GET at most), handed back for the copy into the shard
        f.seek(0)
        out["probe_data"] = f.read()
    out["probe_bytes"] = f.bytes_read
    return out


def _probe_open(container, path: str, size: int, verify: str) -> dict:
    vs = _video_stream(container)
    rate = _frame_rate(vs)
    fmt = container.format.name
    indexed = any(f in fmt.split(",") for f in INDEXED_FORMATS) and vs.frames > 0
    header_duration = (
        float(vs.duration * vs.time_base) if vs.duration else container.duration / 1e6 if container.duration else None
    )
    if indexed:
        entries = vs.index_entries
        if len(entries):
            last = entries[len(entries) - 1]
            if last.pos + last.size > size:
                raise Rejected(Reason.truncated, f"sample index ends at byte {last.pos + last.size}, file has {size}")

    first, packets, decoded, last_end = _scan(container, vs, indexed, verify)
    if verify == "decode":
        num_frames, frames_from = decoded, "decode"
    elif indexed:
        num_frames, frames_from = vs.frames, "header"
    else:
        num_frames, frames_from = packets, "demux"
    if (
        not indexed
        and header_duration
        and last_end is not None
        and rate
        and float(last_end) < header_duration - max(0.5, 0.05 * header_duration)
    ):
        raise Rejected(
            Reason.truncated, f"packets end at {float(last_end):.2f} s, container says {header_duration:.2f} s"
        )
    if verify == "decode" and indexed and decoded < vs.frames:
        raise Rejected(Reason.truncated, f"decoded {decoded} of {vs.frames} frames")

    duration = header_duration if header_duration else (float(num_frames / rate) if rate else None)
    if frames_from != "header" and rate:
        duration = float(num_frames / rate)
    return {
        "num_frames": int(num_frames),
        "frames_from": frames_from,
        "fps": float(rate) if rate else None,
        "fps_num": rate.numerator if rate else None,
        "fps_den": rate.denominator if rate else None,
        "duration": duration,
        **_picture(vs, first),
        "container": fmt,
        "bit_rate": container.bit_rate or None,
        "has_audio": bool(container.streams.audio),
        "file_size": size,
    }


def _video_stream(container):
    """The stream to probe, or Rejected: no video stream, or one no decoder reads."""
    vs = video_stream(container)
    if vs is None:
        kinds = sorted({s.type if s.type != "video" else "video (attached picture)" for s in container.streams}) or [
            "none"
        ]
        raise Rejected(Reason.no_video_stream, f"streams: {', '.join(kinds)}")
    cc = vs.codec_context
    if cc is None or not cc.name:
        raise Rejected(Reason.undecodable, f"no decoder for this video stream ({container.format.name})")
    return vs


def _scan(container, vs, indexed: bool, verify: str):
    """One pass over the packets: decode until the first frame, then (only where the header cannot
    be trusted) keep counting packets without decoding them. Returns (first frame, packets,
    frames decoded, end time of the last packet or None)."""
    vs.thread_type = "AUTO" if verify == "decode" else "SLICE"
    first = None
    packets = decoded = 0
    last_end = None
    try:
        for packet in container.demux(vs):
            if packet.size == 0:
                if first is None or verify == "decode":
                    for frame in vs.decode(packet):  # flush
                        first = first or frame
                        decoded += 1
                continue
            packets += 1
            if packet.pts is not None:
                end = (packet.pts + (packet.duration or 0)) * packet.time_base
                last_end = end if last_end is None else max(last_end, end)
            if first is None or verify == "decode":
                for frame in vs.decode(packet):
                    first = first or frame
                    decoded += 1
            if first is not None and indexed and verify != "decode":
                break
    except av.error.FFmpegError as e:
        if first is None:
            raise Rejected(Reason.undecodable, f"decode failed: {e}") from None
        raise Rejected(
            Reason.truncated if verify != "decode" else Reason.undecodable, f"after {packets} packets: {e}"
        ) from None
    if first is None:
        raise Rejected(Reason.undecodable, f"no frame decodes ({packets} packets read)")
    return first, packets, decoded, last_end


def _picture(vs, first) -> dict:
    """The picture columns: stored and displayed size (SAR, then rotation), codec and pixel format."""
    cc = vs.codec_context
    rotation = int(first.rotation or 0) % 360
    cw, ch = cc.width or first.width, cc.height or first.height
    sar = sample_aspect_ratio(vs)
    dw = max(1, round(cw * sar))  # displayed, before rotation: stretch the width
    w, h = (ch, dw) if rotation in (90, 270) else (dw, ch)
    pix_fmt = cc.pix_fmt or first.format.name
    return {
        "width": w,
        "height": h,
        "coded_width": cw,
        "coded_height": ch,
        "rotation": rotation,
        "sar_num": sar.numerator,
        "sar_den": sar.denominator,
        "aspect_ratio": h / w if w else None,
        "resolution": h * w,
        "codec": getattr(cc.codec, "canonical_name", None) or cc.name,  # 'av1', not the decoder 'libdav1d'
        "pix_fmt": pix_fmt,
        "bit_depth": _bit_depth(pix_fmt),
    }
