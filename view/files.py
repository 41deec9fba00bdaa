"""Which files the viewer serves, and how: paths confined to ROOT, byte ranges of a file or of a slice.

A path from a URL is relative to ROOT; it is refused when absolute, when any part is ``..``, or when
it resolves (symlinks followed) outside ROOT. Rejected input files live where the source table points
(usually outside ROOT): they are served only from folders the operator names with ``--videos``.

Videos are played straight from their shards: the member's bytes are a slice (offset, size) of the
tar, and a ``Range`` request is answered from that slice with ``os.pread``, so nothing is extracted
and a seek in the browser reads only what it shows. A shard in S3 (a root ``s3://...``) is read the same
way, by exact ranged GETs of the slice (base/s3.py: ``get_range``), at most ``S3_CHUNK`` bytes each.
"""

from __future__ import annotations

import mimetypes
import os
import re
from pathlib import Path, PurePosixPath
from urllib.parse import quote

from starlette.responses import Response, StreamingResponse

CHUNK = 1 << 20
S3_CHUNK = 8 << 20  # a request to the store costs ~ms: bigger pieces than a pread's
VIDEO_TYPES = {
    "mp4": "video/mp4",
    "m4v": "video/mp4",
    "mov": "video/mp4",  # QuickTime is MP4's ancestor: browsers play its H.264 when told it is mp4
    "webm": "video/webm",
    "mkv": "video/webm",  # Matroska: WebM is its subset; Chromium demuxes both
    "avi": "video/x-msvideo",
}
# What Chromium decodes in software: the rest (HEVC, MPEG-4 Part 2, ProRes, ...) is named on the page.
BROWSER_CODECS = {"h264", "vp8", "vp9", "av1", "theora"}
BROWSER_CONTAINERS = {"mp4", "m4v", "mov", "webm", "mkv"}


class Refused(ValueError):
    """A path the viewer will not serve: one line for the response."""


class Gone(Refused):
    """What a takedown withdrew (lineage/takedown.py): never served again (410)."""


class NotFound(LookupError):
    """A clip, manifest, run or latent the catalog or the root does not hold (404)."""


def confined(base: Path, rel: str) -> Path:
    """``rel`` (from a URL) as a path under ``base``, or Refused."""
    p = PurePosixPath(rel)
    if p.is_absolute() or rel.startswith(("/", "\\")) or re.match(r"^[A-Za-z]:", rel):
        raise Refused(f"refused: {rel!r} is an absolute path (paths are relative to the data root)")
    if ".." in p.parts:
        raise Refused(f"refused: {rel!r} climbs out with '..'")
    return within(base / p, [base])


def within(path: Path, bases: list[Path]) -> Path:
    """``path`` resolved (symlinks followed), if it lies under one of ``bases`` (resolved); else Refused."""
    real = Path(os.path.realpath(path))
    for b in bases:
        if real == Path(os.path.realpath(b)) or real.is_relative_to(os.path.realpath(b)):
            return real
    raise Refused(f"refused: {path} is outside the data root{' and --videos' if len(bases) > 1 else ''}")


# What a file under ROOT may be served as, inline: types a browser shows and never runs (with nosniff).
# Anything else (HTML, SVG, XML, PDF, scripts, ...) is an attachment of type application/octet-stream:
# never rendered on the viewer's origin, where a page of it could read everything the viewer serves.
PASSIVE_TYPES = {*VIDEO_TYPES.values(), "image/png", "image/jpeg", "image/gif", "image/webp", "audio/mpeg",
                 "audio/mp4", "audio/wav", "audio/ogg"}  # fmt: skip
TEXT_EXTS = {"txt", "log", "json", "jsonl", "toml", "csv", "tsv", "yaml", "yml", "md", "sql"}


def content_type(name: str) -> str:
    ext = name.rsplit(".", 1)[-1].lower()
    return VIDEO_TYPES.get(ext) or mimetypes.guess_type(name)[0] or "application/octet-stream"


def served_as(name: str) -> tuple[str, dict]:
    """(Content-Type, extra headers) of a file under ROOT: a passive type inline, plain text as text/plain,
    anything else an attachment the browser saves instead of rendering."""
    ext = name.rsplit(".", 1)[-1].lower() if "." in name else ""
    kind = content_type(name)
    if kind in PASSIVE_TYPES:
        return kind, {}
    if ext in TEXT_EXTS:
        return "text/plain; charset=utf-8", {}
    return "application/octet-stream", {"Content-Disposition": f"attachment; filename*=UTF-8''{quote(name, safe='')}"}


def playable(codec: str | None, ext: str | None) -> str | None:
    """None when Chromium can play the video, else one line saying why not."""
    ext = (ext or "").lower()
    if ext not in BROWSER_CONTAINERS:
        return f"browsers do not play the {ext or 'unknown'} container (codec {codec}): download the file instead"
    if codec and codec.lower() not in BROWSER_CODECS:  # unknown (a reject's failed probe): let the browser try
        return f"browsers do not decode {codec or 'this'} video (they play H.264, VP8, VP9, AV1): download the file"
    return None


def _parse_range(header: str | None, size: int) -> tuple[int, int] | None:
    """(first, last) inclusive of a single ``bytes=`` range, clipped to the size; None: the whole body."""
    if not header:
        return None
    m = re.fullmatch(r"\s*bytes=(\d*)-(\d*)\s*", header)
    if not m or (not m[1] and not m[2]):
        raise Refused(f"unsupported Range {header!r} (one bytes=first-last range)")
    if m[1]:
        first, last = int(m[1]), min(int(m[2]) if m[2] else size - 1, size - 1)
    else:  # suffix: the last N bytes
        first, last = max(0, size - int(m[2])), size - 1
    if first >= size or first > last:
        raise Refused(f"Range {header!r} outside 0-{size - 1}")
    return first, last


def slice_response(
    path, offset: int, size: int, range_header: str | None, media_type: str, extra: dict | None = None
) -> Response:
    """The bytes [offset, offset + size) of ``path`` (a file, or an object: base/s3.py's Url) as a file of its
    own, honouring one Range."""
    try:
        rng = _parse_range(range_header, size)
    except Refused as e:
        return Response(str(e), status_code=416, headers={"Content-Range": f"bytes */{size}"})
    first, last = rng or (0, size - 1)
    headers = {"Accept-Ranges": "bytes", "Content-Length": str(last - first + 1), "Cache-Control": "max-age=3600"}
    headers.update(extra or {})
    if rng:
        headers["Content-Range"] = f"bytes {first}-{last}/{size}"

    def from_store():
        from reelcache.base import s3

        pos, end = offset + first, offset + last + 1
        while pos < end:
            n = min(S3_CHUNK, end - pos)
            yield s3.get_range(path, pos, n)  # exactly n bytes, or an error (the response is cut: never wrong bytes)
            pos += n

    def body():
        fd = os.open(path, os.O_RDONLY)
        try:
            pos, end = offset + first, offset + last + 1
            while pos < end:
                data = os.pread(fd, min(CHUNK, end - pos), pos)
                if not data:
                    return
                pos += len(data)
                yield data
        finally:
            os.close(fd)

    stream = body() if isinstance(path, (str, os.PathLike)) else from_store()
    return StreamingResponse(stream, status_code=206 if rng else 200, headers=headers, media_type=media_type)


def file_response(path: Path, range_header: str | None) -> Response:
    kind, extra = served_as(path.name)
    return slice_response(path, 0, path.stat().st_size, range_header, kind, extra)
